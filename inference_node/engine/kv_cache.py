"""Paged KV cache: fixed-size blocks of key/value memory and the allocator that hands them out."""
from __future__ import annotations

from collections import OrderedDict, deque
from typing import Callable

import torch

from ..model.config import ModelConfig


class OutOfBlocks(RuntimeError):
    """The allocator has fewer free blocks than asked for."""


class BlockAllocator:
    """KV block ids in three states: free, owned (reference count > 0: requests share the
    blocks of a cached prefix), and cached-idle (no owner, but the prefix cache still indexes
    the content; reused on a hit, recycled LRU when the free list runs dry)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        # What a request's block table keeps where it gave a block back (behind its sliding
        # window): the KV cache's scratch block, one past the allocator's, never handed out.
        # Attention masks those positions, so any valid block id serves.
        self.released = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks
        self._cached: set[int] = set()                     # content indexed by the prefix cache
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached with no owner, LRU first
        self.on_recycle: Callable[[int], None] | None = None  # tells the index a block is reused

    @property
    def num_free(self) -> int:
        """Blocks an allocation can have: free ones plus cached-idle ones it may recycle."""
        return len(self._free) + len(self._idle)

    @property
    def num_cached_idle(self) -> int:
        return len(self._idle)

    def allocate(self, count: int) -> list[int]:
        if count > self.num_free:
            raise OutOfBlocks(f"asked for {count} KV blocks, {self.num_free} free")
        blocks = []
        for _ in range(count):
            if self._free:
                b = self._free.popleft()
            else:  # recycle the least recently used cached block
                b, _ = self._idle.popitem(last=False)
                self._cached.discard(b)
                if self.on_recycle is not None:
                    self.on_recycle(b)
            self._refs[b] = 1
            blocks.append(b)
        return blocks

    def share(self, blocks: list[int]) -> None:
        """Takes another reference on cached blocks (a prefix-cache hit)."""
        for b in blocks:
            if b not in self._cached:
                raise RuntimeError(f"KV block {b} is shared but not cached")
            if self._refs[b] == 0:
                del self._idle[b]
            self._refs[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drops one reference each; a cached block with no owner stays as cache. Blocks are
        given in sequence order and parked tail-first, so a prefix's tail is recycled first."""
        for b in reversed(blocks):
            if self._refs[b] <= 0:
                raise RuntimeError(f"KV block {b} freed twice")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if b in self._cached:
                    self._idle[b] = None  # most recent last: the tail goes before the head
                else:
                    self._free.append(b)

    def mark_cached(self, block: int) -> None:
        if self._refs[block] <= 0:
            raise RuntimeError(f"KV block {block} cached without an owner")
        self._cached.add(block)

    def uncache(self, block: int) -> None:
        """The content is no longer indexed (its namespace was dropped)."""
        self._cached.discard(block)
        if block in self._idle:
            del self._idle[block]
            self._free.append(block)

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def is_cached(self, block: int) -> bool:
        return block in self._cached

    def cached_blocks(self) -> set[int]:
        return set(self._cached)

    def check_owners(self, owners: dict[int, list[int]]) -> None:
        """Each block's reference count equals its holders among `owners` (each request's
        blocks by its id, those it gave back behind a window its leading `released` ones), and
        no request holds a block twice."""
        holders: dict[int, int] = {}
        for owner, blocks in owners.items():
            gave_back = next((i for i, b in enumerate(blocks) if b != self.released), len(blocks))
            blocks = blocks[gave_back:]
            if self.released in blocks:
                raise AssertionError(f"request {owner}'s released blocks are not its leading ones")
            if len(set(blocks)) != len(blocks):
                raise AssertionError(f"request {owner} holds a KV block twice")
            for b in blocks:
                holders[b] = holders.get(b, 0) + 1
        for b in range(self.num_blocks):
            if self._refs[b] != holders.get(b, 0):
                raise AssertionError(f"KV block {b} has ref count {self._refs[b]}, "
                                     f"held by {holders.get(b, 0)} live requests")

    def check_consistency(self) -> None:
        """Every block is exactly one of free, owned, cached-idle."""
        free, idle = set(self._free), set(self._idle)
        if len(free) != len(self._free):
            raise AssertionError("a KV block is on the free list twice")
        if free & idle:
            raise AssertionError(f"KV blocks {sorted(free & idle)} both free and cached-idle")
        owned = {b for b, r in enumerate(self._refs) if r > 0}
        if any(r < 0 for r in self._refs):
            raise AssertionError("a KV block has a negative reference count")
        if owned & (free | idle):
            raise AssertionError(f"KV blocks {sorted(owned & (free | idle))} owned and free")
        if len(owned) + len(free) + len(idle) != self.num_blocks:
            raise AssertionError(f"{len(owned)} owned + {len(free)} free + {len(idle)} cached-idle "
                                 f"!= {self.num_blocks} KV blocks")
        if not idle <= self._cached or self._cached & free:
            raise AssertionError("cached-idle and cached sets disagree")

    def check_idle(self) -> None:
        """Raises unless no block has an owner (tests, debug); cached-idle blocks are idle."""
        self.check_consistency()
        if any(self._refs):
            raise AssertionError(f"{sum(1 for r in self._refs if r)} KV blocks still held")


class KVCache:
    """Per-layer key and value tensors, seen as [num_blocks, block_size, kv_heads, head_dim].

    Stored head-major, [num_blocks, kv_heads, block_size, head_dim]: a block's keys for one KV
    head are then one contiguous run (block_size x head_dim), which is what an attention
    program reads, instead of head_dim-sized pieces strided by kv_heads x head_dim. The views
    handed out keep the logical index order; the kernels follow their strides."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (config.num_layers, num_blocks, config.num_kv_heads, block_size, config.head_dim)
        self._k = torch.zeros(shape, dtype=dtype, device=device)
        self._v = torch.zeros(shape, dtype=dtype, device=device)
        self.k = [t.transpose(1, 2) for t in self._k.unbind(0)]
        self.v = [t.transpose(1, 2) for t in self._v.unbind(0)]

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * elem
