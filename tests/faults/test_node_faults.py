"""Fault injection with real processes: SeaweedFS, `adapter-store serve` and `inference-node
serve`, talking real gRPC. A mixed workload (the base model and a warm adapter) runs the whole
time; each fault is injected under it:

- the store is killed while the node loads a cold adapter, and comes back: the load resumes
  and the request gets the reference's tokens;
- the store stays down past the node's fetch timeout: the waiting request gets UNAVAILABLE,
  no half-loaded adapter is ever used, and once the store is back the adapter loads;
- S3 (SeaweedFS) is down: the store serves an adapter from its disk cache;
- a client cancels in the middle of a stream;
- the node gets SIGTERM: running requests finish, new ones get UNAVAILABLE, it exits 0.

Every workload request must either equal the PEFT reference or end with a documented status,
and after each fault the node returns to idle (no running or waiting request, every KV block
free, every adapter reference count zero).
"""
from __future__ import annotations

import random
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import grpc
import pytest

from adapter_store.push import push_adapter
from adapter_store.s3 import S3Store
from adapter_store.seaweedfs import SeaweedFS
from harness import make_peft_adapter, peft_greedy
from lora.v1 import inference_pb2 as pb
from lora_client.node_client import NodeClient
from lora_client.processes import Child, free_port, wait_healthy

MAX_NEW = 8
LONG = 900  # tokens: seconds of decoding on the tiny model, so SIGTERM lands mid-stream
# The drain deadline is a ceiling, not the test's pace: a 2-core CI machine running other test
# files beside this one took over 30 s to decode the four long requests.
DRAIN_S = 150
FETCH_TIMEOUT_S = 10.0
ADAPTERS = {"warm": 1, "cold-a": 2, "cold-b": 3, "cached": 4, "long": 5}
_rng = random.Random(7)
PROMPTS = [[_rng.randrange(100, 40000) for _ in range(_rng.randrange(4, 24))] for _ in range(4)]


@dataclass
class Stack:
    root: Path
    seaweed: SeaweedFS
    bucket: str
    store_port: int
    node_port: int
    store: Child | None = None
    node: Child | None = None
    expected: dict[str, list[list[int]]] = field(default_factory=dict)

    @property
    def node_target(self) -> str:
        return f"127.0.0.1:{self.node_port}"

    def start_store(self) -> None:
        self.store = Child("adapter-store", [
            sys.executable, "-m", "adapter_store.cli", "serve", "--host", "127.0.0.1",
            "--port", str(self.store_port), "--s3-endpoint", self.seaweed.endpoint_url, "--bucket", self.bucket,
            "--cache-dir", str(self.root / "store-cache"), "--poll-interval", "0.5"],
            self.root / "adapter-store.log", self.seaweed.env())
        wait_healthy(f"127.0.0.1:{self.store_port}", 60, self.store)

    def kill_store(self) -> None:
        assert self.store is not None
        self.store.proc.send_signal(signal.SIGKILL)
        self.store.proc.wait(10)
        self.store.stop()

    def start_node(self, model: Path) -> None:
        self.node = Child("inference-node", [
            sys.executable, "-m", "inference_node.cli", "serve", "--host", "127.0.0.1",
            "--port", str(self.node_port), "--model", str(model), "--device", "cpu", "--num-kv-blocks", "256",
            "--max-loras", "2", "--max-lora-rank", "8", "--max-cpu-loras", "3",
            "--adapter-store", f"127.0.0.1:{self.store_port}", "--no-adapter-disk-tier",
            "--adapter-fetch-timeout", str(FETCH_TIMEOUT_S), "--drain-seconds", str(DRAIN_S), "--debug-checks"],
            self.root / "inference-node.log")
        wait_healthy(self.node_target, 120, self.node)

    def log_tail(self) -> str:
        text = (self.root / "inference-node.log").read_text(errors="replace")
        return "\n".join(text.splitlines()[-30:])


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_llama_path) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("faults")
    seaweed = SeaweedFS(root / "seaweedfs")
    seaweed.start()
    bucket = seaweed.create_bucket(f"faults-{uuid.uuid4().hex[:8]}")
    s3 = S3Store(bucket, seaweed.boto3_client())
    s = Stack(root, seaweed, bucket, free_port(), free_port())
    for name, seed in ADAPTERS.items():
        folder = make_peft_adapter(tiny_llama_path, root / "adapters" / name, 8, 16.0,
                                   ["q_proj", "v_proj", "down_proj"], seed=seed, scale=3.0)
        push_adapter(folder, name, s3, "adapters/", progress=False)
        s.expected[name] = peft_greedy(tiny_llama_path, folder, PROMPTS, MAX_NEW)
    s.expected[""] = peft_greedy(tiny_llama_path, None, PROMPTS, MAX_NEW)
    try:  # a node that fails to start must not leave the store (or SeaweedFS) running
        s.start_store()
        s.start_node(tiny_llama_path)
        yield s
    finally:
        for child in (s.node, s.store):
            if child is not None:
                child.stop()
        seaweed.close()


def request(adapter: str, prompt: int, max_tokens: int = MAX_NEW) -> pb.GenerateRequest:
    return NodeClient.request(adapter=adapter, prompt_token_ids=PROMPTS[prompt], max_tokens=max_tokens,
                              ignore_eos=True)


class Workload:
    """Threads sending base-model and warm-adapter requests until stopped; every result is
    checked against the reference, every failure must carry an allowed status."""

    def __init__(self, s: Stack, threads: int = 3, allowed: frozenset = frozenset()) -> None:
        self.s, self.allowed = s, allowed
        self.stop = threading.Event()
        self.ok = 0
        self.errors: list[str] = []
        self.statuses: list[grpc.StatusCode] = []
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]

    def __enter__(self) -> "Workload":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)
        assert not self.errors, self.errors[:5]

    def _run(self, seed: int) -> None:
        rng = random.Random(seed)
        with NodeClient(self.s.node_target) as client:
            while not self.stop.is_set():
                adapter, prompt = rng.choice(["", "warm"]), rng.randrange(len(PROMPTS))
                try:
                    got = client.generate(request(adapter, prompt), timeout=60)
                except grpc.RpcError as exc:
                    self.statuses.append(exc.code())
                    if exc.code() not in self.allowed:
                        self.errors.append(f"{adapter or 'base'}: {exc.code().name} {exc.details()}")
                    continue
                if got.token_ids != self.s.expected[adapter][prompt]:
                    self.errors.append(f"{adapter or 'base'} prompt {prompt}: wrong tokens")
                else:
                    self.ok += 1


def assert_idle(s: Stack, timeout: float = 20.0) -> None:
    """No request in flight, every KV block free, every adapter reference released."""
    deadline = time.monotonic() + timeout
    with NodeClient(s.node_target) as client:
        while True:
            stats = client.stats()
            adapters = client.stub.ListAdapters(pb.ListAdaptersRequest(), timeout=10).adapters
            idle = (stats.running_requests == 0 and stats.waiting_requests == 0
                    and stats.kv_blocks_free == stats.kv_blocks_total and all(a.ref_count == 0 for a in adapters))
            if idle:
                return
            assert time.monotonic() < deadline, f"node not idle: {stats} {list(adapters)}"
            time.sleep(0.1)


def test_warm_up(stack) -> None:
    with NodeClient(stack.node_target) as client:
        # The workload's adapter is pinned, so no cold load below can evict it while the store is down.
        client.stub.LoadAdapter(pb.LoadAdapterRequest(name="warm", pin=True), timeout=60)
        for adapter in ("", "warm", "cached"):
            assert client.generate(request(adapter, 0), timeout=60).token_ids == stack.expected[adapter][0]
    assert_idle(stack)


def test_store_killed_while_a_cold_adapter_loads_then_back(stack) -> None:
    with Workload(stack) as load:
        stack.kill_store()
        result: dict[str, object] = {}

        def cold() -> None:
            with NodeClient(stack.node_target) as client:
                try:
                    result["got"] = client.generate(request("cold-a", 1), timeout=60).token_ids
                except grpc.RpcError as exc:
                    result["got"] = exc.code()
        waiter = threading.Thread(target=cold)
        waiter.start()
        time.sleep(1.0)  # the node is retrying the dead store, within its fetch timeout
        stack.start_store()
        waiter.join(60)
        assert result["got"] == stack.expected["cold-a"][1], (result, stack.log_tail())
        time.sleep(0.5)
    assert load.ok > 0
    assert_idle(stack)


def test_store_down_past_the_fetch_timeout_is_unavailable_then_recovers(stack) -> None:
    with Workload(stack) as load:
        stack.kill_store()
        started = time.monotonic()
        with NodeClient(stack.node_target) as client:
            with pytest.raises(grpc.RpcError) as err:
                client.generate(request("cold-b", 2), timeout=60)
            waited = time.monotonic() - started
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
            assert "cold-b" in err.value.details()
            assert waited < FETCH_TIMEOUT_S + 10
            listed = {a.name for a in client.stub.ListAdapters(pb.ListAdaptersRequest(), timeout=10).adapters}
            assert "cold-b" not in listed  # nothing half-loaded is kept
            stack.start_store()
            assert client.generate(request("cold-b", 2), timeout=60).token_ids == stack.expected["cold-b"][2]
    assert load.ok > 0
    assert_idle(stack)


def test_s3_down_the_store_serves_from_its_disk_cache(stack) -> None:
    with NodeClient(stack.node_target) as client:
        client.stub.UnloadAdapter(pb.UnloadAdapterRequest(name="cached"), timeout=10)
        assert_idle(stack)
        with Workload(stack) as load:
            stack.seaweed.kill()
            try:
                got = client.generate(request("cached", 3), timeout=60)
                assert got.token_ids == stack.expected["cached"][3]
            finally:
                stack.seaweed.start()
    assert load.ok > 0
    assert_idle(stack)


def test_client_cancels_in_the_middle_of_a_stream(stack) -> None:
    with Workload(stack) as load:
        with NodeClient(stack.node_target) as client:
            for adapter in ("long", ""):
                stream = client.stream(request(adapter, 0, max_tokens=200), timeout=60)
                first = next(stream)
                assert first.token_ids
                stream.cancel()
                with pytest.raises(grpc.RpcError) as err:
                    list(stream)
                assert err.value.code() == grpc.StatusCode.CANCELLED
    assert load.ok > 0
    assert_idle(stack)


def test_sigterm_drains_running_requests_and_refuses_new_ones(stack) -> None:
    results: dict[int, object] = {}
    started = threading.Barrier(4 + 1)

    def long_request(i: int) -> None:
        adapter = ["", "warm", "long", ""][i]
        with NodeClient(stack.node_target) as client:
            stream = client.stream(request(adapter, i, max_tokens=LONG), timeout=DRAIN_S + 60)
            tokens = list(next(stream).token_ids)
            started.wait(30)
            try:
                for msg in stream:
                    tokens += msg.token_ids
                    if msg.finish_reason:
                        results[i] = (msg.finish_reason, tokens)
            except grpc.RpcError as exc:
                results[i] = exc.code()

    threads = [threading.Thread(target=long_request, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    started.wait(60)
    assert stack.node is not None
    stack.node.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 15
    with NodeClient(stack.node_target) as client:
        while True:  # once the node has seen the signal, new work is refused
            try:
                client.generate(request("", 0, max_tokens=1), timeout=10)
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc.details()
                break
            assert time.monotonic() < deadline, "the node kept taking new requests after SIGTERM"
            time.sleep(0.02)
    assert any(t.is_alive() for t in threads), "the long requests ended before the drain began"
    for t in threads:
        t.join(DRAIN_S + 60)
    for i, adapter in enumerate(["", "warm", "long", ""]):
        assert isinstance(results.get(i), tuple), (i, results.get(i), stack.log_tail())
        reason, tokens = results[i]
        assert reason == "length" and len(tokens) == LONG
        assert tokens[:MAX_NEW] == stack.expected[adapter][i], (i, adapter)
    assert stack.node.proc.wait(60) == 0
