"""Where q/k/v's decode GEMM with RoPE in its epilogue writes (triton_kernel.py: ROPE): the
queries to their buffer, the keys and values to their rows' slots in the paged KV cache, as
kernels/rope's launch does after a plain q/k/v GEMM. Host-side only (no Triton import)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RopeOut:
    q: torch.Tensor             # [T, Hq, D]: the rotated queries
    k_cache: torch.Tensor       # [blocks, page, Hkv, D]
    v_cache: torch.Tensor       # [blocks, page, Hkv, D]
    cos: torch.Tensor           # [positions, D] float32
    sin: torch.Tensor           # [positions, D] float32
    positions: torch.Tensor     # [T] int64
    slot_mapping: torch.Tensor  # [T] int64: block * page + offset
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def fits(self, x: torch.Tensor, w: torch.Tensor, block_n: int) -> bool:
        """Whether a launch of x @ w with `block_n` columns of each half of a head a program
        can write here: w is q/k/v's for these heads, the tile divides half a head, a head's
        vector and the tables are contiguous, and the caches hold x's dtype."""
        half = self.head_dim // 2
        return (w.shape[1] == (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
                and self.head_dim % 2 == 0 and half % block_n == 0
                and self.q.shape == (x.shape[0], self.num_heads, self.head_dim)
                and self.q.stride(2) == 1 and self.k_cache.stride(3) == 1
                and self.v_cache.stride(3) == 1 and self.cos.stride(1) == 1
                and self.cos.stride() == self.sin.stride()
                and self.q.dtype == self.k_cache.dtype == self.v_cache.dtype == x.dtype)

    def kernel_args(self) -> tuple:
        """The launch's RoPE arguments after the queries' row stride (triton_kernel.py)."""
        k, v = self.k_cache, self.v_cache
        return (k, v, self.cos, self.sin, self.positions, self.slot_mapping, self.q.stride(1),
                k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
                self.cos.stride(0), k.shape[1])


def no_rope_args(t: torch.Tensor) -> tuple:
    """Placeholders for a launch without RoPE (never read)."""
    return (t,) * 6 + (0,) * 8 + (1,)
