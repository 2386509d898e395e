"""The fleet's pieces without nodes: the health check's bytes against a real gRPC health
server, the proxy's configuration against HAProxy's own checker, the typed client's retry
(only before a first token) and its routing header, against a small gRPC servicer."""
from __future__ import annotations

import socket
import subprocess
import threading
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from lora.v1 import inference_pb2 as pb
from lora.v1 import inference_pb2_grpc as pb_grpc
from lora_client.haproxy import (HEALTH_SERVICE, MISSING, SERVING_REPLY, ProxySettings, grpc_health_check_request,
                                 haproxy_binary, render_config)
from lora_client.node_client import (ADAPTER_HEADER, SHOULD_RETRY, NodeClient, NodeLost, RetryPolicy, lost_in_transit,
                                     said_no_retry)


def raw_check(port: int) -> bytes:
    """What the proxy's tcp-check does: the bytes out, everything the server answers in 1 s."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(grpc_health_check_request())
        s.settimeout(1.0)
        data = b""
        try:
            while chunk := s.recv(65536):
                data += chunk
        except socket.timeout:
            pass
    return data


def test_the_health_check_bytes_are_a_grpc_health_call_that_tells_serving_from_not() -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        servicer.set(HEALTH_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        assert bytes.fromhex(SERVING_REPLY) in raw_check(port)
        servicer.set(HEALTH_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
        answer = raw_check(port)
        assert bytes.fromhex("00000000020802") in answer and bytes.fromhex(SERVING_REPLY) not in answer
        servicer.set(HEALTH_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)  # the check asks for the node's service
        assert bytes.fromhex(SERVING_REPLY) in raw_check(port)
    finally:
        server.stop(None)


@pytest.mark.skipif(haproxy_binary() is None, reason=MISSING)
@pytest.mark.parametrize("settings", [
    ProxySettings((("n1", "127.0.0.1:50061"), ("n2", "127.0.0.1:50062"))),
    ProxySettings((("n1", "127.0.0.1:50061"),), routing="roundrobin"),
    ProxySettings((("inference-node", "inference-node:50051"), ("inference-node-2", "inference-node-2:50051")),
                  host="0.0.0.0", dns_resolver="127.0.0.11:53"),
    ProxySettings((("n1", "127.0.0.1:50061"), ("n2", "127.0.0.1:50062")), http_port=8080,
                  http_servers=(("n1", "127.0.0.1:8001"), ("n2", "127.0.0.1:8002")), base_model="base"),
    ProxySettings((("inference-node", "inference-node:50051"),), host="0.0.0.0", dns_resolver="127.0.0.11:53",
                  http_port=8080, http_servers=(("inference-node", "inference-node:8000"),)),
], ids=["adapter", "roundrobin", "docker-names", "http", "http-docker-names"])
def test_haproxy_accepts_the_rendered_config(settings, tmp_path) -> None:
    path = tmp_path / "haproxy.cfg"
    path.write_text(render_config(settings))
    done = subprocess.run([haproxy_binary(), "-c", "-f", str(path)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr
    text = path.read_text()
    assert text.count("proto h2") == 3  # HTTP/2 on the listener and to the servers of both backends
    if settings.routing == "adapter":
        assert f"balance hdr({ADAPTER_HEADER})" in text and "hash-type consistent" in text
        assert "hash-balance-factor 150" in text and "balance leastconn" in text
    if settings.http_port:  # the HTTP entry: the body's model (or the header) hashed the same way
        assert f"bind {settings.host}:{settings.http_port}\n" in text and "option http-buffer-request" in text
        assert "req.body,json_query('$.model')" in text
        assert text.count(f"balance hdr({ADAPTER_HEADER})") == 2
        assert all(f"server {n} {a} track by_adapter/{n}" in text for n, a in settings.http_servers)
    else:
        assert "frontend openai" not in text


def test_the_http_entry_needs_every_nodes_http_address() -> None:
    with pytest.raises(ValueError, match="HTTP address"):
        ProxySettings((("n1", "h:1"), ("n2", "h:2")), http_port=8080, http_servers=(("n1", "h:8001"),))


class ScriptedNode(pb_grpc.InferenceNodeServicer):
    """Answers Generate as scripted per call: 'refuse' (UNAVAILABLE, nothing streamed),
    'cut' (two tokens, then UNAVAILABLE) or 'ok' (three tokens and a finish)."""

    def __init__(self, script: list[str]) -> None:
        self.script = list(script)
        self.calls: list[dict[str, str]] = []

    def Generate(self, request, context):
        self.calls.append(dict(context.invocation_metadata()))
        step = self.script.pop(0) if self.script else "ok"
        if step == "refuse":
            context.abort(grpc.StatusCode.UNAVAILABLE, "draining: retry on another node")
        if step == "final":  # a retry would fail the same way: the node says so
            context.set_trailing_metadata(((SHOULD_RETRY, "false"),))
            context.abort(grpc.StatusCode.UNAVAILABLE, "the adapter store at s:1 cannot be reached")
        yield pb.GenerateResponse(token_ids=[1, 2])
        if step == "cut":
            context.abort(grpc.StatusCode.UNAVAILABLE, "engine died")
        yield pb.GenerateResponse(token_ids=[3], finish_reason="length", completion_tokens=3)

    def LoadAdapter(self, request, context):
        self.calls.append(dict(context.invocation_metadata()))
        return pb.LoadAdapterResponse(name=request.name, tier=pb.ADAPTER_TIER_GPU)


@pytest.fixture
def scripted():
    def start(script: list[str]):
        node = ScriptedNode(script)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_InferenceNodeServicer_to_server(node, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return node, f"127.0.0.1:{port}"

    servers: list[grpc.Server] = []
    yield start
    for server in servers:
        server.stop(None)


FAST = RetryPolicy(attempts=4, first_backoff_s=0.01, max_backoff_s=0.05)


def test_refusals_before_the_first_token_are_retried_and_the_adapter_rides_in_a_header(scripted) -> None:
    node, target = scripted(["refuse", "refuse", "ok"])
    with NodeClient(target, retry=FAST) as client:
        done = client.generate(client.request(adapter="tenant-a", prompt_token_ids=[1]), timeout=10)
        assert done.token_ids == [1, 2, 3] and done.attempts == 3
        client.load_adapter("tenant-b")
    assert [c.get(ADAPTER_HEADER) for c in node.calls] == ["tenant-a"] * 3 + ["tenant-b"]
    with NodeClient(target, retry=FAST) as client:
        client.generate(client.request(prompt_token_ids=[1]), timeout=10)  # the base model: no header
    assert ADAPTER_HEADER not in node.calls[-1]


def test_an_answer_that_streamed_a_token_is_never_asked_again(scripted) -> None:
    node, target = scripted(["refuse", "cut", "ok"])
    with NodeClient(target, retry=FAST) as client:
        answer = client.answer(client.request(prompt_token_ids=[1]), timeout=10)
        seen = []
        with pytest.raises(grpc.RpcError) as err:
            for msg in answer:
                seen += msg.token_ids
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "engine died" in err.value.details()
    assert seen == [1, 2] and answer.attempts == 2 and len(node.calls) == 2


def test_retries_stop_at_the_policy_and_without_one_nothing_is_retried(scripted) -> None:
    node, target = scripted(["refuse"] * 10)
    with NodeClient(target, retry=FAST) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.generate(client.request(prompt_token_ids=[1]), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and len(node.calls) == FAST.attempts
    with NodeClient(target) as client:
        with pytest.raises(grpc.RpcError):
            client.generate(client.request(prompt_token_ids=[1]), timeout=10)
    assert len(node.calls) == FAST.attempts + 1


def test_a_refusal_the_node_marks_final_is_not_retried(scripted) -> None:
    node, target = scripted(["final", "ok"])
    with NodeClient(target, retry=FAST) as client:
        answer = client.answer(client.request(prompt_token_ids=[1]), timeout=10)
        with pytest.raises(grpc.RpcError) as err:
            list(answer)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and said_no_retry(err.value)
    assert answer.attempts == 1 and len(node.calls) == 1


def test_retries_end_within_the_deadline(scripted) -> None:
    node, target = scripted(["refuse"] * 100)
    slow = RetryPolicy(attempts=100, first_backoff_s=0.2, max_backoff_s=0.2)
    started = time.monotonic()
    with NodeClient(target, retry=slow) as client:
        with pytest.raises(grpc.RpcError):
            client.generate(client.request(prompt_token_ids=[1]), timeout=1.0)
    assert time.monotonic() - started < 1.5 and len(node.calls) < 10


class FakeError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def test_a_stream_ended_without_status_by_a_proxy_is_a_lost_node() -> None:
    haproxy = FakeError(grpc.StatusCode.UNKNOWN, "Stream removed (Data frame with END_STREAM flag received)")
    reset = FakeError(grpc.StatusCode.INTERNAL, "Received RST_STREAM with error code 2")
    assert lost_in_transit(haproxy) and lost_in_transit(reset)
    assert not lost_in_transit(FakeError(grpc.StatusCode.UNKNOWN, "Exception iterating responses"))
    assert not lost_in_transit(FakeError(grpc.StatusCode.INTERNAL, "logits were not finite"))
    lost = NodeLost(haproxy, "n2", 17)
    assert lost.code() == grpc.StatusCode.UNAVAILABLE and "n2" in lost.details() and "17 tokens" in lost.details()


class SlowNode(ScriptedNode):
    """One token, then a long pause: a reader that stops early must cancel the call."""

    def __init__(self) -> None:
        super().__init__([])
        self.cancelled = threading.Event()

    def Generate(self, request, context):
        context.add_callback(self.cancelled.set)
        yield pb.GenerateResponse(token_ids=[1])
        time.sleep(5)
        yield pb.GenerateResponse(token_ids=[2], finish_reason="length")


def test_breaking_out_of_an_answer_cancels_its_call() -> None:
    node = SlowNode()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_InferenceNodeServicer_to_server(node, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with NodeClient(f"127.0.0.1:{port}", retry=FAST) as client:
            for _ in client.answer(client.request(prompt_token_ids=[1]), timeout=10):
                break
        assert node.cancelled.wait(3)
    finally:
        server.stop(None)
