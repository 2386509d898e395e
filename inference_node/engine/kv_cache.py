"""Paged KV cache: fixed-size blocks of key/value memory and the allocator that hands them out."""
from __future__ import annotations

from collections import deque

import torch

from ..model.config import ModelConfig


class OutOfBlocks(RuntimeError):
    """The allocator has fewer free blocks than asked for."""


class BlockAllocator:
    """Free list of KV block ids with reference counts (shared blocks: the prefix cache)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise OutOfBlocks(f"asked for {count} KV blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(count)]
        for b in blocks:
            self._refs[b] = 1
        return blocks

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._refs[b] <= 0:
                raise RuntimeError(f"KV block {b} freed twice")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def check_idle(self) -> None:
        """Raises unless every block is free with no references (tests, debug)."""
        if len(self._free) != self.num_blocks or any(self._refs):
            raise AssertionError(f"{self.num_blocks - len(self._free)} KV blocks still held")


class KVCache:
    """Per-layer key and value tensors of shape [num_blocks, block_size, kv_heads, head_dim]."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self._k = torch.zeros(shape, dtype=dtype, device=device)
        self._v = torch.zeros(shape, dtype=dtype, device=device)
        self.k = list(self._k.unbind(0))
        self.v = list(self._v.unbind(0))

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * elem
