"""Multi-LoRA shrink/expand as Triton kernels: one launch per call for all adapters and slices.

Grid: (row ranges of a segment, segment, slice x (H_in splits | output tiles)). Segments are
the groups of tokens sharing an adapter slot (LoraBatchMeta), so every program reads a single
slot's A/B tile and the launch is sized from host integers only (no device sync).

Decode shapes set the design: a segment holds one or two rows, so rows are tiled by 16 and a
program walks all of its segment's rows; the shrink splits H_in across programs to fill the
GPU and writes each split's partial sum, which the expand adds while loading (no zero fill,
no atomics); ranks are per slice, so a slice an adapter does not target costs a program that
exits at once.

A and B live in arenas of rank rows (kernels/lora/rows.py): a program finds its slot's rows
from the slot's (rank, first row) on its slice, read beside the slot, and reads no row past
the rank.

The slices of a fused projection (q/k/v, gate/up) are separate tensors. The kernel gets the
first one as its pointer argument and, per slice, the element offset of the others from it
(a small cached int64 table): plain pointer arithmetic, which behaves the same on the GPU and
in Triton's interpreter, and keeps 16-element alignment known to the compiler when it holds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import triton
import triton.language as tl

from ..host import cdiv, dot_f32, next_power_of_2, num_sms

from .meta import MAX_SPLIT_K, LoraBatchMeta
from .rows import SlotRows

_TABLE_CACHE: dict[tuple, torch.Tensor] = {}
_TABLE_CACHE_MAX = 1024


@triton.jit
def _segment(seg, slice_id, R, seg_table_ptr, stride_seg, rank_col,
             seg_slots_ptr, seg_starts_ptr, seg_lens_ptr, ranks_ptr, rows_ptr, stride_slots_slice,
             PACKED: tl.constexpr):
    """(slot, start, length, rank on this slice, first arena row on this slice) of a segment.
    PACKED: one row of the segment table holds them all (start is then the segment's first
    batch row), so they arrive after one memory latency; otherwise slot -> (rank, row) is a
    chain of two."""
    if PACKED:
        row = seg_table_ptr + seg * stride_seg
        slot = tl.load(row)
        start = tl.load(row + 1)
        seg_len = tl.load(row + 2)
        rank = tl.minimum(tl.load(row + rank_col + 2 * slice_id), R)
        first = tl.load(row + rank_col + 2 * slice_id + 1)
    else:
        slot = tl.load(seg_slots_ptr + seg)
        start = tl.load(seg_starts_ptr + seg)
        seg_len = tl.load(seg_lens_ptr + seg)
        rank = tl.minimum(tl.load(ranks_ptr + slice_id * stride_slots_slice + slot), R)
        first = tl.load(rows_ptr + slice_id * stride_slots_slice + slot)
    return slot, start, seg_len, rank, first


@triton.jit
def _segment_rows(sorted_ids_ptr, start, offs_m, mask_m, PACKED: tl.constexpr):
    """Batch rows of a segment's tiles: a contiguous run (PACKED), else gathered."""
    if PACKED:
        tok = (start + offs_m).to(tl.int64)
    else:
        tok = tl.load(sorted_ids_ptr + start + offs_m, mask=mask_m, other=0).to(tl.int64)
    return tok


# Triton compiles a new variant of a kernel for each new "specialisation" of its integer
# arguments (== 1, divisible by 16). Those that follow a step's batch composition (rows per
# segment, splits of H_in, output programs) would then compile mid-serving, under Poisson
# arrivals, for seconds each while every request waits; they are left unspecialised, so a
# kernel's variants are only its constexpr tilings, which a warm-up covers.
_SHRINK_DYNAMIC = ["ROWS", "SPLIT_K"]
_EXPAND_DYNAMIC = ["N_PROGRAMS", "ROWS", "SPLIT_K"]


@triton.jit(do_not_specialize=_SHRINK_DYNAMIC)
def _lora_shrink_kernel(
    x_ptr, a_ptr, table_ptr, out_ptr, scaling_ptr, ranks_ptr, rows_ptr,
    sorted_ids_ptr, seg_slots_ptr, seg_starts_ptr, seg_lens_ptr, seg_table_ptr,
    K, R, ROWS, K_PER_SPLIT, SPLIT_K, stride_seg, rank_col,
    stride_xt, stride_xk,
    stride_ar, stride_ak,
    stride_ok, stride_os, stride_ot, stride_or,
    stride_slots_slice,
    OFF_UNIT: tl.constexpr, PACKED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    # Program: rows [pid_m*ROWS, +ROWS) of one segment (in BLOCK_M tiles), one slice, one
    # K range; writes its partial sum to out[split] (no atomics: the expand adds the splits).
    pid_m = tl.program_id(0)
    seg = tl.program_id(1)
    pid_2 = tl.program_id(2)
    slice_id = pid_2 // SPLIT_K
    split = pid_2 % SPLIT_K

    slot, seg_start, seg_len, rank, first = _segment(
        seg, slice_id, R, seg_table_ptr, stride_seg, rank_col, seg_slots_ptr, seg_starts_ptr,
        seg_lens_ptr, ranks_ptr, rows_ptr, stride_slots_slice, PACKED)
    row0 = pid_m * ROWS
    if row0 >= seg_len:
        return
    row_end = tl.minimum(seg_len, row0 + ROWS)
    k_lo = split * K_PER_SPLIT
    # Rank 0 (a slice the adapter leaves alone): no A is read and the rows get zeros, as do
    # the columns past a rank, so an op expanding these sums needs no ranks (lora_delta.py).
    k_hi = tl.where(rank > 0, tl.minimum(K, k_lo + K_PER_SPLIT), k_lo)
    scale = tl.load(scaling_ptr + slot).to(tl.float32)

    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < rank
    a_off = tl.load(table_ptr + slice_id) * OFF_UNIT
    a_cols = a_ptr + a_off + (first.to(tl.int64) + offs_r[None, :]) * stride_ar
    out_base = out_ptr + split.to(tl.int64) * stride_ok + slice_id.to(tl.int64) * stride_os

    for m0 in range(row0, row_end, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < row_end
        tok = _segment_rows(sorted_ids_ptr, seg_start, offs_m, mask_m, PACKED)
        x_rows = x_ptr + tok[:, None] * stride_xt
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):  # may be empty: the split still stores zeros
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < k_hi
            xt = tl.load(x_rows + offs_k[None, :] * stride_xk,
                         mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            at = tl.load(a_cols + offs_k[:, None] * stride_ak,
                         mask=mask_k[:, None] & mask_r[None, :], other=0.0)  # [BLOCK_K, BLOCK_R]
            if DOT_F32:
                acc += tl.dot(xt.to(tl.float32), at.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(xt, at.to(xt.dtype))
        out_ptrs = out_base + tok[:, None] * stride_ot + offs_r[None, :] * stride_or
        tl.store(out_ptrs, acc * scale, mask=mask_m[:, None] & (offs_r < R)[None, :])


@triton.jit(do_not_specialize=_EXPAND_DYNAMIC)
def _lora_expand_kernel(
    h_ptr, b_ptr, table_ptr, y_ptr, ranks_ptr, rows_ptr,
    sorted_ids_ptr, seg_slots_ptr, seg_starts_ptr, seg_lens_ptr, seg_table_ptr,
    R, N_PROGRAMS, N_SPAN, ROWS, SPLIT_K, stride_seg, rank_col,
    stride_hk, stride_hs, stride_ht, stride_hr,
    stride_bn,
    stride_yt, stride_yn,
    stride_slots_slice,
    OFF_UNIT: tl.constexpr, PACKED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    DOT_F32: tl.constexpr, ACCUMULATE: tl.constexpr,
):
    # Program: columns [pid_n*N_SPAN, +N_SPAN) of one slice (in BLOCK_N tiles) for rows
    # [pid_m*ROWS, +ROWS) of one segment (in BLOCK_M tiles). A program's fixed cost is a chain
    # of dependent loads (segment -> slot -> rank, tokens -> h); spanning several N tiles
    # spreads it over more bytes of B. B tiles hold the whole rank (BLOCK_R >= R).
    pid_m = tl.program_id(0)
    seg = tl.program_id(1)
    pid_2 = tl.program_id(2)
    slice_id = pid_2 // N_PROGRAMS
    pid_n = pid_2 % N_PROGRAMS

    # Per-slice row of the table: offset of B_i from b_ptr, out_i, column in y, B_i's row stride.
    row = table_ptr + slice_id * 4
    b_off = tl.load(row) * OFF_UNIT
    n_out = tl.load(row + 1)
    y_col = tl.load(row + 2)
    stride_br = tl.load(row + 3)

    slot, seg_start, seg_len, rank, first = _segment(
        seg, slice_id, R, seg_table_ptr, stride_seg, rank_col, seg_slots_ptr, seg_starts_ptr,
        seg_lens_ptr, ranks_ptr, rows_ptr, stride_slots_slice, PACKED)
    row0 = pid_m * ROWS
    n_begin = pid_n * N_SPAN
    if (row0 >= seg_len) | (n_begin >= n_out) | (rank <= 0):
        return  # rank 0: a zero delta, y is left untouched (also when writing, not adding)
    row_end = tl.minimum(seg_len, row0 + ROWS)
    n_end = tl.minimum(n_out, n_begin + N_SPAN)

    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < rank
    b_rows = b_ptr + b_off + (first.to(tl.int64) + offs_r[:, None]) * stride_br
    h_base = h_ptr + slice_id.to(tl.int64) * stride_hs

    for m0 in range(row0, row_end, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < row_end
        tok = _segment_rows(sorted_ids_ptr, seg_start, offs_m, mask_m, PACKED)
        h_ptrs = h_base + tok[:, None] * stride_ht + offs_r[None, :] * stride_hr
        h_mask = mask_m[:, None] & mask_r[None, :]
        ht = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for split in range(SPLIT_K):  # the shrink's partial sums over H_in
            ht += tl.load(h_ptrs + split * stride_hk, mask=h_mask, other=0.0)
        y_rows = y_ptr + tok[:, None] * stride_yt
        for n0 in range(n_begin, n_end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < n_end
            bt = tl.load(b_rows + offs_n[None, :].to(tl.int64) * stride_bn,
                         mask=mask_r[:, None] & mask_n[None, :], other=0.0)  # [BLOCK_R, BLOCK_N]
            if DOT_F32:
                acc = tl.dot(ht, bt.to(tl.float32), input_precision="ieee")
            else:
                acc = tl.dot(ht.to(bt.dtype), bt)
            y_ptrs = y_rows + (y_col + offs_n)[None, :].to(tl.int64) * stride_yn
            y_mask = mask_m[:, None] & mask_n[None, :]
            if ACCUMULATE:
                acc += tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)


@dataclass(frozen=True)
class LoraTiling:
    """How the shrink and expand launches tile a step (inference_node/tuner/lora_sweep.py sweeps these).

    Rows are tiled by `block_m`. With `per_segment`, one program walks all of its segment's
    row tiles (in a CUDA graph every segment is sized for the whole batch, yet a decode
    segment holds a row or two: one program, one tile, and each B tile read once); without
    it, each row tile is its own program and those past a segment's real rows exit at once.
    The shrink splits H_in in `block_k` tiles over enough programs to put about
    `programs_per_sm` on each SM; the expand covers the outputs in `block_n` tiles."""

    block_m: int
    per_segment: bool
    block_k: int
    block_n: int
    programs_per_sm: int = 4
    shrink_warps: int = 2
    expand_warps: int = 4
    n_span: int = 0  # expand columns per program (a multiple of block_n); 0: block_n

    def rows(self, meta: LoraBatchMeta) -> int:
        return max(1, meta.max_segment_len) if self.per_segment else self.block_m

    def grid_m(self, meta: LoraBatchMeta) -> int:
        return cdiv(max(1, meta.max_segment_len), self.rows(meta))


DECODE_SHAPED_TOKENS = 256  # steps up to this many LoRA tokens are decode-shaped


def choose_tiling(meta: LoraBatchMeta, rank: int, max_out: int = 0, n_slices: int = 1,
                  device: torch.device | None = None) -> LoraTiling:
    """Defaults from the LoRA tiling sweep (inference_node/tuner/lora_sweep.py) on an H100 (Llama-3.2-1B shapes, batch 64, rank 16).

    Decode-shaped steps (few rows per adapter) take 16-row tiles; prefill up to 64. With a
    row or two per segment, an expand program's fixed cost (its chain of dependent loads)
    dominates unless it covers many columns, yet too few programs leave SMs idle: each
    program spans the most columns (up to 2048) that still leave about 3 programs per SM."""
    block_r = max(16, next_power_of_2(rank))
    block_k = 64 if block_r <= 128 else 32
    block_n = 128 if block_r <= 32 else 64 if block_r <= 64 else 32
    longest = max(1, meta.max_segment_len)
    if meta.num_active_tokens <= DECODE_SHAPED_TOKENS:
        per_segment = meta.num_active_tokens / max(1, meta.num_segments) <= 16
        n_span = block_n
        if per_segment and max_out:
            target = 3 * num_sms(device or torch.device("cpu"))
            while (n_span * 2 <= 2048 and
                   meta.num_segments * n_slices * cdiv(max_out, n_span * 2) >= target):
                n_span *= 2
        return LoraTiling(16, per_segment, block_k=block_k, block_n=block_n, n_span=n_span)
    block_m = 16 if longest <= 16 else 32 if longest <= 32 else 64
    return LoraTiling(block_m, per_segment=False, block_k=block_k, block_n=block_n,
                      shrink_warps=4)


def _offset_table(tensors: Sequence[torch.Tensor], extra: Sequence[Sequence[int]],
                  device: torch.device) -> tuple[torch.Tensor, int]:
    """Device int64 table: row i = (offset of tensors[i] from tensors[0] in OFF_UNIT elements,
    *extra[i]). Cached by addresses/sizes: the slot buffers live as long as the engine."""
    base = tensors[0].data_ptr()
    esize = tensors[0].element_size()
    deltas = [t.data_ptr() - base for t in tensors]
    unit = 16 if all(d % (16 * esize) == 0 for d in deltas) else 1
    rows = tuple((d // (esize * unit), *e) for d, e in zip(deltas, extra))
    key = (device, base, esize, unit, rows)
    table = _TABLE_CACHE.get(key)
    if table is None:
        if len(_TABLE_CACHE) >= _TABLE_CACHE_MAX:
            _TABLE_CACHE.clear()
        table = torch.tensor(rows, dtype=torch.int64, device=device).reshape(-1)
        _TABLE_CACHE[key] = table
    return table, unit


def _uniform(tensors: Sequence[torch.Tensor], dims: Sequence[int]) -> list[torch.Tensor]:
    """Same dtype and same strides on `dims` for all slices (made contiguous if not)."""
    ref = tensors[0]
    ok = all(t.dtype == ref.dtype and all(t.stride(d) == ref.stride(d) for d in dims)
             for t in tensors)
    if ok:
        return list(tensors)
    dtype = ref.dtype
    return [t.to(dtype).contiguous() for t in tensors]


def _slots_arg(slots: SlotRows, n_slices: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(ranks, first rows, stride between slices): [n_slices, S] tables sharing one stride
    (stride 0 where every slice has the same, SlotRows.shared)."""
    ranks, rows = slots.ranks, slots.rows
    assert ranks.shape[0] == n_slices and rows.shape[0] == n_slices, \
        f"slot rows for {ranks.shape[0]} slices, {n_slices} given"
    if ranks.stride() != rows.stride() or ranks.stride(1) != 1:
        ranks, rows = ranks.contiguous(), rows.contiguous()
    return ranks, rows, ranks.stride(0)


def _packed_args(meta: LoraBatchMeta, rank_col: int | None, fallback: torch.Tensor
                 ) -> tuple[torch.Tensor, int, int, bool]:
    """(segment table, its row stride, the column of the first slice's rank, packed?). The
    packed path needs the step's segment table (rows grouped by slot) and where this
    projection's ranks sit in it; otherwise the segment vectors and the rank table serve."""
    table = meta.segment_table
    if table is None or rank_col is None:
        return fallback, 0, 0, False  # a dummy pointer, never read (PACKED=False)
    assert table.shape[0] >= meta.num_segments, "the segment table is shorter than the segments"
    return table, table.stride(0), rank_col, True


def _split_k(meta: LoraBatchMeta, n_slices: int, k_tiles: int, m_programs: int,
             per_sm: int, device: torch.device) -> int:
    """Splits of H_in so a launch puts about `per_sm` programs on each SM, at most 16."""
    programs = max(1, m_programs * meta.num_segments * n_slices)
    return max(1, min(MAX_SPLIT_K, k_tiles, cdiv(per_sm * num_sms(device), programs)))


def lora_shrink_partials(x: torch.Tensor, a_stacked: Sequence[torch.Tensor], meta: LoraBatchMeta,
                         scaling: torch.Tensor, slots: SlotRows, *,
                         split_k: int | None = None, zero: bool = True,
                         tiling: LoraTiling | None = None,
                         workspace: torch.Tensor | None = None,
                         rank_col: int | None = None) -> torch.Tensor:
    """[split_k, n_slices, T, R] float32 partial sums of x @ A_i[slot's rows].T * scaling[slot]
    over ranges of H_in (a_stacked: per slice [arena rows, H_in]; R = slots.max_rank); zero
    past a slot's rank on the slice. zero=False leaves rows of slot -1 uninitialised:
    lora_expand_triton never reads them. `workspace` (flat float32, at least
    kernels.lora.lora_workspace_numel elements) holds them instead of a new allocation: a
    static buffer for work that runs on a side stream inside a CUDA graph. `rank_col`: where
    slice 0's (rank, first row) sits in meta.segment_table, whose rows then give each
    segment's slot, rows and arena runs."""
    n_slices = len(a_stacked)
    T, K = x.shape
    R = slots.max_rank
    rows, K_a = a_stacked[0].shape
    assert K_a == K, f"A has in-features {K_a}, x has {K}"
    assert all(a.shape == (rows, K) for a in a_stacked), "A slices must share [rows, H_in]"
    tiling = tiling or choose_tiling(meta, R)
    block_r = max(16, next_power_of_2(R))
    block_k = min(tiling.block_k, max(16, next_power_of_2(K)))
    k_tiles = cdiv(K, block_k)
    m_programs = tiling.grid_m(meta)
    if split_k is None:
        split_k = _split_k(meta, n_slices, k_tiles, m_programs, tiling.programs_per_sm, x.device)
    split_k = max(1, min(split_k, k_tiles))
    shape = (split_k, n_slices, T, R)
    if workspace is not None:
        numel = split_k * n_slices * T * R
        assert workspace.dtype == torch.float32 and workspace.numel() >= numel, \
            f"the LoRA workspace holds {workspace.numel()} floats, this call needs {numel}"
        out = workspace[:numel].view(shape)
        if zero:
            out.zero_()
    else:
        out = (torch.zeros if zero else torch.empty)(shape, dtype=torch.float32, device=x.device)
    if meta.num_segments == 0 or T == 0 or R == 0:
        return out
    a_list = _uniform(a_stacked, (0, 1))
    table, unit = _offset_table(a_list, [()] * n_slices, x.device)
    ranks, firsts, slots_stride = _slots_arg(slots, n_slices)
    seg_table, stride_seg, col, packed = _packed_args(meta, rank_col, meta.segment_lens)
    k_per_split = cdiv(k_tiles, split_k) * block_k
    grid = (m_programs, meta.num_segments, n_slices * split_k)
    _lora_shrink_kernel[grid](
        x, a_list[0], table, out, scaling, ranks, firsts,
        meta.sorted_token_ids, meta.segment_slots, meta.segment_starts, meta.segment_lens,
        seg_table, K, R, tiling.rows(meta), k_per_split, split_k, stride_seg, col,
        *x.stride(), *a_list[0].stride(), *out.stride(), slots_stride,
        OFF_UNIT=unit, PACKED=packed,
        BLOCK_M=tiling.block_m, BLOCK_R=block_r, BLOCK_K=block_k,
        DOT_F32=dot_f32(x.dtype, x.device), num_warps=tiling.shrink_warps,
    )
    return out


def lora_shrink_triton(x: torch.Tensor, a_stacked: Sequence[torch.Tensor], meta: LoraBatchMeta,
                       scaling: torch.Tensor, slots: SlotRows, *,
                       split_k: int | None = None) -> torch.Tensor:
    """[n_slices, T, R] float32 = x @ A_i[slot's rows].T * scaling[slot]; rows of slot -1 are zero."""
    partials = lora_shrink_partials(x, a_stacked, meta, scaling, slots, split_k=split_k)
    return partials[0] if partials.shape[0] == 1 else partials.sum(0)


def lora_expand_triton(h: torch.Tensor, b_stacked: Sequence[torch.Tensor], meta: LoraBatchMeta,
                       y: torch.Tensor, slice_offsets: Sequence[int], slots: SlotRows, *,
                       tiling: LoraTiling | None = None, accumulate: bool = True,
                       rank_col: int | None = None) -> None:
    """y[t, off_i:off_i+out_i] += h[i, t] @ B_i[slot_t's rows] in place (b_stacked: per slice
    [arena rows, out_i]); slot -1 rows untouched. h is [n_slices, T, R], or [splits,
    n_slices, T, R] partial sums (lora_shrink_partials). accumulate=False writes the delta
    instead of adding it (y is then a delta buffer): the (row, slice) pairs written depend
    only on the metadata and the ranks, so a buffer zeroed once per step stays zero
    everywhere else however many layers write it."""
    n_slices = len(b_stacked)
    if h.dim() == 3:
        h = h.unsqueeze(0)
    assert h.shape[1] >= n_slices and len(slice_offsets) == n_slices
    splits, T, R = h.shape[0], h.shape[2], h.shape[3]
    if meta.num_segments == 0 or T == 0 or R == 0:
        return
    assert R == slots.max_rank, f"h has rank {R}, the slots {slots.max_rank}"
    rows = b_stacked[0].shape[0]
    for b, off in zip(b_stacked, slice_offsets):
        assert b.shape[0] == rows, "B slices must share the arena's rows"
        assert 0 <= off and off + b.shape[1] <= y.shape[1], "slice outside y's columns"
    b_list = _uniform(b_stacked, (1,))
    extra = [(b.shape[1], off, b.stride(0)) for b, off in zip(b_list, slice_offsets)]
    table, unit = _offset_table(b_list, extra, y.device)

    max_out = max(b.shape[1] for b in b_list)
    tiling = tiling or choose_tiling(meta, R, max_out, n_slices, y.device)
    block_r = max(16, next_power_of_2(R))  # the whole rank in one tile
    block_n = tiling.block_n
    n_span = max(block_n, cdiv(tiling.n_span, block_n) * block_n)
    n_programs = cdiv(max_out, n_span)
    ranks, firsts, slots_stride = _slots_arg(slots, n_slices)
    seg_table, stride_seg, col, packed = _packed_args(meta, rank_col, meta.segment_lens)
    grid = (tiling.grid_m(meta), meta.num_segments, n_slices * n_programs)
    _lora_expand_kernel[grid](
        h, b_list[0], table, y, ranks, firsts,
        meta.sorted_token_ids, meta.segment_slots, meta.segment_starts, meta.segment_lens,
        seg_table, R, n_programs, n_span, tiling.rows(meta), splits, stride_seg, col,
        *h.stride(), b_list[0].stride(1), *y.stride(), slots_stride,
        OFF_UNIT=unit, PACKED=packed,
        BLOCK_M=tiling.block_m, BLOCK_N=block_n, BLOCK_R=block_r,
        DOT_F32=dot_f32(b_list[0].dtype, y.device), ACCUMULATE=accumulate,
        num_warps=tiling.expand_warps,
    )


def add_lora_triton(x: torch.Tensor, y: torch.Tensor, a_stacked: Sequence[torch.Tensor],
                    b_stacked: Sequence[torch.Tensor], meta: LoraBatchMeta, scaling: torch.Tensor,
                    slice_offsets: Sequence[int], slots: SlotRows, *,
                    accumulate: bool = True, workspace: torch.Tensor | None = None,
                    rank_col: int | None = None) -> None:
    """y += every token's LoRA delta in two launches: the shrink's split partials go straight
    to the expand, which adds them (no zero fill, no atomics, no reduction launch).
    accumulate=False: y receives the delta itself (see lora_expand_triton). rank_col: read
    segments, ranks and rows from meta.segment_table (see lora_shrink_partials)."""
    tiling = choose_tiling(meta, slots.max_rank, max(b.shape[1] for b in b_stacked),
                           len(b_stacked), y.device)
    partials = lora_shrink_partials(x, a_stacked, meta, scaling, slots, zero=False,
                                    tiling=tiling, workspace=workspace, rank_col=rank_col)
    lora_expand_triton(partials, b_stacked, meta, y, slice_offsets, slots, tiling=tiling,
                       accumulate=accumulate, rank_col=rank_col)
