"""RoPE + KV-cache write dispatcher: the Triton kernel on CUDA, the PyTorch reference elsewhere."""
from __future__ import annotations

import torch

from ._dispatch import use_triton
from .lora_delta import LoraDelta
from .rope_cache_ref import rope_and_cache_ref


def rope_and_cache(qkv: torch.Tensor, delta: LoraDelta | None, cos_table: torch.Tensor,
                   sin_table: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int,
                   num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """Rotated queries [T, Hq, D]; the rotated keys and the values written into the caches
    (see rope_cache_ref.rope_and_cache_ref)."""
    args = (qkv, delta, cos_table, sin_table, positions, slot_mapping, k_cache, v_cache,
            num_heads, num_kv_heads, head_dim)
    if use_triton(qkv):
        try:
            from .rope_cache_triton import rope_and_cache_triton
        except ImportError:  # Triton absent: the reference serves
            pass
        else:
            return rope_and_cache_triton(*args)
    return rope_and_cache_ref(*args)
