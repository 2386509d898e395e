"""The decode all-reduce, the residual add and RMSNorm in one launch (`--all-reduce fused`).

At a decode step's sizes ([64, 4096] bf16: 0.5 MB) an all-reduce is latency: NCCL takes 17-25 us
inside a CUDA graph, and a step of an 8B model makes 65 of them. Here each rank's program t
(one per row) copies its partial row into its own peer-mapped buffer, tells every peer so by
a flag in the peer's buffer (a release store at system scope), waits for every peer's flag
for the row (acquire loads of its own buffer), then reads the peers' rows over NVLink and adds
them in float32 in rank order: every rank adds the same numbers in the same order and gets
the same bits. The bias, the residual add and the norm (Gemma's norm of the output first, and
its (1 + w)) follow on the row still in registers, as kernels/norm computes them. One barrier a
call: the slots alternate by the row's epoch (layout.py), so the next call's writes never
land where a slow peer still reads.

No NVLink multicast (no multimem instruction): plain loads of peer memory. The residual,
weights and bias are read before the wait, so their latency hides behind it.

sync=False leaves the flags out: one process then passes every "peer" buffer itself (the
interpreter test of the copy, the sum and the norm; it tests the math, not the barrier).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..host import next_power_of_2
from ..norm.triton_kernel import _weigh
from .layout import EPOCH_MASK, PeerBuffers

_EPOCH_MASK: tl.constexpr = tl.constexpr(EPOCH_MASK)


@triton.jit
def _peer(offsets_ptr, p, ELEMENT_BYTES: tl.constexpr):
    """How many elements of ELEMENT_BYTES rank p's buffer lies from this rank's (a multiple of
    16: layout.PeerBuffers.offsets_of)."""
    return tl.multiple_of(tl.load(offsets_ptr + p) // ELEMENT_BYTES, 16)


@triton.jit
def _signal_and_wait(flags_ptr, offsets_ptr, t, epoch, RANK: tl.constexpr, WORLD: tl.constexpr):
    """Row t's flag to every peer, then every peer's flag for row t: after it, the peers'
    stores of the row (before their flags) are visible to every thread of this program."""
    tl.debug_barrier()  # every thread's part of the row stored before the flags say so
    for p in tl.static_range(WORLD):
        if p != RANK:
            peer_flags = flags_ptr + _peer(offsets_ptr, p, 4)
            tl.atomic_xchg(peer_flags + t * WORLD + RANK, epoch, sem="release", scope="sys")
    for p in tl.static_range(WORLD):
        if p != RANK:
            # The peer's flag holds epoch - 1 until it arrives, then epoch, or epoch + 1 once
            # it has gone on into its next call (it cannot get further without this rank).
            flag = tl.atomic_add(flags_ptr + t * WORLD + p, 0, sem="acquire", scope="sys")
            while ((flag - epoch) & _EPOCH_MASK) > 1:
                flag = tl.atomic_add(flags_ptr + t * WORLD + p, 0, sem="acquire", scope="sys")
    tl.debug_barrier()  # the acquires above before any thread reads a peer's row


@triton.jit
def _all_reduce_add_rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, bias_ptr, out_norm_ptr, new_residual_ptr, normed_ptr,
    rows_ptr, flags_ptr, offsets_ptr, epochs_ptr, eps, slot_numel,
    stride_x, stride_r, stride_nr, stride_n,
    RANK: tl.constexpr, WORLD: tl.constexpr, H: tl.constexpr, BLOCK_H: tl.constexpr,
    HAS_BIAS: tl.constexpr, UNIT_OFFSET: tl.constexpr, OUT_NORM: tl.constexpr, SYNC: tl.constexpr,
):
    """rows_ptr, flags_ptr: this rank's slots of rows (in x's dtype) and its flags; a peer's
    are offsets_ptr[p] bytes away."""
    ELEMENT_BYTES: tl.constexpr = x_ptr.dtype.element_ty.primitive_bitwidth // 8
    t = tl.program_id(0)
    t64 = t.to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < H
    epoch = (tl.load(epochs_ptr + t) + 1) & _EPOCH_MASK
    tl.store(epochs_ptr + t, epoch)  # only this program touches row t's epoch
    row = rows_ptr + (epoch & 1).to(tl.int64) * slot_numel + t64 * H
    own = tl.load(x_ptr + t64 * stride_x + offs, mask=mask, other=0.0)
    tl.store(row + offs, own, mask=mask)
    # What the peers do not write, loaded while they catch up.
    res = tl.load(residual_ptr + t64 * stride_r + offs, mask=mask, other=0.0)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        b = tl.load(bias_ptr + offs, mask=mask, other=0.0)
    if OUT_NORM:
        w_out = tl.load(out_norm_ptr + offs, mask=mask, other=0.0)
    if SYNC:
        _signal_and_wait(flags_ptr, offsets_ptr, t, epoch, RANK, WORLD)
    total = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for p in tl.static_range(WORLD):  # rank order, this rank's row from registers
        if p == RANK:
            part = own
        else:
            part = tl.load(row + _peer(offsets_ptr, p, ELEMENT_BYTES) + offs, mask=mask, other=0.0,
                           cache_modifier=".cg")
        total += part.to(tl.float32)
    out = total.to(x_ptr.dtype.element_ty)  # the all-reduce's result, as the unfused ops hold it
    if HAS_BIAS:
        out = (out.to(tl.float32) + b.to(tl.float32)).to(out.dtype)
    if OUT_NORM:  # Gemma: the sublayer's output normalised before the add
        of = out.to(tl.float32)
        out_rstd = 1.0 / tl.sqrt(tl.sum(of * of, axis=0) / H + eps)
        out = _weigh(out, out_rstd, w_out, UNIT_OFFSET).to(out.dtype)
    new = (res.to(tl.float32) + out.to(tl.float32)).to(out.dtype)
    tl.store(new_residual_ptr + t64 * stride_nr + offs, new, mask=mask)
    newf = new.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(newf * newf, axis=0) / H + eps)
    tl.store(normed_ptr + t64 * stride_n + offs, _weigh(new, rstd, w, UNIT_OFFSET).to(new.dtype), mask=mask)


def num_warps(block_h: int) -> int:
    """Warps of a program: 16 columns a thread (two 16-byte loads of bf16), 4 to 16 warps."""
    return min(16, max(4, block_h // 512))


def all_reduce_add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                                   peers: PeerBuffers, *, bias: torch.Tensor | None = None,
                                   unit_offset: bool = False, out_norm: torch.Tensor | None = None,
                                   sync: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.all_reduce_add_rms_norm of every rank's x (this rank's partial rows [T, H]):
    (the new residual stream, that normalised). Every rank of the group must make the same
    call (the same T) in the same order; a CUDA graph may hold it (no host work per call
    beyond the launch)."""
    T, H = x.shape
    layout = peers.layout
    assert layout.fits(T, H, x.element_size()), (T, H, layout)
    assert residual.shape == x.shape and residual.dtype == x.dtype
    assert x.stride(1) == 1 and residual.stride(1) == 1 and weight.is_contiguous()
    assert bias is None or bias.is_contiguous()
    assert out_norm is None or out_norm.is_contiguous()
    assert layout.slot_bytes % (16 * x.element_size()) == 0  # rows stay 16-element aligned
    new_residual = torch.empty((T, H), dtype=x.dtype, device=x.device)
    normed = torch.empty((T, H), dtype=x.dtype, device=x.device)
    block_h = next_power_of_2(H)
    own = peers.buffer[:layout.nbytes]
    _all_reduce_add_rms_norm_kernel[(T,)](
        x, residual, weight, bias if bias is not None else weight, out_norm if out_norm is not None else weight,
        new_residual, normed, own[layout.flags_bytes:].view(x.dtype), own[:layout.flags_bytes].view(torch.int32),
        peers.offsets, peers.epochs, eps, layout.slot_bytes // x.element_size(),
        x.stride(0), residual.stride(0), new_residual.stride(0), normed.stride(0),
        RANK=peers.rank, WORLD=layout.world, H=H, BLOCK_H=block_h, HAS_BIAS=bias is not None,
        UNIT_OFFSET=unit_offset, OUT_NORM=out_norm is not None, SYNC=sync,
        num_warps=num_warps(block_h),
    )
    return new_residual, normed
