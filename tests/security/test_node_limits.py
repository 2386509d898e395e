"""Limits through real gRPC, each refused with its status and a message naming the flag:
concurrent streams, request size, prompt characters and tokens, max_tokens, adapter rank;
and deadlines honoured end to end: a Generate whose deadline passes (while running, or
while its adapter is still loading) is cancelled in the engine and gives back its KV blocks
and adapter references."""
from __future__ import annotations

import threading
import time

import grpc
import pytest

from harness import InProcessNode, make_peft_adapter, wait_for
from inference_node.config import NodeConfig, RequestLimits
from lora.v1 import inference_pb2 as pb
from lora_client.node_client import NodeClient

LONG = dict(prompt_token_ids=[5, 6, 7], max_tokens=1000, ignore_eos=True)  # ~seconds on the tiny model


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_llama_path):
    root = tmp_path_factory.mktemp("limit-adapters")
    make_peft_adapter(tiny_llama_path, root / "small", 4, 8.0, ["q_proj"], seed=1)
    make_peft_adapter(tiny_llama_path, root / "wide", 8, 16.0, ["q_proj"], seed=2)
    return root


@pytest.fixture(scope="module")
def node(tiny_llama_path, adapters):
    limits = RequestLimits(max_concurrent_streams=2, max_request_bytes=64 << 10, max_prompt_chars=2000,
                           max_prompt_tokens=40, max_tokens=1000)
    n = InProcessNode(NodeConfig.of(checkpoint=str(tiny_llama_path), device="cpu", num_kv_blocks=256, max_loras=2,
                                    max_lora_rank=4, adapter_dir=str(adapters), default_max_tokens=2000,
                                    limits=limits))
    yield n
    n.stop()


def refusal(client: NodeClient, **request: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        client.generate(client.request(**request), timeout=30)
    return err.value


def adapter_refs(node: InProcessNode) -> dict[str, int]:
    manager = node.node.adapters
    return node.engine.call(lambda: {e.name: e.refs for e in manager.entries()}).result(10)


def test_concurrent_streams_beyond_the_limit_are_resource_exhausted(node) -> None:
    with NodeClient(node.address) as client:
        streams = [client.stream(client.request(**LONG), timeout=60) for _ in range(2)]
        for stream in streams:
            next(stream)  # both are running
        err = refusal(client, prompt_token_ids=[5, 6], max_tokens=2)
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "at most 2 concurrent Generate streams" in err.details()
        assert "--max-concurrent-streams" in err.details()
        for stream in streams:
            stream.cancel()
        # Cancelled streams give their places back.
        wait_for(lambda: len(client.generate(client.request(prompt_token_ids=[5, 6], max_tokens=2,
                                                            ignore_eos=True), 30).token_ids) == 2, 30, "a slot")
    wait_for(lambda: node.engine.call(node.engine.snapshot).result(10)["live_requests"] == 0, 30, "idle")
    node.check_idle()


def test_request_and_prompt_size_limits(node) -> None:
    with NodeClient(node.address) as client:
        err = refusal(client, prompt="x" * (100 << 10), chat=False)
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # gRPC's own message-size limit
        assert str(64 << 10) in err.details()
        err = refusal(client, prompt="y" * 2001, chat=False)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "2001 characters" in err.details() and "--max-prompt-chars" in err.details()
        err = refusal(client, prompt="z" * 1999)  # the chat template adds the role
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "--max-prompt-chars" in err.details()
        err = refusal(client, prompt_token_ids=list(range(10, 51)), max_tokens=2)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "41 tokens" in err.details() and "at most 40 (--max-prompt-tokens)" in err.details()
        ok = client.generate(client.request(prompt_token_ids=list(range(10, 50)), max_tokens=2, ignore_eos=True), 30)
        assert ok.prompt_tokens == 40


def test_max_tokens_cap(node) -> None:
    with NodeClient(node.address) as client:
        err = refusal(client, prompt_token_ids=[5, 6], max_tokens=1001)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "max_tokens 1001" in err.details() and "limit of 1000 (--max-tokens-limit)" in err.details()
        # Under the flag's limit but more than the context leaves after a 40-token prompt.
        err = refusal(client, prompt_token_ids=list(range(10, 50)), max_tokens=1000)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "limit is 1024 tokens of prompt + output (--max-model-len)" in err.details()
        assert "at most 984" in err.details()
        ok = client.generate(client.request(prompt_token_ids=list(range(10, 50)), max_tokens=984,
                                            ignore_eos=True), 60)
        assert ok.completion_tokens == 984 and ok.finish_reason == "length"
        # max_tokens 0 takes --default-max-tokens (2000 here), itself capped by the limit.
        reply = client.generate(client.request(prompt_token_ids=[5, 6], ignore_eos=True), 60)
        assert reply.completion_tokens == 1000 and reply.finish_reason == "length"


def test_an_adapter_above_the_rank_limit_is_failed_precondition(node) -> None:
    with NodeClient(node.address) as client:
        err = refusal(client, adapter="wide", prompt_token_ids=[5, 6], max_tokens=2)
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "rank 8" in err.details() and "up to 4 (--max-lora-rank)" in err.details()
        with pytest.raises(grpc.RpcError) as load:
            client.stub.LoadAdapter(pb.LoadAdapterRequest(name="wide"), timeout=30)
        assert load.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert len(client.generate(client.request(adapter="small", prompt_token_ids=[5, 6], max_tokens=2,
                                                  ignore_eos=True), 30).token_ids) == 2


def test_a_passed_deadline_cancels_the_request_and_frees_kv_and_adapter_refs(node) -> None:
    with NodeClient(node.address) as client:
        stream = client.stream(client.request(adapter="small", **LONG), timeout=1.0)
        received = 0
        with pytest.raises(grpc.RpcError) as err:
            for message in stream:
                received += len(message.token_ids)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert 0 < received < 1000
    wait_for(lambda: node.engine.call(node.engine.snapshot).result(10)["live_requests"] == 0, 30,
             "the engine to drop the request")
    node.check_idle()
    assert adapter_refs(node).get("small") == 0


class SlowSource:
    """Delays every adapter load: a deadline passes while the request waits for its adapter."""

    def __init__(self, inner, delay_s: float) -> None:
        self.inner, self.delay_s = inner, delay_s
        self.started = threading.Event()

    def load(self, name: str, version: str):
        self.started.set()
        time.sleep(self.delay_s)
        return self.inner.load(name, version)


def test_a_deadline_passing_while_the_adapter_loads(tiny_llama_path, adapters) -> None:
    n = InProcessNode(NodeConfig.of(checkpoint=str(tiny_llama_path), device="cpu", num_kv_blocks=64, max_loras=1,
                                    max_lora_rank=4, adapter_dir=str(adapters)))
    try:
        manager = n.node.adapters
        slow = SlowSource(manager.source, 2.0)
        manager.source = slow
        with NodeClient(n.address) as client:
            started = time.monotonic()
            err = refusal_with_timeout(client, 0.5, adapter="small", prompt_token_ids=[5, 6, 7], max_tokens=4)
            assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert time.monotonic() - started < 1.5  # not held until the load ended
            assert slow.started.is_set()
            wait_for(lambda: adapter_refs(n).get("small") is not None, 30, "the load to finish")
            wait_for(lambda: n.engine.call(n.engine.snapshot).result(10)["live_requests"] == 0, 30, "idle")
            n.check_idle()
            assert adapter_refs(n) == {"small": 0}
            # The loaded adapter serves the next request.
            assert len(client.generate(client.request(adapter="small", prompt_token_ids=[5, 6, 7], max_tokens=3,
                                                      ignore_eos=True), 30).token_ids) == 3
    finally:
        n.stop()


def refusal_with_timeout(client: NodeClient, timeout: float, **request: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        client.generate(client.request(**request), timeout=timeout)
    return err.value


def test_an_adapter_dir_adapter_above_the_size_limit_is_refused_before_it_is_read(tiny_llama_path,
                                                                                  tmp_path) -> None:
    make_peft_adapter(tiny_llama_path, tmp_path / "small", 4, 8.0, ["q_proj"], seed=1)
    make_peft_adapter(tiny_llama_path, tmp_path / "large", 4, 8.0, ["q_proj", "k_proj", "v_proj", "o_proj"], seed=2)
    small = sum(f.stat().st_size for f in (tmp_path / "small").iterdir())
    node = InProcessNode(NodeConfig.of(checkpoint=str(tiny_llama_path), device="cpu", num_kv_blocks=64, max_loras=2,
                                       max_lora_rank=4, adapter_dir=str(tmp_path), max_adapter_bytes=small + 64))
    try:
        with NodeClient(node.address) as client:
            err = refusal(client, adapter="large", prompt_token_ids=[5, 6], max_tokens=2)
            assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "'large'" in err.details() and "(--max-adapter-mb)" in err.details()
            assert len(client.generate(client.request(adapter="small", prompt_token_ids=[5, 6], max_tokens=2,
                                                      ignore_eos=True), 30).token_ids) == 2
        node.check_idle()
    finally:
        node.stop()
