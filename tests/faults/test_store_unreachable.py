"""A node whose adapter store is slow, stopped, or hung, as real processes (`inference-node
serve`, `lora-client`, the `openai` client), one scenario in steps over one node:

- a fetch that is streaming ends when the request that wanted it ends (the store sees its
  call cancelled);
- with the store stopped, a request for an adapter on no tier of the node fails within 5 s on
  every API, UNAVAILABLE / 503 naming the store and telling clients a retry will not help
  (so their default retries do not multiply the wait), never blaming the node;
- SIGTERM while a fetch streams stops the node within 4 s at the default drain settings (the
  store sees the call cancelled): the 1.5 s NOT_SERVING window, then a teardown that takes
  0.3 s on an idle machine and took 1.8 s on a 2-core CI machine shared with three other
  test workers.

The store is a fake gRPC AdapterStore: it describes one adapter, then streams its bytes never
(FetchAdapter waits until cancelled). A store that takes connections and never answers is
StoreSource's unit test (tests/adapters/test_store_source_limits.py).
"""
from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Iterator

import grpc
import openai
import pytest

from adapter_store.records import SYNCED, AdapterInfo, CatalogEvent, FileEntry, Manifest
from harness import wait_for
from lora.v1 import adapter_store_pb2 as spb
from lora.v1 import adapter_store_pb2_grpc as spb_grpc
from lora.v1 import inference_pb2 as pb
from lora_client.node_client import NodeClient, RetryPolicy, said_no_retry
from lora_client.processes import Child, free_port, wait_healthy

PROMPT = [11, 2345, 876, 40]
FAIL_WITHIN_S = 5.0
STOP_WITHIN_S = 4.0
SLOW = "slow"
MANIFEST = Manifest(AdapterInfo(SLOW, "0123456789abcdef", rank=8, lora_alpha=16.0, target_modules=("q_proj",),
                                size_bytes=1 << 20, valid=True),
                    "{}", (FileEntry("adapter_config.json", 2, "0" * 64), FileEntry("adapter_model.safetensors",
                                                                                    (1 << 20) - 2, "1" * 64)),
                    "2" * 64)


class StallingStore(spb_grpc.AdapterStoreServicer):
    """Describes SLOW, then never sends a byte of it; counts the fetches begun and cancelled,
    and the catalog watches opened."""

    def __init__(self) -> None:
        self.fetches = 0
        self.cancelled = 0
        self.watches = 0
        self.lock = threading.Lock()

    def GetManifest(self, request, context):
        if request.name != SLOW:
            context.abort(grpc.StatusCode.NOT_FOUND, f"adapter {request.name!r} is not in the catalog")
        return MANIFEST.to_proto()

    def ListAdapters(self, request, context):
        return spb.ListStoreAdaptersResponse(adapters=[MANIFEST.info.to_proto()])

    def WatchAdapters(self, request, context):
        with self.lock:
            self.watches += 1
        yield CatalogEvent(SYNCED).to_proto()
        while context.is_active():
            time.sleep(0.05)

    def FetchAdapter(self, request, context):
        with self.lock:
            self.fetches += 1
        while context.is_active():
            time.sleep(0.02)
        with self.lock:
            self.cancelled += 1
        return
        yield  # a stream that ends without a message


class FakeStore:
    """The fake store's server on a fixed port: stopped and started again on it."""

    def __init__(self) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.servicer = StallingStore()
        self.server: grpc.Server | None = None

    def start(self) -> None:
        self.server = grpc.server(futures.ThreadPoolExecutor(16))
        spb_grpc.add_AdapterStoreServicer_to_server(self.servicer, self.server)
        self.server.add_insecure_port(self.address)
        self.server.start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(0).wait()
            self.server = None


class NodeProcess:
    def __init__(self, root: Path, model: Path, store: str) -> None:
        self.port, self.http_port = free_port(), free_port()
        self.target = f"127.0.0.1:{self.port}"
        self.http_url = f"http://127.0.0.1:{self.http_port}/v1"
        self.log = root / f"node-{self.port}.log"
        # The default drain settings: the 4 s bound of a stop includes the NOT_SERVING window
        # (--drain-min-seconds, 1.5 s) that a proxy's health checks need.
        self.child = Child("inference-node", [
            sys.executable, "-m", "inference_node.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
            "--http-port", str(self.http_port), "--model", str(model), "--device", "cpu", "--num-kv-blocks", "64",
            "--cpu-threads", "1", "--max-loras", "2", "--max-lora-rank", "8", "--adapter-store", store], self.log)
        wait_healthy(self.target, 120, self.child)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture(scope="module")
def store() -> Iterator[FakeStore]:
    fake = FakeStore()
    fake.start()
    yield fake
    fake.stop()


@pytest.fixture(scope="module")
def node(tmp_path_factory, tiny_llama_path, store) -> Iterator[NodeProcess]:
    n = NodeProcess(tmp_path_factory.mktemp("store-unreachable"), tiny_llama_path, store.address)
    yield n
    n.child.stop(30)


def _request(adapter: str) -> pb.GenerateRequest:
    return NodeClient.request(adapter=adapter, prompt_token_ids=PROMPT, max_tokens=4)


def test_a_fetch_ends_when_its_request_does(node, store) -> None:
    fake = store.servicer
    with NodeClient(node.target) as client:
        stream = client.stream(_request(SLOW), timeout=60)
        wait_for(lambda: fake.fetches == 1, 20, "the node's fetch to begin")
        stream.cancel()
    wait_for(lambda: fake.cancelled == 1, 5, "the fetch to end with its request")


def test_store_stopped_grpc_fails_fast_naming_the_store_and_says_not_to_retry(node, store) -> None:
    store.stop()
    with NodeClient(node.target, retry=RetryPolicy()) as client:  # a policy that retries UNAVAILABLE 5 times
        started = time.monotonic()
        answer = client.answer(_request("nowhere"), timeout=60)
        with pytest.raises(grpc.RpcError) as err:
            list(answer)
        waited = time.monotonic() - started
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert store.address in err.value.details() and "'nowhere'" in err.value.details(), err.value.details()
        assert said_no_retry(err.value) and answer.attempts == 1
        assert waited < FAIL_WITHIN_S, waited
        assert client.generate(NodeClient.request(prompt_token_ids=PROMPT, max_tokens=3), 60).completion_tokens


def test_store_stopped_the_openai_client_gets_one_503_naming_the_store(node, store) -> None:
    with openai.OpenAI(base_url=node.http_url, api_key="-", timeout=60) as api:  # the client's default retries
        started = time.monotonic()
        with pytest.raises(openai.InternalServerError) as err:
            api.completions.create(model="nowhere", prompt=PROMPT, max_tokens=4)
        waited = time.monotonic() - started
    assert err.value.status_code == 503 and store.address in err.value.body["message"]
    assert err.value.response.headers["x-should-retry"] == "false"
    assert waited < FAIL_WITHIN_S, waited  # one attempt: no retries after it


def test_store_stopped_lora_client_says_the_store_is_down_not_the_node(node, store) -> None:
    started = time.monotonic()
    done = subprocess.run([str(Path(sys.executable).parent / "lora-client"), "--node", node.target, "generate",
                           "--adapter", "nowhere", "hi"], capture_output=True, text=True, timeout=60)
    waited = time.monotonic() - started
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 1 and len(lines) == 1, done.stderr
    assert lines[0].startswith("lora-client generate: UNAVAILABLE: adapter 'nowhere'") and store.address in lines[0]
    assert "cannot reach the node" not in lines[0]
    assert waited < FAIL_WITHIN_S + 2, waited  # + the CLI's own start


def test_sigterm_with_a_fetch_in_flight_stops_the_node_within_3s(node, store) -> None:
    """Last: it stops the module's node. The request goes once the node's catalog watch is
    back on the restarted store: until its channel reconnects (within its 2 s backoff) the
    node answers a request for an adapter it must fetch UNAVAILABLE at once, as above."""
    fake = store.servicer
    watches = fake.watches
    store.start()
    wait_for(lambda: fake.watches > watches, 20, "the node's catalog watch to reconnect")
    fetches = fake.fetches
    outcome: dict[str, object] = {}

    def waiting_request() -> None:
        with NodeClient(node.target) as client:
            try:
                client.generate(_request(SLOW), 60)
            except grpc.RpcError as exc:
                outcome["code"] = exc.code()

    thread = threading.Thread(target=waiting_request)
    thread.start()
    wait_for(lambda: fake.fetches == fetches + 1, 20, "the node's fetch to begin")
    cancelled = fake.cancelled
    started = time.monotonic()
    node.child.proc.send_signal(signal.SIGTERM)
    code = node.child.proc.wait(30)
    stopped = time.monotonic() - started
    thread.join(10)
    timeline = "\n".join(line for line in node.log_text().splitlines()[-12:])
    assert code == 0 and stopped < STOP_WITHIN_S, f"exit {code} after {stopped:.2f} s:\n{timeline}"
    assert outcome.get("code") == grpc.StatusCode.UNAVAILABLE
    assert fake.cancelled == cancelled + 1
    assert "did not stop" not in node.log_text()
