"""RoPE on the new tokens' queries and keys, and their keys and values written into the paged
KV cache: the PyTorch reference (the CPU path and the Triton kernel's oracle)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..lora.delta import LoraDelta, with_delta
from ..norm.reference import rms_norm


@dataclass(frozen=True)
class QKNorm:
    """Per-head RMSNorm of queries and keys before RoPE: weights [D] each (rms_norm's
    unit_offset for Gemma's (1 + w))."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float
    unit_offset: bool = False


def rotate_half_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF "rotate_half" RoPE, computed in float32 and rounded once to x's dtype."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


def rope_and_cache_ref(qkv: torch.Tensor, delta: LoraDelta | None, cos_table: torch.Tensor,
                       sin_table: torch.Tensor, positions: torch.Tensor,
                       slot_mapping: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       num_heads: int, num_kv_heads: int, head_dim: int,
                       qk_norm: QKNorm | None = None) -> torch.Tensor:
    """qkv: [T, (Hq + 2 Hkv) * D] projections (q, k, v columns); delta: their LoRA delta
    (expanded here) or None; caches [blocks, block_size, Hkv, D], any strides; qk_norm: each
    query and key head RMS-normalised before its rotation (Qwen3, Gemma 3). Writes the
    rotated keys and the values at slot_mapping; returns the rotated queries [T, Hq, D]."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    if delta is not None:
        dq, dk, dv = delta.dense().split([q_size, kv_size, kv_size], dim=-1)
        q, k, v = with_delta(q, dq), with_delta(k, dk), with_delta(v, dv)
    q, k = q.reshape(-1, num_heads, head_dim), k.reshape(-1, num_kv_heads, head_dim)
    if qk_norm is not None:
        q = rms_norm(q, qk_norm.q_weight, qk_norm.eps, qk_norm.unit_offset)
        k = rms_norm(k, qk_norm.k_weight, qk_norm.eps, qk_norm.unit_offset)
    cos = cos_table[positions][:, None, :]
    sin = sin_table[positions][:, None, :]
    q = rotate_half_rope(q, cos, sin)
    k = rotate_half_rope(k, cos, sin)
    page = k_cache.shape[1]
    blocks, offsets = slot_mapping // page, slot_mapping % page
    k_cache[blocks, offsets] = k  # the caches may be views of any strides (head-major)
    v_cache[blocks, offsets] = v.reshape(-1, num_kv_heads, head_dim)
    return q
