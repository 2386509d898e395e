"""The prefix cache and the allocator's cached-idle state, without a model: namespaces never
share blocks, the longest cached prefix is reused, idle cached blocks are recycled LRU only
when nothing is free, and a dropped namespace gives its blocks back."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from inference_node.engine.kv_cache import BlockAllocator
from inference_node.engine.prefix_cache import PrefixCache, chain_hashes, split_namespace
from inference_node.engine.request import Request, SamplingParams

BS = 4


def request(tokens: list[int], namespace: str | None = None) -> Request:
    req = Request(list(tokens), SamplingParams(max_tokens=4), emit=lambda e: None)
    if namespace is not None:
        req.adapter_entry = SimpleNamespace(namespace=namespace)
    return req


def admit(cache: PrefixCache, alloc: BlockAllocator, req: Request) -> int:
    """What the scheduler does: reuse the hit, allocate the rest, 'compute' everything."""
    hit = cache.match(req)
    cache.acquire(req, hit)
    req.block_ids += alloc.allocate(-(-req.num_tokens // BS) - len(hit))
    req.num_computed = req.num_tokens
    cache.insert(req)
    return len(hit)


def finish(alloc: BlockAllocator, req: Request) -> None:
    alloc.free(req.block_ids)
    req.block_ids = []


def setup(blocks: int = 16) -> tuple[BlockAllocator, PrefixCache]:
    alloc = BlockAllocator(blocks)
    return alloc, PrefixCache(alloc, BS)


def test_hash_chains_differ_by_namespace_and_by_every_earlier_token() -> None:
    tokens = list(range(12))
    base = chain_hashes("base", tokens, BS, [])
    assert len(base) == 3
    assert set(base).isdisjoint(chain_hashes("a@v1#1", tokens, BS, []))
    assert set(chain_hashes("a@v1#1", tokens, BS, [])).isdisjoint(chain_hashes("a@v1#2", tokens, BS, []))
    changed = chain_hashes("base", [99] + tokens[1:], BS, [])
    assert all(x != y for x, y in zip(base, changed))  # a chain: block 0's change reaches every block
    assert split_namespace("base") == ("", "") and split_namespace("a-b@0123abcd#7") == ("a-b", "0123abcd")


def test_longest_prefix_is_reused_within_a_namespace_only() -> None:
    alloc, cache = setup()
    first = request(list(range(10)), "a@v#1")          # 2 full blocks + 2 tokens
    assert admit(cache, alloc, first) == 0
    same_prefix = request(list(range(8)) + [50, 51, 52], "a@v#1")
    assert cache.match(same_prefix) == first.block_ids[:2]
    assert cache.match(request(list(range(10)), "b@v#1")) == []
    assert cache.match(request(list(range(10)))) == []  # the base model
    assert cache.match(request(list(range(5)) + [77] * 6, "a@v#1")) == first.block_ids[:1]
    # a fully cached prompt still leaves its last token to compute
    assert cache.match(request(list(range(8)), "a@v#1")) == first.block_ids[:1]
    stats = cache.stats["a@v#1"]
    assert (stats.lookups, stats.hits, stats.blocks) == (1, 0, 2)


def test_shared_blocks_are_reference_counted_and_parked_when_idle() -> None:
    alloc, cache = setup()
    a = request(list(range(9)), "a@v#1")
    admit(cache, alloc, a)
    b = request(list(range(8)) + [40, 41], "a@v#1")
    assert admit(cache, alloc, b) == 2
    assert [alloc.ref_count(x) for x in a.block_ids[:2]] == [2, 2]
    assert cache.stats["a@v#1"].hit_tokens == 8
    finish(alloc, a)
    finish(alloc, b)
    alloc.check_idle()
    cache.check_consistency()
    assert alloc.num_cached_idle == 2 and alloc.num_free == 16  # idle cache still counts as free


def test_idle_cached_blocks_are_recycled_lru_only_when_nothing_is_free() -> None:
    alloc, cache = setup(blocks=6)
    old = request(list(range(8)), "a@v#1")      # 2 blocks, both full and indexed
    admit(cache, alloc, old)
    old_blocks = list(old.block_ids)
    finish(alloc, old)
    new = request(list(range(100, 108)), "b@v#1")
    admit(cache, alloc, new)
    new_blocks = list(new.block_ids)
    finish(alloc, new)
    assert alloc.num_cached_idle == 4
    taken = alloc.allocate(3)  # 2 truly free, then the least recently used idle block: old's tail
    assert cache.num_blocks == 3 and len(set(taken)) == 3 and old_blocks[1] in taken
    assert cache.match(request(list(range(8)) + [1], "a@v#1")) == old_blocks[:1]
    assert cache.match(request(list(range(100, 108)) + [1], "b@v#1")) == new_blocks
    cache.check_consistency()
    alloc.free(taken)
    alloc.check_idle()


def test_a_tail_block_is_recycled_before_its_head() -> None:
    alloc, cache = setup(blocks=3)
    req = request(list(range(12)), "a@v#1")
    admit(cache, alloc, req)
    finish(alloc, req)
    alloc.allocate(1)
    again = request(list(range(12)) + [5], "a@v#1")
    assert len(cache.match(again)) == 2  # the first two blocks survived, the third went


def test_dropping_a_namespace_frees_idle_blocks_and_never_reindexes_it() -> None:
    alloc, cache = setup()
    done = request(list(range(8)), "a@v#1")
    admit(cache, alloc, done)
    finish(alloc, done)
    running = request(list(range(100, 108)), "a@v#1")
    admit(cache, alloc, running)
    kept = request(list(range(8)), "b@v#1")
    admit(cache, alloc, kept)
    assert cache.drop_namespace("a@v#1") == 4
    assert "a@v#1" not in cache.stats and cache.num_blocks == 2
    assert alloc.num_cached_idle == 0
    running.output_token_ids += [1, 2, 3, 4]
    running.block_ids += alloc.allocate(1)
    running.num_computed = running.num_tokens
    cache.insert(running)  # the old version's request keeps running, but is not cached again
    assert cache.num_blocks == 2
    finish(alloc, running)
    finish(alloc, kept)
    cache.check_consistency()
    alloc.check_idle()
    assert alloc.num_free == 16 and alloc.num_cached_idle == 2


def test_the_same_prefix_computed_twice_at_once_is_indexed_once() -> None:
    alloc, cache = setup()
    one, two = request(list(range(8)) + [1], "a@v#1"), request(list(range(8)) + [2], "a@v#1")
    for r in (one, two):  # both admitted before either is indexed
        cache.acquire(r, cache.match(r))
        r.block_ids += alloc.allocate(3)
    for r in (one, two):
        r.num_computed = r.num_tokens
        cache.insert(r)
    assert cache.num_blocks == 2
    finish(alloc, one)
    finish(alloc, two)
    cache.check_consistency()
    alloc.check_idle()
    assert alloc.num_cached_idle == 2


def test_allocator_rejects_sharing_uncached_blocks_and_double_free() -> None:
    alloc, _ = setup()
    blocks = alloc.allocate(2)
    with pytest.raises(RuntimeError, match="not cached"):
        alloc.share(blocks)
    alloc.free(blocks)
    with pytest.raises(RuntimeError, match="freed twice"):
        alloc.free(blocks)
