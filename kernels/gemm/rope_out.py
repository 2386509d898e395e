"""Where q/k/v's decode GEMM with RoPE in its epilogue writes (triton_kernel.py: ROPE): the
queries to their buffer, the keys and values to their rows' slots in the paged KV cache, as
kernels/rope's launch does after a plain q/k/v GEMM; with the family's q/k/v bias and per-head
q/k norm where it has them (rope_epilogue.py). Host-side only (no Triton import)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..rope.reference import QKNorm


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
    bias: torch.Tensor | None = None     # [(Hq + 2 Hkv) D]: q/k/v's bias (Qwen2/2.5)
    qk_norm: QKNorm | None = None        # per-head q/k RMSNorm before RoPE (Qwen3, Gemma 3)

    def fits(self, x: torch.Tensor, w: torch.Tensor, block_n: int) -> bool:
        """Whether a launch of x @ w with `block_n` columns of each half of a head a program
        can write here: w is q/k/v's for these heads, the tile divides half a head (with a q/k
        norm it is half a head: the norm sums over the whole head), a head's vector, the
        tables, the bias and the norm weights are contiguous, and the caches and the bias
        hold x's dtype."""
        half, width = self.head_dim // 2, (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        bias, norm = self.bias, self.qk_norm
        return (w.shape[1] == width and self.head_dim % 2 == 0 and half % block_n == 0
                and self.q.shape == (x.shape[0], self.num_heads, self.head_dim)
                and self.q.stride(2) == 1 and self.k_cache.stride(3) == 1
                and self.v_cache.stride(3) == 1 and self.cos.stride(1) == 1
                and self.cos.stride() == self.sin.stride()
                and self.q.dtype == self.k_cache.dtype == self.v_cache.dtype == x.dtype
                and (bias is None or (bias.shape == (width,) and bias.stride(0) == 1
                                      and bias.dtype == x.dtype))
                and (norm is None or (block_n == half
                                      and norm.q_weight.shape == norm.k_weight.shape == (self.head_dim,)
                                      and norm.q_weight.is_contiguous() and norm.k_weight.is_contiguous()
                                      and norm.q_weight.dtype == norm.k_weight.dtype)))

    def kernel_args(self) -> tuple:
        """The launch's RoPE arguments after the queries' row stride (triton_kernel.py)."""
        k, v, norm = self.k_cache, self.v_cache, self.qk_norm
        return (k, v, self.cos, self.sin, self.positions, self.slot_mapping, self.q.stride(1),
                k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
                self.cos.stride(0), k.shape[1], self.bias if self.bias is not None else self.q,
                *((norm.q_weight, norm.k_weight, norm.eps) if norm is not None else (self.q, self.q, 0.0)))

    def switches(self) -> dict[str, bool]:
        """The epilogue's constexpr switches (off: the launch compiles as a plain RoPE one)."""
        norm = self.qk_norm
        return dict(BIAS=self.bias is not None, QK_NORM=norm is not None,
                    UNIT_OFFSET=norm is not None and norm.unit_offset)


def no_rope_args(t: torch.Tensor) -> tuple:
    """Placeholders for a launch without RoPE (never read)."""
    return (t,) * 6 + (0,) * 8 + (1,) + (t,) * 3 + (0.0,)
