"""The paged KV block allocator: allocation, free, exhaustion, double free."""
from __future__ import annotations

import pytest

from inference_node.engine.kv_cache import BlockAllocator, OutOfBlocks


def test_allocate_returns_distinct_blocks_and_counts_free() -> None:
    alloc = BlockAllocator(8)
    a = alloc.allocate(3)
    b = alloc.allocate(5)
    assert len(set(a + b)) == 8
    assert alloc.num_free == 0
    assert all(alloc.ref_count(x) == 1 for x in a + b)


def test_exhaustion_raises_and_changes_nothing() -> None:
    alloc = BlockAllocator(4)
    alloc.allocate(3)
    with pytest.raises(OutOfBlocks):
        alloc.allocate(2)
    assert alloc.num_free == 1


def test_free_returns_blocks_for_reuse() -> None:
    alloc = BlockAllocator(4)
    blocks = alloc.allocate(4)
    alloc.free(blocks[:2])
    assert alloc.num_free == 2
    again = alloc.allocate(2)
    assert set(again) == set(blocks[:2])
    alloc.free(blocks[2:] + again)
    alloc.check_idle()


def test_double_free_is_detected() -> None:
    alloc = BlockAllocator(2)
    blocks = alloc.allocate(1)
    alloc.free(blocks)
    with pytest.raises(RuntimeError, match="freed twice"):
        alloc.free(blocks)


def test_check_idle_reports_held_blocks() -> None:
    alloc = BlockAllocator(3)
    alloc.allocate(1)
    with pytest.raises(AssertionError, match="1 KV blocks still held"):
        alloc.check_idle()
