"""RoPE and the KV-cache write in one Triton launch per layer.

In a decode step the ops between the q/k/v matmul and attention are tiny (64 rows) and each
costs a launch and a round trip through memory: adding the LoRA delta, rotating q and k,
writing k and v into their cache slots. One program per (token, part) does all of it for
its row: part 0 rotates the query heads, part 1 the key heads (written to the cache), part 2
copies the value heads into the cache, each with its LoRA delta added first when given.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _load_heads(qkv_row, delta_row, col0, heads, offs_h, offs_d, D, HAS_DELTA: tl.constexpr):
    """[heads, D] of one row starting at column col0, plus its delta, rounded to qkv's dtype
    once (as the unfused path rounds), returned in float32."""
    mask = (offs_h[:, None] < heads) & (offs_d[None, :] < D)
    cols = col0 + offs_h[:, None] * D + offs_d[None, :]
    x = tl.load(qkv_row + cols, mask=mask, other=0.0)
    if HAS_DELTA:
        x = (x.to(tl.float32) + tl.load(delta_row + cols, mask=mask, other=0.0)).to(x.dtype)
    return x.to(tl.float32), mask


@triton.jit
def _rotated(qkv_row, delta_row, col0, heads, offs_h, offs_d, cos, sin, D, HALF,
             HAS_DELTA: tl.constexpr):
    """x * cos + rotate_half(x) * sin for [heads, D] at col0 (float32)."""
    x, mask = _load_heads(qkv_row, delta_row, col0, heads, offs_h, offs_d, D, HAS_DELTA)
    partner = tl.where(offs_d < HALF, offs_d + HALF, offs_d - HALF)
    sign = tl.where(offs_d < HALF, -1.0, 1.0)
    x_p, _ = _load_heads(qkv_row, delta_row, col0, heads, offs_h, partner, D, HAS_DELTA)
    return x * cos[None, :] + (x_p * sign[None, :]) * sin[None, :], mask


@triton.jit
def _rope_cache_kernel(
    qkv_ptr, delta_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
    stride_qkv, stride_delta, stride_qo_t, stride_qo_h, stride_cos,
    stride_kb, stride_kp, stride_kh, stride_vb, stride_vp, stride_vh,
    Hq, Hkv, D, HALF, PAGE,
    HAS_DELTA: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    qkv_row = qkv_ptr + t * stride_qkv
    delta_row = delta_ptr + t * stride_delta
    offs_d = tl.arange(0, BLOCK_D)
    q_cols = Hq * D
    # Each branch names its own values: Triton's branches may not bind one name to tensors of
    # different shapes.
    if part == 0:
        pos_q = tl.load(pos_ptr + t)
        cos_q = tl.load(cos_ptr + pos_q * stride_cos + offs_d, mask=offs_d < D, other=0.0)
        sin_q = tl.load(sin_ptr + pos_q * stride_cos + offs_d, mask=offs_d < D, other=0.0)
        heads_q = tl.arange(0, BLOCK_HQ)
        q, q_mask = _rotated(qkv_row, delta_row, 0, Hq, heads_q, offs_d, cos_q, sin_q, D, HALF,
                             HAS_DELTA)
        q_dst = q_out_ptr + t * stride_qo_t + heads_q[:, None] * stride_qo_h + offs_d[None, :]
        tl.store(q_dst, q.to(q_out_ptr.dtype.element_ty), mask=q_mask)
    elif part == 1:
        pos_k = tl.load(pos_ptr + t)
        cos_k = tl.load(cos_ptr + pos_k * stride_cos + offs_d, mask=offs_d < D, other=0.0)
        sin_k = tl.load(sin_ptr + pos_k * stride_cos + offs_d, mask=offs_d < D, other=0.0)
        heads_k = tl.arange(0, BLOCK_HKV)
        k, k_mask = _rotated(qkv_row, delta_row, q_cols, Hkv, heads_k, offs_d, cos_k, sin_k, D,
                             HALF, HAS_DELTA)
        slot_k = tl.load(slot_ptr + t).to(tl.int64)
        k_dst = (k_cache_ptr + (slot_k // PAGE) * stride_kb + (slot_k % PAGE) * stride_kp
                 + heads_k[:, None] * stride_kh + offs_d[None, :])
        tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=k_mask)
    else:
        heads_v = tl.arange(0, BLOCK_HKV)
        v, v_mask = _load_heads(qkv_row, delta_row, q_cols + Hkv * D, Hkv, heads_v, offs_d, D,
                                HAS_DELTA)
        slot_v = tl.load(slot_ptr + t).to(tl.int64)
        v_dst = (v_cache_ptr + (slot_v // PAGE) * stride_vb + (slot_v % PAGE) * stride_vp
                 + heads_v[:, None] * stride_vh + offs_d[None, :])
        tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=v_mask)


def rope_and_cache_triton(qkv: torch.Tensor, delta: torch.Tensor | None, cos_table: torch.Tensor,
                          sin_table: torch.Tensor, positions: torch.Tensor,
                          slot_mapping: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, num_heads: int, num_kv_heads: int,
                          head_dim: int) -> torch.Tensor:
    """As rope_and_cache_ref, in one launch."""
    T = qkv.shape[0]
    assert head_dim % 2 == 0, "RoPE needs an even head size"
    assert qkv.stride(1) == 1 and (delta is None or delta.stride(1) == 1)
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1, "a head's vector must be contiguous"
    assert cos_table.stride(1) == 1 and cos_table.stride() == sin_table.stride()
    q = torch.empty(T, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if T == 0:
        return q
    _rope_cache_kernel[(T, 3)](
        qkv, delta if delta is not None else qkv, cos_table, sin_table, positions, slot_mapping,
        q, k_cache, v_cache,
        qkv.stride(0), delta.stride(0) if delta is not None else 0, q.stride(0), q.stride(1),
        cos_table.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        num_heads, num_kv_heads, head_dim, head_dim // 2, k_cache.shape[1],
        HAS_DELTA=delta is not None, BLOCK_HQ=triton.next_power_of_2(num_heads),
        BLOCK_HKV=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4,
    )
    return q
