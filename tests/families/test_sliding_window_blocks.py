"""Sliding-window attention in the paged KV cache: a request gives back the blocks wholly
behind its window (where every layer is windowed), indexed by the prefix cache first so they
stay valid KV for another request whose prefix they are; answers still equal transformers'
and the engine's invariants hold at every step."""
from __future__ import annotations

import random

import pytest

from harness import InProcessNode, generate_all, peft_greedy
from inference_node.config import NodeConfig


def _prompts() -> list[list[int]]:
    """Three prompts sharing a 70-token prefix, and one of its own."""
    rng = random.Random(3)
    shared = [rng.randrange(100, 40000) for _ in range(70)]
    prompts = [shared + [rng.randrange(100, 40000) for _ in range(n)] for n in (20, 9, 31)]
    return prompts + [[rng.randrange(100, 40000) for _ in range(95)]]


def test_windowed_requests_outgrow_the_kv_cache_and_match_transformers(tiny_mistral_path) -> None:
    """Prompts longer than the whole KV cache: only the window (20 tokens) and a chunk are
    ever held, so they run, alone and in one batch, and answer as transformers does."""
    prompts, max_new = _prompts(), 14
    expected = peft_greedy(tiny_mistral_path, None, prompts, max_new)
    node = InProcessNode(NodeConfig.of(checkpoint=str(tiny_mistral_path), device="cpu", dtype="float32",
                                      block_size=4, num_kv_blocks=22, max_num_batched_tokens=16,
                                      max_loras=0, debug_checks=True))
    try:
        assert node.engine.scheduler.config.window == 20
        assert all(len(p) + max_new > 22 * 4 for p in prompts)  # each alone outgrows the whole cache
        assert generate_all(node, [("", prompts[0], max_new)]) == [expected[0]]
        assert generate_all(node, [("", p, max_new) for p in prompts[1:]]) == expected[1:]
        node.check_idle()
    finally:
        node.stop()


def test_blocks_behind_the_window_stay_cached_for_a_later_prefix(tiny_mistral_path) -> None:
    """The blocks a request gives back behind its window are indexed by the prefix cache
    first: a later request with the same prefix reuses them. (Under a full cache the oldest
    blocks are recycled first, so which of a batch's requests hits them is a race: here the
    cache has room and the requests run one after the other.)"""
    prompts, max_new = _prompts()[:2], 14
    expected = peft_greedy(tiny_mistral_path, None, prompts, max_new)
    node = InProcessNode(NodeConfig.of(checkpoint=str(tiny_mistral_path), device="cpu", dtype="float32",
                                      block_size=4, num_kv_blocks=64, max_num_batched_tokens=16,
                                      max_loras=0, debug_checks=True))
    try:
        assert generate_all(node, [("", prompts[0], max_new)]) == [expected[0]]
        assert node.check_idle()["cached_prompt_tokens"] == 0
        assert generate_all(node, [("", prompts[1], max_new)]) == [expected[1]]
        assert node.check_idle()["cached_prompt_tokens"] >= 64  # 16 blocks of the 70-token prefix
    finally:
        node.stop()


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_mixed_full_and_windowed_layers_keep_every_block(family: str, request) -> None:
    """Gemma's full-attention layers read the whole context: nothing is given back, and a
    prompt longer than the KV cache is refused as for any model."""
    path = request.getfixturevalue(f"tiny_{family}_path")
    node = InProcessNode(NodeConfig.of(checkpoint=str(path), device="cpu", block_size=4, num_kv_blocks=16,
                                      max_num_batched_tokens=16, max_loras=0))
    try:
        assert node.engine.scheduler.config.window == 0
        from lora_client.node_client import NodeClient
        import grpc

        with NodeClient(node.address) as client:
            with pytest.raises(grpc.RpcError) as refused:
                client.generate(client.request(prompt_token_ids=list(range(100, 180)), max_tokens=2))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "KV cache holds 64" in refused.value.details()
    finally:
        node.stop()


def test_scheduler_gives_back_blocks_behind_the_window_as_cache() -> None:
    """A windowed request holds its window and a chunk; the full blocks it gives back are
    indexed first (cached-idle, not free), and a request with the same prefix hits them."""
    from inference_node.engine.kv_cache import BlockAllocator
    from inference_node.engine.prefix_cache import PrefixCache
    from inference_node.engine.request import Request, SamplingParams
    from inference_node.engine.scheduler import Scheduler, SchedulerConfig

    allocator = BlockAllocator(64)
    cache = PrefixCache(allocator, 4)
    sched = Scheduler(SchedulerConfig(block_size=4, max_num_batched_tokens=8, window=10), allocator,
                      prefix_cache=cache)
    prompt = list(range(100, 160))
    first = Request(prompt, SamplingParams(max_tokens=4), emit=lambda e: None)
    sched.add(first)
    while first.num_computed < len(prompt):
        plan = sched.schedule()
        held = first.block_ids[first.num_released_blocks:]
        assert len(held) <= -(-(10 + 8) // 4) + 1, held
        assert first.block_ids[:first.num_released_blocks] == [allocator.released] * first.num_released_blocks
        for chunk in plan:
            chunk.request.num_computed += chunk.num_new_tokens
    assert first.num_released_blocks >= (60 - 10) // 4 - 1
    assert allocator.num_cached_idle == first.num_released_blocks  # kept as cache, not freed
    allocator.check_consistency()
    cache.check_consistency()
    sched.remove(first)
    second = Request(prompt[:52] + [7, 8, 9], SamplingParams(max_tokens=4), emit=lambda e: None)
    sched.add(second)
    sched.schedule()
    assert second.num_cached_prompt_tokens == 52  # its prefix, given back by the first, hit
    allocator.check_consistency()
