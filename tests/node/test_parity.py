"""Greedy output of the node equals transformers' greedy output, token for token, for
concurrent prompts of different lengths that share batches (chunked prefill included)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from harness import InProcessNode, hf_greedy
from inference_node.config import NodeConfig
from lora_client.node_client import NodeClient

TOPICS = ["the sea", "a robot who learns to paint", "the history of bread", "why the sky is blue",
          "a detective story set on Mars", "how to plant tomatoes", "prime numbers",
          "the rules of chess", "a lighthouse keeper", "volcanoes", "the first airplane",
          "a recipe for pancakes"]


def prompts_of_many_lengths() -> list[str]:
    # 12 prompts from a few tokens to a few hundred, so prefill is chunked across steps.
    return [("Tell me about " + topic + ". ") * (1 + 3 * i) for i, topic in enumerate(TOPICS)]


def run_concurrently(address: str, requests: list) -> list:
    with NodeClient(address) as client, ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(lambda r: client.generate(r, timeout=300), requests))


@pytest.mark.parametrize("which, device", [
    ("tiny_llama", "cpu"),
    # SmolLM2 twelve prompts through transformers: 80-240 s on a shared two-core machine.
    pytest.param("smollm2", "cpu", marks=pytest.mark.timeout(900)),
    pytest.param("tiny_llama", "cuda", marks=pytest.mark.gpu),
])
def test_concurrent_greedy_matches_transformers(which: str, device: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(f"{which}_path")
    hf = request.getfixturevalue(f"{which}_hf")
    node = InProcessNode(NodeConfig.of(checkpoint=str(path), device=device, dtype="float32", num_kv_blocks=400,
                                       block_size=16, max_num_batched_tokens=96, max_num_seqs=16))
    try:
        prompt_ids = [node.node.codec.encode(p) for p in prompts_of_many_lengths()]
        assert len({len(p) for p in prompt_ids}) == 12
        max_new = 20
        requests = [NodeClient.request(prompt_token_ids=ids, max_tokens=max_new) for ids in prompt_ids]
        results = run_concurrently(node.address, requests)
        stats = node.engine.call(node.engine.snapshot).result()
        # More than one request per step on average: the prompts really shared batches.
        assert stats["steps"] < sum(r.completion_tokens for r in results)
        for ids, got in zip(prompt_ids, results):
            expected = hf_greedy(hf, ids, max_new)
            assert got.token_ids == expected, f"prompt of {len(ids)} tokens diverged"
            ended_on_eos = expected[-1] in node.node.model.config.eos_token_ids
            assert got.finish_reason == ("stop" if ended_on_eos else "length")
        node.check_idle()
    finally:
        node.stop()


def test_capital_of_france_through_chat_template(smollm2_path) -> None:
    node = InProcessNode(NodeConfig.of(checkpoint=str(smollm2_path), device="cpu", num_kv_blocks=64))
    try:
        with NodeClient(node.address) as client:
            answer = client.generate(client.request("What is the capital of France?", max_tokens=32))
        assert "Paris" in answer.text
        assert answer.finish_reason == "stop"
        assert answer.prompt_tokens > 0 and answer.completion_tokens == len(answer.token_ids)
    finally:
        node.stop()
