"""SiLU(gate) * up with the gate/up LoRA delta expanded in, in one Triton launch.

Programs cover (row, a span of the intermediate columns): each reads its gate and up columns,
expands the row's delta for them from the shrink's partial sums and the adapter's B columns
(kernels/lora_delta.py), or adds the delta already expanded, and writes the activation. Rows
without an adapter skip the B reads.

Given the step's segment table (a decode graph's rows grouped by adapter), programs cover
(segment, span of columns) instead: each reads its adapter's gate and up B columns once and
expands them for all the segment's rows with one small matmul, then row tiles cover the
rows without an adapter. Per row, B goes through L2 once per row; per segment, once per
adapter (at 32 adapters over 64 rows, 32 MB of L2 reads a layer become 16).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._host import cdiv, dot_f32, next_power_of_2, pdl_enabled, pdl_launch

from .lora_delta import LoraDelta


@triton.jit
def _expanded(x, h, b_rows, stride_bn, offs, mask, offs_r, r_live):
    """x (a row's columns `offs` of one slice) plus h @ B[offs].T, rounded once to x's dtype.
    r_live: the rank columns to read, 0 for a row without an adapter (no B read, zero added)."""
    b = tl.load(b_rows + offs[:, None] * stride_bn + offs_r[None, :],
                mask=mask[:, None] & (offs_r[None, :] < r_live), other=0.0)
    return (x.to(tl.float32) + tl.sum(b.to(tl.float32) * h[None, :], axis=1)).to(x.dtype)


@triton.jit
def _silu_mul_kernel(
    gu_ptr, act_ptr, part_ptr, bg_ptr, bu_ptr, slots_ptr, dense_ptr,
    I, R,
    stride_gu, stride_act, stride_ps, stride_pslice, stride_pt,
    stride_bgs, stride_bgn, stride_bus, stride_bun, stride_dense,
    SPLITS: tl.constexpr, HAS_LORA: tl.constexpr, DENSE: tl.constexpr, BLOCK_I: tl.constexpr,
    BLOCK_R: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # launched with programmatic dependent launch (kernels/_host.py: pdl_enabled)
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may launch, start on its weights
        tl.extra.cuda.gdc_wait()  # before reading what the kernel ahead of this one writes
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = offs < I
    g = tl.load(gu_ptr + t * stride_gu + offs, mask=mask, other=0.0)
    u = tl.load(gu_ptr + t * stride_gu + I + offs, mask=mask, other=0.0)
    if DENSE:  # the delta, expanded beside the matmul: [T, 2I] float32
        dg = tl.load(dense_ptr + t * stride_dense + offs, mask=mask, other=0.0)
        du = tl.load(dense_ptr + t * stride_dense + I + offs, mask=mask, other=0.0)
        g = (g.to(tl.float32) + dg).to(g.dtype)
        u = (u.to(tl.float32) + du).to(u.dtype)
    elif HAS_LORA:  # straight-line: the row's loads go out together
        offs_r = tl.arange(0, BLOCK_R)
        slot = tl.load(slots_ptr + t)
        safe = tl.maximum(slot, 0).to(tl.int64)
        h_g = tl.zeros((BLOCK_R,), dtype=tl.float32)
        h_u = tl.zeros((BLOCK_R,), dtype=tl.float32)
        part_row = part_ptr + t * stride_pt + offs_r
        for s in tl.static_range(SPLITS):
            h_g += tl.load(part_row + s * stride_ps, mask=offs_r < R, other=0.0)
            h_u += tl.load(part_row + s * stride_ps + stride_pslice, mask=offs_r < R, other=0.0)
        r_live = tl.where(slot >= 0, R, 0)
        g = _expanded(g, h_g, bg_ptr + safe * stride_bgs, stride_bgn, offs, mask, offs_r, r_live)
        u = _expanded(u, h_u, bu_ptr + safe * stride_bus, stride_bun, offs, mask, offs_r, r_live)
    gf = g.to(tl.float32)
    silu = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # rounded as F.silu rounds
    act = silu.to(tl.float32) * u.to(tl.float32)
    tl.store(act_ptr + t * stride_act + offs, act.to(act_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_rows(gu_ptr, act_ptr, rows, row_mask, offs, mask, dg, du, I, stride_gu,
                   stride_act):
    """SiLU(gate + dg) * (up + du) for a tile of rows x columns `offs`, stored."""
    tile = row_mask[:, None] & mask[None, :]
    gu_rows = gu_ptr + rows[:, None] * stride_gu + offs[None, :]
    g = tl.load(gu_rows, mask=tile, other=0.0)
    u = tl.load(gu_rows + I, mask=tile, other=0.0)
    g = (g.to(tl.float32) + dg).to(g.dtype)
    u = (u.to(tl.float32) + du).to(u.dtype)
    gf = g.to(tl.float32)
    silu = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # rounded as F.silu rounds
    act = silu.to(tl.float32) * u.to(tl.float32)
    tl.store(act_ptr + rows[:, None] * stride_act + offs[None, :],
             act.to(act_ptr.dtype.element_ty), mask=tile)


@triton.jit
def _segment_delta(h_rows, b_cols, rows_live, r_mask, stride_ps, SPLITS: tl.constexpr,
                   DOT_F32: tl.constexpr):
    """[rows, columns] float32 delta of a segment's row tile on one slice: its shrink sums
    (split partials added) times the B columns read once for the tile (`b_cols`,
    [rank, columns]). TF32x3 on tensor cores keeps float32 accuracy (B is bf16, exact in
    TF32's high part); the interpreter multiplies in plain float32."""
    h = tl.zeros(h_rows.shape, dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        h += tl.load(h_rows + s * stride_ps, mask=rows_live[:, None] & r_mask[None, :], other=0.0)
    if DOT_F32:
        return tl.dot(h, b_cols.to(tl.float32), input_precision="ieee")
    return tl.dot(h, b_cols.to(tl.float32), input_precision="tf32x3")


@triton.jit(do_not_specialize=["T", "N_SEG"])  # batch and bucket sizes: no variant per graph
def _silu_mul_segments_kernel(
    gu_ptr, act_ptr, part_ptr, bg_ptr, bu_ptr, slots_ptr, table_ptr,
    T, I, R, N_SEG,
    stride_gu, stride_act, stride_ps, stride_pslice, stride_pt,
    stride_bgs, stride_bgn, stride_bus, stride_bun, stride_table,
    SPLITS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_R: tl.constexpr,
    DOT_F32: tl.constexpr, PDL: tl.constexpr,
):
    """Programs (segment or row tile, column span): the first N_SEG expand one segment's
    rows, the rest cover BLOCK_T batch rows each, acting on those without an adapter."""
    pid = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = offs < I
    offs_t = tl.arange(0, BLOCK_T)
    if pid < N_SEG:
        row = table_ptr + pid * stride_table
        slot = tl.load(row).to(tl.int64)
        first = tl.load(row + 1)
        length = tl.load(row + 2)
        offs_r = tl.arange(0, BLOCK_R)
        r_mask = offs_r < R
        r_live = tl.where(length > 0, R, 0)  # padding segments read no B
        b_mask = (offs_r[:, None] < r_live) & mask[None, :]
        bg = tl.load(bg_ptr + slot * stride_bgs + offs[None, :] * stride_bgn + offs_r[:, None],
                     mask=b_mask, other=0.0)
        bu = tl.load(bu_ptr + slot * stride_bus + offs[None, :] * stride_bun + offs_r[:, None],
                     mask=b_mask, other=0.0)
        if PDL:  # B and the shrink's sums are not the GEMM's output; gate_up is
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        for r0 in range(0, length, BLOCK_T):
            live = (r0 + offs_t) < length
            rows = (first + r0 + offs_t).to(tl.int64)
            h_rows = part_ptr + rows[:, None] * stride_pt + offs_r[None, :]
            dg = _segment_delta(h_rows, bg, live, r_mask, stride_ps, SPLITS, DOT_F32)
            du = _segment_delta(h_rows + stride_pslice, bu, live, r_mask, stride_ps, SPLITS,
                                DOT_F32)
            _silu_mul_rows(gu_ptr, act_ptr, rows, live, offs, mask, dg, du, I, stride_gu,
                           stride_act)
    else:
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        rows = (pid - N_SEG) * BLOCK_T + offs_t
        in_batch = rows < T
        base = in_batch & (tl.load(slots_ptr + rows, mask=in_batch, other=0) < 0)
        if tl.max(base.to(tl.int32), axis=0) > 0:
            zero = tl.zeros((BLOCK_T, BLOCK_I), dtype=tl.float32)
            _silu_mul_rows(gu_ptr, act_ptr, rows.to(tl.int64), base, offs, mask, zero, zero, I,
                           stride_gu, stride_act)


def silu_mul_triton(gate_up: torch.Tensor, delta: LoraDelta | None = None, *,
                    block_i: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """As silu_mul_ref.silu_mul with delta.dense(), in one launch. block_i: columns per
    program. With a delta the defaults (512 columns, 2 warps) are the sweep's best for 32
    adapters on an H100 at batch 64: 11.6 -> 10.4 us against 256 columns and 4 warps
    (bench/decode_kernels_sweep.py --parts fused)."""
    T, two_i = gate_up.shape
    I = two_i // 2
    assert gate_up.stride(1) == 1
    act = torch.empty(T, I, dtype=gate_up.dtype, device=gate_up.device)
    if T == 0:
        return act
    dense = delta is not None and delta.expanded is not None
    if dense:
        assert delta.expanded.shape == (T, two_i) and delta.expanded.stride(1) == 1
    if delta is not None:
        assert len(delta.b) == 2, "two slices: gate and up"
        bg, bu = delta.b
        part = delta.partials
        assert bg.shape[1] == I and bu.shape[1] == I and bg.stride(2) == 1 and bu.stride(2) == 1
        assert part.stride(3) == 1
        lora = (part, bg, bu, delta.token_slots)
        lora_strides = (part.stride(0), part.stride(1), part.stride(2), bg.stride(0), bg.stride(1),
                        bu.stride(0), bu.stride(1))
        R, splits, default_block = part.shape[3], delta.splits, 1024 if dense else 512
    else:
        lora = (gate_up,) * 4  # dummy pointers, never read
        lora_strides, R, splits, default_block = (0,) * 7, 1, 0, 1024
    block_i = min(block_i or default_block, next_power_of_2(I))
    default_warps = 2 if delta is not None and not dense else 4
    pdl = pdl_enabled(gate_up)
    if delta is not None and not dense and delta.segment_table is not None:
        return _silu_mul_segments(gate_up, act, delta, I, block_i, num_warps, pdl)
    _silu_mul_kernel[(T, cdiv(I, block_i))](
        gate_up, act, *lora, delta.expanded if dense else gate_up, I, R, gate_up.stride(0),
        act.stride(0), *lora_strides, delta.expanded.stride(0) if dense else 0,
        SPLITS=splits, HAS_LORA=delta is not None, DENSE=dense, BLOCK_I=block_i,
        BLOCK_R=max(16, next_power_of_2(R)), PDL=pdl, **pdl_launch(pdl),
        num_warps=num_warps or default_warps,
    )
    return act


SEGMENT_ROWS = 16  # rows of a segment's tile: tl.dot's smallest M


def _silu_mul_segments(gate_up: torch.Tensor, act: torch.Tensor, delta: LoraDelta, I: int,
                       block_i: int, num_warps: int | None, pdl: bool) -> torch.Tensor:
    """The segment-table launch (see _silu_mul_segments_kernel): programs for each table row
    and for each SEGMENT_ROWS batch rows, times the column spans."""
    T = gate_up.shape[0]
    bg, bu = delta.b
    part, table = delta.partials, delta.segment_table
    assert table.stride(1) == 1 and table.shape[1] >= 3
    n_seg = table.shape[0]
    _silu_mul_segments_kernel[(n_seg + cdiv(T, SEGMENT_ROWS), cdiv(I, block_i))](
        gate_up, act, part, bg, bu, delta.token_slots, table, T, I, part.shape[3], n_seg,
        gate_up.stride(0), act.stride(0), part.stride(0), part.stride(1), part.stride(2),
        bg.stride(0), bg.stride(1), bu.stride(0), bu.stride(1), table.stride(0),
        SPLITS=delta.splits, BLOCK_T=SEGMENT_ROWS, BLOCK_I=block_i,
        BLOCK_R=max(16, next_power_of_2(part.shape[3])),
        DOT_F32=dot_f32(gate_up.dtype, gate_up.device), PDL=pdl, **pdl_launch(pdl),
        num_warps=num_warps or 4,
    )
    return act
