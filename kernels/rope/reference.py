"""RoPE on the new tokens' queries and keys, and their keys and values written into the paged
KV cache: the PyTorch reference (the CPU path and the Triton kernel's oracle)."""
from __future__ import annotations

import torch

from ..lora.delta import LoraDelta, with_delta


def rotate_half_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF "rotate_half" RoPE, computed in float32 and rounded once to x's dtype."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


def rope_and_cache_ref(qkv: torch.Tensor, delta: LoraDelta | None, cos_table: torch.Tensor,
                       sin_table: torch.Tensor, positions: torch.Tensor,
                       slot_mapping: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """qkv: [T, (Hq + 2 Hkv) * D] projections (q, k, v columns); delta: their LoRA delta
    (expanded here) or None; caches [blocks, block_size, Hkv, D], any strides. Writes the rotated keys and the values
    at slot_mapping; returns the rotated queries [T, Hq, D]."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    if delta is not None:
        dq, dk, dv = delta.dense().split([q_size, kv_size, kv_size], dim=-1)
        q, k, v = with_delta(q, dq), with_delta(k, dk), with_delta(v, dv)
    cos = cos_table[positions][:, None, :]
    sin = sin_table[positions][:, None, :]
    q = rotate_half_rope(q.reshape(-1, num_heads, head_dim), cos, sin)
    k = rotate_half_rope(k.reshape(-1, num_kv_heads, head_dim), cos, sin)
    page = k_cache.shape[1]
    blocks, offsets = slot_mapping // page, slot_mapping % page
    k_cache[blocks, offsets] = k  # the caches may be views of any strides (head-major)
    v_cache[blocks, offsets] = v.reshape(-1, num_kv_heads, head_dim)
    return q
