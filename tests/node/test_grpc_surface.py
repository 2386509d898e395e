"""The node's gRPC surface: health, reflection, statuses for bad input, queue bound,
cancellation freeing KV blocks, and preemption not changing outputs."""
from __future__ import annotations

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from harness import InProcessNode, hf_greedy
from inference_node.config import NodeConfig
from lora.v1 import inference_pb2 as pb
from lora_client.node_client import NodeClient


@pytest.fixture(scope="module")
def node(tiny_llama_path):
    n = InProcessNode(NodeConfig.of(checkpoint=str(tiny_llama_path), device="cpu", num_kv_blocks=128,
                                    block_size=16, max_num_seqs=4, max_queue=2))
    yield n
    n.stop()


@pytest.fixture()
def client(node):
    with NodeClient(node.address) as c:
        yield c


def test_health_reports_serving(node) -> None:
    with grpc.insecure_channel(node.address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for service in ("", "lora.v1.InferenceNode"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_the_service(node) -> None:
    with grpc.insecure_channel(node.address) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for r in replies for s in r.list_services_response.service}
    assert {"lora.v1.InferenceNode", "grpc.health.v1.Health"} <= names


@pytest.mark.parametrize("fields, message", [
    (dict(prompt="hi", max_tokens=-1), "max_tokens"),
    (dict(prompt_token_ids=[5, 49152]), "outside the vocabulary"),
    (dict(prompt_token_ids=[-3]), "outside the vocabulary"),
    (dict(), "no prompt"),
    (dict(prompt="hi", temperature=-0.5), "temperature"),
    (dict(prompt="hi", top_p=1.5), "top_p"),
    (dict(prompt="hi", top_k=-1), "top_k"),
    (dict(prompt="hi", adapter="../etc/passwd"), "adapter names"),
    (dict(prompt_token_ids=[5] * 1024), "limit"),
    # No --max-tokens-limit here: what the context leaves is the limit, named, never a quiet cap.
    (dict(prompt_token_ids=[5, 6, 7], max_tokens=10**9), "max_tokens 1000000000 does not fit"),
    (dict(prompt_token_ids=[5, 6, 7], max_tokens=1022), "so at most 1021 (0 asks for the default)"),
])
def test_bad_requests_are_invalid_argument(client, fields, message) -> None:
    with pytest.raises(grpc.RpcError) as err:
        client.generate(pb.GenerateRequest(**fields), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()


def test_unknown_adapter_is_not_found(client) -> None:
    with pytest.raises(grpc.RpcError) as err:
        client.generate(pb.GenerateRequest(prompt="hi", adapter="nobody"), timeout=30)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_cancelled_stream_frees_its_kv_blocks(node, client) -> None:
    call = client.stream(pb.GenerateRequest(prompt_token_ids=list(range(10, 200)), max_tokens=800,
                                            ignore_eos=True), timeout=60)
    first = next(call)
    assert first.token_ids
    busy = node.engine.call(node.engine.snapshot).result()
    assert busy["kv_blocks_free"] < busy["kv_blocks_total"]
    call.cancel()
    deadline = time.monotonic() + 10
    while node.engine.call(node.engine.snapshot).result()["live_requests"]:
        assert time.monotonic() < deadline, "cancelled request still holds resources"
        time.sleep(0.02)
    node.check_idle()


def test_full_queue_answers_resource_exhausted(node, client) -> None:
    # Hold the engine loop so nothing finishes; max_num_seqs=4 + max_queue=2 admit six
    # requests, the seventh is refused at once.
    release = threading.Event()
    node.engine.call(release.wait)
    try:
        request = pb.GenerateRequest(prompt_token_ids=list(range(10, 30)), max_tokens=4)
        calls = [client.stream(request, timeout=60) for _ in range(6)]
        deadline = time.monotonic() + 10
        while node.engine.num_inflight() < 6:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(grpc.RpcError) as err:
            client.generate(request, timeout=30)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "queue is full" in err.value.details()
    finally:
        release.set()
    assert all(len(list(c)[-1].finish_reason) > 0 for c in calls)
    node.check_idle()


def test_stream_sends_every_token_once_in_order_and_counts(client) -> None:
    """A message carries the tokens that came since the last one: one each while the client
    keeps up, several when its front end lags (never a token twice or out of order)."""
    request = pb.GenerateRequest(prompt_token_ids=[5, 6, 7], max_tokens=5, ignore_eos=True)
    msgs = list(client.stream(request, timeout=30))
    assert [t for m in msgs for t in m.token_ids] == list(client.generate(request, timeout=30).token_ids)
    assert all(m.token_ids for m in msgs) and sum(len(m.token_ids) for m in msgs) == 5
    assert msgs[-1].finish_reason == "length"
    assert (msgs[-1].prompt_tokens, msgs[-1].completion_tokens) == (3, 5)


def test_stop_string_ends_generation(client) -> None:
    free = client.generate(pb.GenerateRequest(prompt_token_ids=[5, 6, 7], max_tokens=12,
                                              ignore_eos=True), timeout=30)
    stop = free.text[3:6]
    assert stop.strip(), "need a visible stop string"
    stopped = client.generate(pb.GenerateRequest(prompt_token_ids=[5, 6, 7], max_tokens=12,
                                                 ignore_eos=True, stop=[stop]), timeout=30)
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[:free.text.index(stop)]


def test_seeded_sampling_is_reproducible_through_grpc(client) -> None:
    def sampled(seed: int) -> list[int]:
        return client.generate(pb.GenerateRequest(prompt_token_ids=[5, 6, 7], max_tokens=12, ignore_eos=True,
                                                  temperature=1.0, top_p=0.9, top_k=50, seed=seed),
                               timeout=30).token_ids
    assert sampled(11) == sampled(11)
    assert sampled(11) != sampled(12)


def test_preemption_under_a_tiny_kv_cache_keeps_outputs(tiny_llama_path, tiny_llama_hf) -> None:
    # 12 blocks of 16 tokens cannot hold 6 requests of 40 + 30 tokens at once.
    node = InProcessNode(NodeConfig.of(checkpoint=str(tiny_llama_path), device="cpu", num_kv_blocks=12,
                                       block_size=16, max_num_seqs=6, debug_checks=True))
    try:
        prompts = [list(range(100 + i, 140 + i)) for i in range(6)]
        results: dict[int, list[int]] = {}

        def run(i: int) -> None:
            with NodeClient(node.address) as c:
                results[i] = c.generate(pb.GenerateRequest(prompt_token_ids=prompts[i], max_tokens=30,
                                                           ignore_eos=True), timeout=120).token_ids
        threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert node.engine.call(node.engine.snapshot).result()["preemptions"] > 0
        for i, ids in enumerate(prompts):
            assert results[i] == hf_greedy(tiny_llama_hf, ids, 30, eos=False)
        node.check_idle()
    finally:
        node.stop()


def test_a_second_server_on_a_taken_port_fails_instead_of_sharing_it(node) -> None:
    """gRPC's default SO_REUSEPORT would let a second server bind the node's port and take
    half of its connections (clients then get UNIMPLEMENTED); the node listens exclusively."""
    import asyncio

    from inference_node.server import NodeServer

    port = int(node.address.rsplit(":", 1)[1])
    second = NodeServer(node.server.config, node.client, "127.0.0.1", port)
    second.frontend = node.server.frontend

    async def build() -> None:
        second._build()

    with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}: the port is in use"):
        asyncio.run(build())
