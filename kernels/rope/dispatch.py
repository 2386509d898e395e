"""RoPE + KV-cache write (+ the q/k/v LoRA delta): the Triton kernel (triton_kernel.py) where
Triton runs, the PyTorch reference (reference.py) elsewhere."""
from __future__ import annotations

import torch

from ..dispatch import triton_kernel
from ..lora.delta import LoraDelta
from ..tuning import DEFAULT_TUNING, Tuning
from .reference import QKNorm, rope_and_cache_ref


def rope_and_cache(qkv: torch.Tensor, delta: LoraDelta | None, cos_table: torch.Tensor,
                   sin_table: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int,
                   num_kv_heads: int, head_dim: int, tuning: Tuning = DEFAULT_TUNING, *,
                   out: torch.Tensor | None = None, qk_norm: QKNorm | None = None) -> torch.Tensor:
    """Rotated queries [T, Hq, D] (written into `out` where given: a CUDA graph's static
    buffer); the rotated keys and the values written into the caches (see
    reference.rope_and_cache_ref, and its qk_norm)."""
    args = (qkv, delta, cos_table, sin_table, positions, slot_mapping, k_cache, v_cache,
            num_heads, num_kv_heads, head_dim)
    kernel = triton_kernel(qkv, "kernels.rope.triton_kernel", "rope_and_cache_triton")
    if kernel is not None:
        return kernel(*args, tuning=tuning, out=out, qk_norm=qk_norm)
    q = rope_and_cache_ref(*args, qk_norm=qk_norm)
    if out is None:
        return q
    out.copy_(q)
    return out
