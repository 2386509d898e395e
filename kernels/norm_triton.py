"""The residual add, a projection's LoRA delta and RMSNorm in one Triton launch.

One program per row: the row's delta is expanded from the shrink's partial sums and its
adapter's B (kernels/lora_delta.py), added to the projection's output and to the residual
stream, and the sum normalised. The first pass writes the new residual row and its sum of
squares; after a barrier the second pass reads the row back (from cache) and writes the
normalised one. Rows without an adapter skip the B reads.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .lora_delta import LoraDelta


@triton.jit
def _add_rms_norm_kernel(
    hidden_ptr, out_ptr, weight_ptr, new_hidden_ptr, x_ptr,
    part_ptr, b_ptr, slots_ptr, ranks_ptr,
    H, eps, SPLITS,
    stride_h, stride_o, stride_nh, stride_x,
    stride_ps, stride_pt, stride_bs, stride_bn,
    HAS_LORA: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    if HAS_LORA:
        slot = tl.load(slots_ptr + t)
        rank = tl.where(slot >= 0, tl.load(ranks_ptr + tl.maximum(slot, 0)), 0)
        b_rows = b_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_bs
        hvec = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for s in range(SPLITS):
            hvec += tl.load(part_ptr + s * stride_ps + t * stride_pt + offs_r,
                            mask=offs_r < rank, other=0.0)
    sumsq = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for c0 in range(0, H, BLOCK_H):
        offs = c0 + tl.arange(0, BLOCK_H)
        mask = offs < H
        o = tl.load(out_ptr + t * stride_o + offs, mask=mask, other=0.0)
        if HAS_LORA:
            if rank > 0:
                b = tl.load(b_rows + offs[:, None] * stride_bn + offs_r[None, :],
                            mask=mask[:, None] & (offs_r[None, :] < rank), other=0.0)
                delta = tl.sum(b.to(tl.float32) * hvec[None, :], axis=1)
                o = (o.to(tl.float32) + delta).to(o.dtype)
        res = tl.load(hidden_ptr + t * stride_h + offs, mask=mask, other=0.0)
        new = (res.to(tl.float32) + o.to(tl.float32)).to(res.dtype)
        tl.store(new_hidden_ptr + t * stride_nh + offs, new, mask=mask)
        newf = new.to(tl.float32)
        sumsq += newf * newf
    rstd = 1.0 / tl.sqrt(tl.sum(sumsq, axis=0) / H + eps)
    tl.debug_barrier()  # the row's stores above, by every thread, before it is read back
    for c0 in range(0, H, BLOCK_H):
        offs = c0 + tl.arange(0, BLOCK_H)
        mask = offs < H
        new = tl.load(new_hidden_ptr + t * stride_nh + offs, mask=mask, other=0.0)
        normed = (new.to(tl.float32) * rstd).to(new.dtype)
        w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
        x = (w.to(tl.float32) * normed.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + t * stride_x + offs, x, mask=mask)


def add_rms_norm_triton(hidden: torch.Tensor, out: torch.Tensor, weight: torch.Tensor,
                        eps: float, delta: LoraDelta | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """As norm_ref.add_rms_norm with delta.dense(), in one launch."""
    T, H = hidden.shape
    assert hidden.stride(1) == 1 and out.stride(1) == 1 and weight.is_contiguous()
    new_hidden = torch.empty_like(hidden)
    x = torch.empty_like(hidden)
    if T == 0:
        return new_hidden, x
    if delta is not None:
        assert len(delta.b) == 1, "one slice: o or down"
        b = delta.b[0]
        assert b.shape[1] == H and b.stride(2) == 1 and delta.partials.stride(3) == 1
        part, slots, ranks = delta.partials, delta.token_slots, delta.ranks[0]
        block_r = max(16, triton.next_power_of_2(delta.partials.shape[3]))
        lora_strides = (part.stride(0), part.stride(2), b.stride(0), b.stride(1))
        splits = delta.splits
    else:
        part = b = slots = ranks = hidden  # dummy pointers, never read
        block_r, lora_strides, splits = 16, (0, 0, 0, 0), 0
    block_h = min(triton.next_power_of_2(H), 2048)
    _add_rms_norm_kernel[(T,)](
        hidden, out, weight, new_hidden, x, part, b, slots, ranks,
        H, eps, splits, hidden.stride(0), out.stride(0), new_hidden.stride(0), x.stride(0),
        *lora_strides,
        HAS_LORA=delta is not None, BLOCK_H=block_h, BLOCK_R=block_r,
        num_warps=8 if delta is not None else 4,
    )
    return new_hidden, x
