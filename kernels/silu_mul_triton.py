"""SiLU(gate) * up with the gate/up LoRA delta expanded in, in one Triton launch.

Programs cover (row, a span of the intermediate columns): each reads its gate and up columns,
expands the row's delta for them from the shrink's partial sums and the adapter's B columns
(kernels/lora_delta.py), and writes the activation. Rows without an adapter skip the B reads.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .lora_delta import LoraDelta


@triton.jit
def _expanded(x, part_row, b_rows, stride_bn, offs, mask, offs_r, rank, SPLITS, stride_ps,
              BLOCK_R: tl.constexpr):
    """x (a row's columns `offs` of one slice) plus h @ B[offs].T, rounded once to x's dtype."""
    h = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for s in range(SPLITS):
        h += tl.load(part_row + s * stride_ps + offs_r, mask=offs_r < rank, other=0.0)
    b = tl.load(b_rows + offs[:, None] * stride_bn + offs_r[None, :],
                mask=mask[:, None] & (offs_r[None, :] < rank), other=0.0)
    return (x.to(tl.float32) + tl.sum(b.to(tl.float32) * h[None, :], axis=1)).to(x.dtype)


@triton.jit
def _silu_mul_kernel(
    gu_ptr, act_ptr, part_ptr, bg_ptr, bu_ptr, slots_ptr, ranks_ptr,
    I, SPLITS,
    stride_gu, stride_act, stride_ps, stride_pslice, stride_pt,
    stride_bgs, stride_bgn, stride_bus, stride_bun, stride_rank_slice,
    HAS_LORA: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_R: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = offs < I
    g = tl.load(gu_ptr + t * stride_gu + offs, mask=mask, other=0.0)
    u = tl.load(gu_ptr + t * stride_gu + I + offs, mask=mask, other=0.0)
    if HAS_LORA:
        slot = tl.load(slots_ptr + t)
        safe = tl.maximum(slot, 0)
        rank_g = tl.where(slot >= 0, tl.load(ranks_ptr + safe), 0)
        rank_u = tl.where(slot >= 0, tl.load(ranks_ptr + stride_rank_slice + safe), 0)
        offs_r = tl.arange(0, BLOCK_R)
        part_row = part_ptr + t * stride_pt
        if rank_g > 0:
            g = _expanded(g, part_row, bg_ptr + safe.to(tl.int64) * stride_bgs, stride_bgn,
                          offs, mask, offs_r, rank_g, SPLITS, stride_ps, BLOCK_R)
        if rank_u > 0:
            u = _expanded(u, part_row + stride_pslice, bu_ptr + safe.to(tl.int64) * stride_bus,
                          stride_bun, offs, mask, offs_r, rank_u, SPLITS, stride_ps, BLOCK_R)
    gf = g.to(tl.float32)
    silu = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # rounded as F.silu rounds
    act = silu.to(tl.float32) * u.to(tl.float32)
    tl.store(act_ptr + t * stride_act + offs, act.to(act_ptr.dtype.element_ty), mask=mask)


def silu_mul_triton(gate_up: torch.Tensor, delta: LoraDelta | None = None) -> torch.Tensor:
    """As silu_mul_ref.silu_mul with delta.dense(), in one launch."""
    T, two_i = gate_up.shape
    I = two_i // 2
    assert gate_up.stride(1) == 1
    act = torch.empty(T, I, dtype=gate_up.dtype, device=gate_up.device)
    if T == 0:
        return act
    if delta is not None:
        assert len(delta.b) == 2, "two slices: gate and up"
        bg, bu = delta.b
        part = delta.partials
        assert bg.shape[1] == I and bu.shape[1] == I and bg.stride(2) == 1 and bu.stride(2) == 1
        assert part.stride(3) == 1
        slots, ranks = delta.token_slots, delta.ranks
        lora_args = (part.stride(0), part.stride(1), part.stride(2), bg.stride(0), bg.stride(1),
                     bu.stride(0), bu.stride(1), ranks.stride(0))
        block_r, splits = max(16, triton.next_power_of_2(part.shape[3])), delta.splits
    else:
        part = bg = bu = slots = ranks = gate_up  # dummy pointers, never read
        lora_args, block_r, splits = (0,) * 8, 16, 0
    block_i = min(1024, triton.next_power_of_2(I))
    _silu_mul_kernel[(T, triton.cdiv(I, block_i))](
        gate_up, act, part, bg, bu, slots, ranks, I, splits,
        gate_up.stride(0), act.stride(0), *lora_args,
        HAS_LORA=delta is not None, BLOCK_I=block_i, BLOCK_R=block_r, num_warps=4,
    )
    return act
