"""The residual add, a projection's LoRA delta and RMSNorm in one Triton launch.

One program per row: the row's delta is expanded from the shrink's partial sums and its
adapter's B (kernels/lora/delta.py), added to the projection's output and to the residual
stream, and the sum normalised (or the delta already expanded beside the matmul is added).
The first pass writes the new residual row and its sum of squares; after a barrier the second
pass reads the row back (from cache) and writes the normalised one. Rows without an adapter
skip the B reads.

At decode batch one program a row leaves half of an H100's SMs idle while each of the others
reads a whole B slice (64 KB at Llama-3.2-1B's width). Given a ColumnSplit (kernels/lora/
delta.py) the LoRA kernel spreads each row over programs of a few hundred columns, and the
row's last program to finish (an arrival count per row) normalises it; the count is reset by
that program, so graph replays need no clearing. In the decode graph it pays after o, whose
shrink runs in o's GEMM: the programs, launched early (PDL), read their B columns while that
GEMM runs, which one program holding a whole row's B could not (kernels/tuning.py:
norm_split_groups).

Gemma's layers norm a sublayer's output before the residual add (`out_norm`) and scale every
norm by (1 + w) in float32 (`unit_offset`): the row kernel then makes one more pass, the
output's own sum of squares before the add (its rows are never split over programs).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..gemm.fp8 import Fp8Rows, SplitSums
from ..gemm.shapes import empty_rows
from ..gemm.fp8_rows_triton import quantize_row, quantize_stored_row
from ..host import cdiv, next_power_of_2, pdl_launch
from ..lora.delta import LoraDelta
from ..lora.expand_rows import expand_rows, load_b_rows, load_sums
from ..tuning import DEFAULT_TUNING, Tuning


QUANT_WHOLE_ROW = 8192  # the widest row the add + norm quantizes for W8A8 from registers


@triton.jit
def _lora_rows(b_ptr, rows_ptr, t, R, stride_rows, stride_br):
    """Row t's adapter's B rows in the arena and its rank, the rank rows to read (0 for a row
    without an adapter: no B read, no sums read, zero added). A step input and the arena's
    weights: nothing the kernel ahead writes, so a PDL launch may read them before its wait."""
    r_live = tl.minimum(tl.load(rows_ptr + t * stride_rows), R)
    first = tl.load(rows_ptr + t * stride_rows + 1)
    return b_ptr + first.to(tl.int64) * stride_br, r_live


@triton.jit
def _add_residual(hidden_ptr, new_hidden_ptr, t, offs, mask, o, stride_h, stride_nh):
    """Row t's columns `offs` of the new residual stream, hidden + o (o already holding its
    delta), stored and returned in float32."""
    res = tl.load(hidden_ptr + t * stride_h + offs, mask=mask, other=0.0)
    new = (res.to(tl.float32) + o.to(tl.float32)).to(res.dtype)
    tl.store(new_hidden_ptr + t * stride_nh + offs, new, mask=mask)
    return new.to(tl.float32)


@triton.jit
def _weigh(v, rstd, w, UNIT_OFFSET: tl.constexpr):
    """v normalised by rstd and weighted, rounded as the reference rounds: Llama's w times
    the normalised value in v's dtype; Gemma's (1 + w), multiplied in float32, rounded once."""
    if UNIT_OFFSET:
        return v.to(tl.float32) * rstd * (1.0 + w.to(tl.float32))
    normed = (v.to(tl.float32) * rstd).to(v.dtype)
    return w.to(tl.float32) * normed.to(tl.float32)


@triton.jit
def _normalise_chunk(new_hidden_ptr, weight_ptr, x_ptr, t, offs, mask, rstd, stride_nh, stride_x,
                     CG: tl.constexpr, UNIT_OFFSET: tl.constexpr):
    """Columns `offs` of row t of the new residual stream read back, normalised and weighted:
    stored to x and returned (in x's type)."""
    if CG:
        new = tl.load(new_hidden_ptr + t * stride_nh + offs, mask=mask, other=0.0, cache_modifier=".cg")
    else:
        new = tl.load(new_hidden_ptr + t * stride_nh + offs, mask=mask, other=0.0)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    x = _weigh(new, rstd, w, UNIT_OFFSET).to(x_ptr.dtype.element_ty)
    tl.store(x_ptr + t * stride_x + offs, x, mask=mask)
    return x


@triton.jit
def _normalise_row(new_hidden_ptr, weight_ptr, x_ptr, q_ptr, qs_ptr, t, rstd, stride_nh, stride_x,
                   stride_q, H: tl.constexpr, BLOCK_H: tl.constexpr, CG: tl.constexpr,
                   UNIT_OFFSET: tl.constexpr = False, QUANT: tl.constexpr = False):
    """Reads row t of the new residual stream back and writes it normalised and weighted.
    CG: load through L2 only (rows other programs wrote). QUANT: the written row also in
    e4m3 with its scale (q, qs: the W8A8 GEMM's operand, kernels/gemm/fp8_rows_triton.py)."""
    if QUANT and BLOCK_H >= H:  # one chunk: quantized from registers, no barrier, no read-back
        offs = tl.arange(0, BLOCK_H)
        mask = offs < H
        x = _normalise_chunk(new_hidden_ptr, weight_ptr, x_ptr, t, offs, mask, rstd, stride_nh, stride_x,
                             CG, UNIT_OFFSET)
        quantize_row(x.to(tl.float32), q_ptr + t * stride_q, qs_ptr + t, offs, mask, BLOCK_H)
    else:
        amax = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for c0 in tl.static_range(0, H, BLOCK_H):
            offs = c0 + tl.arange(0, BLOCK_H)
            mask = offs < H
            x = _normalise_chunk(new_hidden_ptr, weight_ptr, x_ptr, t, offs, mask, rstd, stride_nh, stride_x,
                                 CG, UNIT_OFFSET)
            if QUANT:
                amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
        if QUANT:
            quantize_stored_row(x_ptr + t * stride_x, q_ptr + t * stride_q, qs_ptr + t,
                                tl.max(amax, axis=0), H, BLOCK_H)


@triton.jit
def _load_output(out_ptr, t, stride_o, stride_ks, offs, mask, K_SPLITS: tl.constexpr, dtype: tl.constexpr):
    """Row t's columns `offs` of the projection's output: as written, or from a K-split GEMM's
    float32 partials (K_SPLITS of them, stride_ks apart) summed in split order and rounded
    once to `dtype`, bit for bit what that GEMM's sum launch would have written."""
    if K_SPLITS > 1:
        total = tl.zeros(offs.shape, dtype=tl.float32)
        for s in tl.static_range(K_SPLITS):
            total += tl.load(out_ptr + s * stride_ks + t * stride_o + offs, mask=mask, other=0.0)
        o = total.to(dtype)
    else:
        o = tl.load(out_ptr + t * stride_o + offs, mask=mask, other=0.0)
    return o


@triton.jit
def _add_rms_norm_kernel(
    hidden_ptr, out_ptr, weight_ptr, new_hidden_ptr, x_ptr, q_ptr, qs_ptr, part_ptr, b_ptr, rows_ptr,
    dense_ptr, out_norm_ptr, eps, R,
    stride_h, stride_o, stride_nh, stride_x, stride_q,
    stride_ps, stride_pt, stride_rows, stride_br, stride_dense,
    H: tl.constexpr, SPLITS: tl.constexpr, HAS_LORA: tl.constexpr, DENSE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr,
    UNIT_OFFSET: tl.constexpr = False, OUT_NORM: tl.constexpr = False, QUANT: tl.constexpr = False,
    K_SPLITS: tl.constexpr = 1, stride_ks=0,
):
    if PDL:  # launched with programmatic dependent launch (kernels/tuning.py: Tuning.pdl)
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may launch, start on its weights
        tl.extra.cuda.gdc_wait()  # before reading what the kernel ahead of this one writes
    # Straight-line code (chunks and splits unrolled, no branches on the row's adapter), so the
    # compiler can issue a row's loads together: its latency is paid about once, not per chunk.
    t = tl.program_id(0).to(tl.int64)
    if HAS_LORA and not DENSE:
        b_rows, r_live = _lora_rows(b_ptr, rows_ptr, t, R, stride_rows, stride_br)
        h = load_sums(part_ptr + t * stride_pt, stride_ps, r_live, SPLITS, BLOCK_R)
    sumsq = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for c0 in tl.static_range(0, H, BLOCK_H):
        offs = c0 + tl.arange(0, BLOCK_H)
        mask = offs < H
        o = _load_output(out_ptr, t, stride_o, stride_ks, offs, mask, K_SPLITS,
                         hidden_ptr.dtype.element_ty)
        if DENSE:  # the delta, expanded beside the matmul: [T, H] float32
            d = tl.load(dense_ptr + t * stride_dense + offs, mask=mask, other=0.0)
            o = (o.to(tl.float32) + d).to(o.dtype)
        elif HAS_LORA:  # rows without an adapter read no B and add zero (exact in float32)
            b = load_b_rows(b_rows, stride_br, offs, mask, r_live, BLOCK_R)
            o = (o.to(tl.float32) + expand_rows(h, b, BLOCK_R)).to(o.dtype)
        if OUT_NORM:  # held in the new row until the output's own norm is known
            tl.store(new_hidden_ptr + t * stride_nh + offs, o, mask=mask)
            of = o.to(tl.float32)
            sumsq += of * of
        else:
            newf = _add_residual(hidden_ptr, new_hidden_ptr, t, offs, mask, o, stride_h, stride_nh)
            sumsq += newf * newf
    if OUT_NORM:  # the output normalised by out_norm, then added to the residual stream
        out_rstd = 1.0 / tl.sqrt(tl.sum(sumsq, axis=0) / H + eps)
        tl.debug_barrier()  # the row's stores above, by every thread, before it is read back
        sumsq = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for c0 in tl.static_range(0, H, BLOCK_H):
            offs = c0 + tl.arange(0, BLOCK_H)
            mask = offs < H
            o = tl.load(new_hidden_ptr + t * stride_nh + offs, mask=mask, other=0.0)
            w = tl.load(out_norm_ptr + offs, mask=mask, other=0.0)
            normed = _weigh(o, out_rstd, w, UNIT_OFFSET).to(o.dtype)
            newf = _add_residual(hidden_ptr, new_hidden_ptr, t, offs, mask, normed, stride_h, stride_nh)
            sumsq += newf * newf
    rstd = 1.0 / tl.sqrt(tl.sum(sumsq, axis=0) / H + eps)
    tl.debug_barrier()  # the row's stores above, by every thread, before it is read back
    _normalise_row(new_hidden_ptr, weight_ptr, x_ptr, q_ptr, qs_ptr, t, rstd, stride_nh, stride_x,
                   stride_q, H, BLOCK_H, False, UNIT_OFFSET, QUANT)


@triton.jit
def _add_rms_norm_split_kernel(
    hidden_ptr, out_ptr, weight_ptr, new_hidden_ptr, x_ptr, q_ptr, qs_ptr, part_ptr, b_ptr, rows_ptr,
    dense_ptr, arrivals_ptr, sums_ptr, eps, R,
    stride_h, stride_o, stride_nh, stride_x, stride_q,
    stride_ps, stride_pt, stride_rows, stride_br, stride_dense, stride_sums,
    H: tl.constexpr, SPLITS: tl.constexpr, HAS_LORA: tl.constexpr, DENSE: tl.constexpr,
    CHUNKS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_CHUNKS: tl.constexpr, NORM_BLOCK: tl.constexpr, EARLY_SUMS: tl.constexpr,
    PDL: tl.constexpr, QUANT: tl.constexpr = False, K_SPLITS: tl.constexpr = 1, stride_ks=0,
):
    """The LoRA add + norm with each row spread over CHUNKS programs of BLOCK_H columns
    (grid: row, chunk): a program expands and adds its columns, stores them and its part of
    the row's sum of squares, and counts itself in; the row's last program adds the parts in
    column order, resets the count and writes the whole row normalised.

    With PDL the program reads its B columns (or the expanded delta) before the wait for the
    kernel ahead (the projection's GEMM), overlapping its weight stream: the row's rank and arena
    rows are a step input, B the arena's weights, and the delta comes from the side stream, joined before
    this launch. EARLY_SUMS: the shrink's sums too, and the delta is computed before the
    wait; not where the GEMM itself writes them (a shrink-only fold,
    LoraDelta.sums_after_wait)."""
    t = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < H
    if PDL:  # launched with programmatic dependent launch (kernels/tuning.py: Tuning.pdl)
        tl.extra.cuda.gdc_launch_dependents()
    d = tl.zeros((BLOCK_H,), dtype=tl.float32)
    if DENSE:  # the delta, expanded beside the matmul: [T, H] float32
        d = tl.load(dense_ptr + t * stride_dense + offs, mask=mask, other=0.0)
        if PDL:
            tl.extra.cuda.gdc_wait()  # before reading the projection's output
    elif HAS_LORA:
        b_rows, r_live = _lora_rows(b_ptr, rows_ptr, t, R, stride_rows, stride_br)
        b = load_b_rows(b_rows, stride_br, offs, mask, r_live, BLOCK_R)
        if PDL and not EARLY_SUMS:
            tl.extra.cuda.gdc_wait()  # the sums are the GEMM's output
        h = load_sums(part_ptr + t * stride_pt, stride_ps, r_live, SPLITS, BLOCK_R)
        d = expand_rows(h, b, BLOCK_R)
        if PDL and EARLY_SUMS:
            tl.extra.cuda.gdc_wait()
    elif PDL:
        tl.extra.cuda.gdc_wait()
    o = _load_output(out_ptr, t, stride_o, stride_ks, offs, mask, K_SPLITS, hidden_ptr.dtype.element_ty)
    o = (o.to(tl.float32) + d).to(o.dtype)
    newf = _add_residual(hidden_ptr, new_hidden_ptr, t, offs, mask, o, stride_h, stride_nh)
    tl.store(sums_ptr + t * stride_sums + chunk, tl.sum(newf * newf, axis=0))
    # Every thread's stores above before the count (a release at GPU scope): the program that
    # sees the full count then sees this program's columns and sums.
    tl.debug_barrier()
    arrived = tl.atomic_add(arrivals_ptr + t, 1, sem="acq_rel", scope="gpu")
    if arrived == CHUNKS - 1:
        tl.atomic_xchg(arrivals_ptr + t, 0, sem="relaxed", scope="gpu")  # zero for the next launch
        offs_c = tl.arange(0, BLOCK_CHUNKS)
        parts = tl.load(sums_ptr + t * stride_sums + offs_c, mask=offs_c < CHUNKS, other=0.0,
                        cache_modifier=".cg")
        rstd = 1.0 / tl.sqrt(tl.sum(parts, axis=0) / H + eps)
        _normalise_row(new_hidden_ptr, weight_ptr, x_ptr, q_ptr, qs_ptr, t, rstd, stride_nh, stride_x,
                       stride_q, H, NORM_BLOCK, True, False, QUANT)


def add_rms_norm_triton(hidden: torch.Tensor, out: torch.Tensor | SplitSums, weight: torch.Tensor,
                        eps: float, delta: LoraDelta | None = None, *,
                        block_h: int | None = None, num_warps: int | None = None,
                        tuning: Tuning = DEFAULT_TUNING, unit_offset: bool = False,
                        out_norm: torch.Tensor | None = None, quantize: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor | Fp8Rows]:
    """As reference.add_rms_norm with delta.dense() (and its unit_offset and out_norm), in
    one launch; quantize: the normalised rows come as Fp8Rows, with their e4m3 copy
    (quantize_rows's, written in the same launch). block_h: columns per unrolled chunk. With a delta the defaults (2048 columns,
    8 warps) were the best of a sweep of its tilings on an H100 (docs/PERFORMANCE.md). A delta
    that carries a ColumnSplit covers each row with programs of split.block columns instead
    (block_h then sizes only the normalising pass), except where the output is normalised
    first. out: the projection's output, or a K-split FP8 GEMM's partials (SplitSums), summed
    here as its sum launch would have."""
    T, H = hidden.shape
    k_splits, stride_ks = 1, 0
    if isinstance(out, SplitSums):
        assert out.dtype == hidden.dtype
        k_splits, stride_ks, out = out.parts.shape[0], out.parts.stride(0), out.parts[0]
    assert out_norm is None or out_norm.is_contiguous()
    assert hidden.stride(1) == 1 and out.stride(1) == 1 and weight.is_contiguous()
    new_hidden = torch.empty_like(hidden)
    x = empty_rows(T, H, dtype=hidden.dtype, device=hidden.device)  # a decode GEMM's x: tma_rows
    if quantize:
        q = empty_rows(T, H, dtype=torch.float8_e4m3fn, device=hidden.device)
        qs = torch.empty(T, dtype=torch.float32, device=hidden.device)
    else:
        q, qs = x, x  # dummy pointers, never written
    normed = Fp8Rows(x, q, qs) if quantize else x
    if T == 0:
        return new_hidden, normed
    dense = delta is not None and delta.expanded is not None
    if dense:
        assert delta.expanded.shape == (T, H) and delta.expanded.stride(1) == 1
    if delta is not None:
        assert len(delta.b) == 1, "one slice: o or down"
        b, part = delta.b[0], delta.partials
        assert b.shape[1] == H and b.stride(1) == 1 and part.stride(3) == 1
        assert delta.token_rows.stride(1) == 1
        R = part.shape[3]
        lora = (part, b, delta.token_rows)
        lora_strides = (part.stride(0), part.stride(2), delta.token_rows.stride(0), b.stride(0))
        splits, default_block = delta.splits, 2048
    else:
        lora = (hidden,) * 3  # dummy pointers, never read
        R, lora_strides, splits, default_block = 1, (0, 0, 0, 0), 0, 2048
    pdl = tuning.pdl_on(hidden)
    dense_args = (delta.expanded if dense else hidden, delta.expanded.stride(0) if dense else 0)
    # W8A8 rows quantized from registers where one chunk holds the row (a row of B rows
    # beside it, a LoRA delta's, would not fit: the row kernel keeps 2048 columns then).
    whole = next_power_of_2(H) if quantize and next_power_of_2(H) <= QUANT_WHOLE_ROW else None
    norm_block = min(block_h or whole or default_block, next_power_of_2(H))
    block_h = min(block_h or (whole if delta is None or dense else None) or default_block,
                  next_power_of_2(H))
    split = delta.column_split if delta is not None else None
    if split is not None and split.block < H and split.fits(T, H) and out_norm is None and not unit_offset:
        chunks = cdiv(H, split.block)
        _add_rms_norm_split_kernel[(T, chunks)](
            hidden, out, weight, new_hidden, x, q, qs, *lora, dense_args[0], split.arrivals, split.sums,
            eps, R, hidden.stride(0), out.stride(0), new_hidden.stride(0), x.stride(0), q.stride(0),
            *lora_strides, dense_args[1], split.sums.stride(0),
            H=H, SPLITS=splits, HAS_LORA=delta is not None, DENSE=dense, CHUNKS=chunks,
            BLOCK_H=split.block, BLOCK_R=next_power_of_2(R),
            BLOCK_CHUNKS=max(2, next_power_of_2(chunks)), NORM_BLOCK=norm_block,
            EARLY_SUMS=not (delta is not None and delta.sums_after_wait),
            PDL=pdl, **pdl_launch(pdl), QUANT=quantize, K_SPLITS=k_splits, stride_ks=stride_ks,
            num_warps=num_warps or 4,
        )
    else:
        _add_rms_norm_kernel[(T,)](
            hidden, out, weight, new_hidden, x, q, qs, *lora, dense_args[0],
            out_norm if out_norm is not None else weight, eps, R,
            hidden.stride(0), out.stride(0), new_hidden.stride(0), x.stride(0), q.stride(0), *lora_strides,
            dense_args[1],
            H=H, SPLITS=splits, HAS_LORA=delta is not None, DENSE=dense,
            BLOCK_H=block_h, BLOCK_R=next_power_of_2(R), PDL=pdl, **pdl_launch(pdl),
            UNIT_OFFSET=unit_offset, OUT_NORM=out_norm is not None, QUANT=quantize,
            K_SPLITS=k_splits, stride_ks=stride_ks,
            num_warps=num_warps or (8 if delta is not None else 4),
        )
    return new_hidden, normed
