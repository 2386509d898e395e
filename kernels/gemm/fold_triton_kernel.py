"""x @ W + every row's LoRA delta in one launch: the decode GEMM with the adapters' A and B
streamed as part of it (fold.py says why).

One grid, two kinds of program. The first `segments x slices` programs to start shrink: each
computes x @ A_i[slot].T for one (segment, slice) over the whole K, scales it and stores the
rows of its segment into a small float32 workspace `xa`. The other programs each own a
[rows, BLOCK_N] tile of y, as in decode_gemm_triton. Each first reads, for every row, its
adapter's B over the tile's columns into registers (that depends only on the step's rows,
not on the kernel before, so it overlaps that kernel and the weight stream), streams its
slab of W, waits until every shrink program has stored its rows, and adds

    acc[m, :] += xa[m, slice's R columns] @ B[slot_m][columns].T

a few FMAs a row: the tail after the matmul is one wait and one read of xa. (A K loop over
the step's segments instead, each adapter's B read once per tile by a tensor-core dot, was
measured slower: its steps, each a dependent read, made a longer tail.)

With GemmLora.expand False the launch only shrinks beside the matmul: the tiles are plain
GEMM tiles (no B, no wait), each program's id is its role, and the op after the matmul
expands the stored rows (GemmLora.unexpanded). With GemmLora.shrink_splits the shrink has no
programs of its own: it is cut into units of (segment, slice, K range), one a tile program,
which reads its unit's A columns beside W over that K range and multiplies the x tiles it
holds anyway, storing the unit's partial sum for the op after the matmul to add. A shrink
program over a whole K reads all of x and one adapter's A on one SM: for down (K = 14,336)
that took longer than the matmul's tiles, and the tiles after it waited for its SM.

Which kind a program is follows the order programs start, not its id: each takes a ticket
from an atomic counter, and the first tickets shrink. A tile program only waits for tickets
already taken, by programs that are running and wait on nothing but the kernel before this
one, so the wait always ends, whatever order the hardware starts programs in. The counters
belong to one launch site (and grid size) and only grow: launch i of the site takes tickets
i x programs onwards and waits for (i + 1) x shrinks finished, so nothing resets them
between launches or CUDA graph replays. In Triton's interpreter programs run one after
another in id order, so the shrink programs have finished before any tile program waits.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..host import dot_f32, pdl_launch
from .fold import GemmLora, counters_for, gemm_lora_fits
from .shapes import row_tile, tma_rows
from .triton_kernel import prefetch_l2


@triton.jit
def _shrink_program(x_desc, x_ptr, a_desc, a_ptr, xa_ptr, scaling_ptr, table_ptr, M, stride_xm,
                    stride_xa, stride_seg, rank_col, ticket,
                    K: tl.constexpr, R: tl.constexpr, N_SLICES: tl.constexpr, ROWS: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, TMA: tl.constexpr,
                    PDL: tl.constexpr, DOT_F32: tl.constexpr, EARLY_TRIGGER: tl.constexpr,
                    PREFETCH_A: tl.constexpr, LINE: tl.constexpr):
    """xa[rows of segment s, slice*R:(slice+1)*R] = x @ A_slice[slot_s's rows].T *
    scaling[slot_s], zero past the slot's rank on the slice. EARLY_TRIGGER (with PDL): the
    next kernel may launch once this program has its input. PREFETCH_A (with PDL): columns of
    the slice's A asked of L2 before the wait, as the tiles ask for their W: A does not depend
    on the kernel before, x does."""
    seg = ticket // N_SLICES
    slc = ticket % N_SLICES
    row = table_ptr + seg * stride_seg
    slot = tl.load(row)
    first = tl.load(row + 1)
    length = tl.load(row + 2)
    rank = tl.load(row + rank_col + 2 * slc)
    arena_row = tl.load(row + rank_col + 2 * slc + 1)
    if length > 0:
        # A of slice slc: rows slc*ROWS .. of the [slices x rows, K] arena, the slot's from
        # its first row on; rows past its rank belong to other adapters (or lie past the
        # arena, where TMA reads zeros): masked, or their columns of the product zeroed.
        a_row = slc * ROWS + arena_row
        offs_m = tl.arange(0, BLOCK_M)
        offs_r = tl.arange(0, R)
        offs_k = tl.arange(0, BLOCK_K)
        live_r = offs_r < rank
        if PDL:
            if PREFETCH_A > 0:  # one prefetch per 128-byte line of the slot's A rows
                lines = tl.arange(0, PREFETCH_A // LINE) * LINE
                pf_r = tl.minimum(offs_r, tl.maximum(rank - 1, 0))  # none past the rank
                prefetch_l2(a_ptr + (a_row + pf_r)[:, None].to(tl.int64) * K + lines[None, :])
            tl.extra.cuda.gdc_wait()  # x is the previous kernel's output
            if EARLY_TRIGGER:
                tl.extra.cuda.gdc_launch_dependents()
        acc = tl.zeros((BLOCK_M, R), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if TMA:
                x = x_desc.load([0, k0])
                a = a_desc.load([a_row, k0])  # [R, BLOCK_K]
            else:
                x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :],
                            mask=offs_m[:, None] < M, other=0.0)
                a = tl.load(a_ptr + (a_row + offs_r)[:, None].to(tl.int64) * K
                            + (k0 + offs_k)[None, :], mask=live_r[:, None], other=0.0)
            if DOT_F32:
                acc += tl.dot(x.to(tl.float32), a.to(tl.float32).T, input_precision="ieee")
            else:
                acc += tl.dot(x, a.T)
        acc = tl.where(live_r[None, :], acc * tl.load(scaling_ptr + slot), 0.0)
        in_segment = (offs_m >= first) & (offs_m < first + length) & (offs_m < M)
        tl.store(xa_ptr + offs_m[:, None] * stride_xa + (slc * R + offs_r)[None, :], acc,
                 mask=in_segment[:, None])


@triton.jit
def _unit(table_ptr, stride_seg, rank_col, unit, valid, K: tl.constexpr,
          N_SLICES: tl.constexpr, ROWS: tl.constexpr, SPLITS: tl.constexpr,
          BLOCK_K: tl.constexpr):
    """Unit `unit` of a spread shrink (shrink_splits), for segment s, slice i and K range j:
    (slot, first row, rows (0 where not `valid`), rank, first A row, the K range, the unit's
    first column of xa (split j's sums of slice i))."""
    K_BLOCKS: tl.constexpr = K // BLOCK_K
    PER_SPLIT: tl.constexpr = (K_BLOCKS + SPLITS - 1) // SPLITS * BLOCK_K
    unit = tl.where(valid, unit, 0)
    split = unit % SPLITS
    slc = unit // SPLITS % N_SLICES
    row = table_ptr + (unit // (SPLITS * N_SLICES)) * stride_seg
    slot = tl.load(row)
    first = tl.load(row + 1)
    length = tl.where(valid, tl.load(row + 2), 0)
    rank = tl.load(row + rank_col + 2 * slc)
    a_row = slc * ROWS + tl.load(row + rank_col + 2 * slc + 1)
    k_lo = split * PER_SPLIT
    k_hi = tl.minimum(k_lo + PER_SPLIT, K)
    return slot, first, length, rank, a_row, k_lo, k_hi, split * N_SLICES + slc


@triton.jit
def _store_unit(acc, xa_ptr, scaling_ptr, M, stride_xa, slot, first, length, rank, xa_slice,
                offs_m, R: tl.constexpr):
    """A unit's rows of its partial sum, scaled, zero past the rank, into xa (_unit)."""
    offs_r = tl.arange(0, R)
    if length > 0:  # padding segments (a graph's bucket) have no rows, nor a slot
        acc = tl.where((offs_r < rank)[None, :], acc * tl.load(scaling_ptr + slot), 0.0)
        in_segment = (offs_m >= first) & (offs_m < first + length) & (offs_m < M)
        tl.store(xa_ptr + offs_m[:, None] * stride_xa + (xa_slice * R + offs_r)[None, :], acc,
                 mask=in_segment[:, None])


@triton.jit
def _shrink_unit(x16_desc, x_ptr, a_desc, a_ptr, xa_ptr, scaling_ptr, table_ptr, M, stride_xm,
                 stride_xa, stride_seg, rank_col, unit,
                 K: tl.constexpr, R: tl.constexpr, N_SLICES: tl.constexpr, ROWS: tl.constexpr,
                 SPLITS: tl.constexpr, BLOCK_K: tl.constexpr, TMA: tl.constexpr,
                 DOT_F32: tl.constexpr):
    """A unit of a spread shrink on its own (a program's units past the one its weight
    stream carries): the segment's rows 16 at a time over the unit's K range."""
    ROW_TILE: tl.constexpr = 16
    slot, first, length, rank, a_row, k_lo, k_hi, xa_slice = _unit(
        table_ptr, stride_seg, rank_col, unit, True, K, N_SLICES, ROWS, SPLITS, BLOCK_K)
    offs_r = tl.arange(0, R)
    offs_k = tl.arange(0, BLOCK_K)
    for m0 in range(first, first + length, ROW_TILE):
        offs_m = m0 + tl.arange(0, ROW_TILE)
        acc = tl.zeros((ROW_TILE, R), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):  # empty past K: the split stores zeros
            if TMA:
                x = x16_desc.load([m0, k0])
                a = a_desc.load([a_row, k0])  # [R, BLOCK_K]
            else:
                x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :],
                            mask=offs_m[:, None] < M, other=0.0)
                a = tl.load(a_ptr + (a_row + offs_r)[:, None].to(tl.int64) * K
                            + (k0 + offs_k)[None, :], mask=(offs_r < rank)[:, None], other=0.0)
            if DOT_F32:
                acc += tl.dot(x.to(tl.float32), a.to(tl.float32).T, input_precision="ieee")
            else:
                acc += tl.dot(x, a.T)
        _store_unit(acc, xa_ptr, scaling_ptr, M, stride_xa, slot, first, length, rank, xa_slice,
                    offs_m, R)


@triton.jit
def _row_b(b_ptr, rows_ptr, M, n0, slc, stride_rows, stride_br, R: tl.constexpr,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Each row's adapter's B over the tile's columns, a rank row at a time: a tuple of R
    [BLOCK_M, BLOCK_N] tiles, tile r holding rank row r of every row's run on slice slc (zero
    past the row's rank, all zero for rows without an adapter); and the rows' adapter masks.
    A rank row is contiguous over the columns (kernels/lora/rows.py), so one tile per row
    keeps the sum over the rank inside each thread (_row_delta): a [rows, columns, rank]
    tile would spread the rank over threads and warps and sum it through shared memory."""
    offs_m = tl.arange(0, BLOCK_M)
    in_batch = offs_m < M
    rank = tl.load(rows_ptr + offs_m * stride_rows + 2 * slc, mask=in_batch, other=0)
    first = tl.load(rows_ptr + offs_m * stride_rows + 2 * slc + 1, mask=in_batch, other=0)
    has = rank > 0
    offs_n = (n0 + tl.arange(0, BLOCK_N)).to(tl.int64)
    b_rows = b_ptr + first.to(tl.int64)[:, None] * stride_br + offs_n[None, :]
    b = ()
    for r in tl.static_range(R):
        b = b + (tl.load(b_rows + r * stride_br, mask=(r < rank)[:, None], other=0.0),)
    return b, has


@triton.jit
def _row_delta(b, has, xa_ptr, slc, stride_xa, R: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """[BLOCK_M, BLOCK_N] float32: each row's xa (its slice's R columns) times its B (_row_b),
    summed over the rank in order."""
    xa_row = xa_ptr + tl.arange(0, BLOCK_M) * stride_xa + slc * R
    d = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r in tl.static_range(R):
        xa = tl.load(xa_row + r, mask=has, other=0.0, cache_modifier=".cg")
        d += xa[:, None] * b[r].to(tl.float32)
    return d


@triton.jit(do_not_specialize=["M"])
def _decode_gemm_lora_kernel(
    x_desc, x_ptr, w_desc, w_ptr, y_ptr, a_desc, a_ptr, b_ptr, xa_ptr, scaling_ptr, table_ptr,
    rows_ptr, sync_ptr, M, off1, off2, stride_xm, stride_wn, stride_wk, stride_ym, stride_br,
    stride_rows, stride_xa, stride_seg, rank_col, x16_desc,
    K: tl.constexpr, R: tl.constexpr, N_SLICES: tl.constexpr, ROWS: tl.constexpr,
    SEGMENTS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TMA: tl.constexpr,
    PDL: tl.constexpr, PREFETCH_K: tl.constexpr, LINE: tl.constexpr, DOT_F32: tl.constexpr,
    EXPAND: tl.constexpr = True, PREFETCH_A: tl.constexpr = 0, SPLITS: tl.constexpr = 0,
):
    # SPLITS (shrink-only): the tile programs shrink, no program of its own does.
    NUM_SHRINK: tl.constexpr = 0 if SPLITS else SEGMENTS * N_SLICES
    if EXPAND:
        # Tickets and finished shrinks only ever grow (int64): launch i of this site takes
        # tickets i*programs .. (i+1)*programs-1 and waits for (i+1)*NUM_SHRINK finished
        # shrinks.
        programs = tl.num_programs(0).to(tl.int64)
        ticket = tl.atomic_add(sync_ptr, 1, sem="relaxed", scope="gpu")
        launch = ticket // programs
        role = ticket - launch * programs
    else:  # no tile waits for the shrinks: a program's id is its role
        launch = 0
        role = tl.program_id(0).to(tl.int64)
    if role < NUM_SHRINK:
        _shrink_program(x_desc, x_ptr, a_desc, a_ptr, xa_ptr, scaling_ptr, table_ptr, M,
                        stride_xm, stride_xa, stride_seg, rank_col, role.to(tl.int32), K, R,
                        N_SLICES, ROWS, BLOCK_M, BLOCK_K, TMA, PDL, DOT_F32, not EXPAND,
                        PREFETCH_A, LINE)
        if EXPAND:
            if PDL:
                tl.extra.cuda.gdc_launch_dependents()
            # Every thread's stores of xa above before the count (a release at GPU scope).
            tl.debug_barrier()
            tl.atomic_add(sync_ptr + 1, 1, sem="release", scope="gpu")
    else:
        n0 = (role - NUM_SHRINK).to(tl.int32) * BLOCK_N
        offs_n = (n0 + tl.arange(0, BLOCK_N)).to(tl.int64)
        offs_m = tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        # The tile's slice, and the rows' adapters' ranks and arena rows on it: those come
        # from the host (copied before the step), not from the kernel before, so their B
        # columns are read into registers while that kernel and W's stream run.
        slc = (n0 >= off1).to(tl.int32) + (n0 >= off2).to(tl.int32)
        if EXPAND:
            b_rows, has = _row_b(b_ptr, rows_ptr, M, n0, slc, stride_rows, stride_br, R,
                                 BLOCK_M, BLOCK_N)
        if PDL:
            if PREFETCH_K > 0:  # as in decode_gemm_triton: W does not depend on the kernel before
                lines = tl.arange(0, PREFETCH_K // LINE) * LINE
                prefetch_l2(w_ptr + offs_n[:, None] * stride_wn + lines[None, :] * stride_wk)
            tl.extra.cuda.gdc_wait()
            if not EXPAND:  # as decode_gemm_triton's early trigger
                tl.extra.cuda.gdc_launch_dependents()
        if SPLITS:
            # The program's unit of the shrink rides on its weight stream: over the unit's K
            # range each step also reads the adapter's A columns (masked loads elsewhere: no
            # bytes) and multiplies the x tile it already holds. Units past one a program run
            # after the stream (_shrink_unit).
            UNITS: tl.constexpr = SEGMENTS * N_SLICES * SPLITS
            u_slot, u_first, u_len, u_rank, u_row, u_lo, u_hi, u_slice = _unit(
                table_ptr, stride_seg, rank_col, tl.program_id(0), tl.program_id(0) < UNITS, K,
                N_SLICES, ROWS, SPLITS, BLOCK_K)
            offs_r = tl.arange(0, R)
            # (Every mask elementwise over vectors: Triton 3.9's interpreter rejects masks
            # broadcast from a scalar comparison.)
            u_live = (offs_r < tl.where(u_len > 0, u_rank, 0))[None, :]
            a_cols = a_ptr + (u_row + offs_r)[None, :].to(tl.int64) * K + offs_k[:, None]
            acc_a = tl.zeros((BLOCK_M, R), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if TMA:
                x = x_desc.load([0, k0])
                w = w_desc.load([n0, k0]).T  # [BLOCK_K, BLOCK_N] of W [out, in]
            else:
                x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :],
                            mask=offs_m[:, None] < M, other=0.0)
                w = tl.load(w_ptr + (k0 + offs_k)[:, None] * stride_wk + offs_n[None, :] * stride_wn)
            if DOT_F32:
                acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(x, w)
            if SPLITS:
                in_unit = ((k0 + offs_k >= u_lo) & (k0 + offs_k < u_hi))[:, None]
                a = tl.load(a_cols + k0, mask=u_live & in_unit, other=0.0)
                if DOT_F32:
                    acc_a += tl.dot(x.to(tl.float32), a.to(tl.float32), input_precision="ieee")
                else:
                    acc_a += tl.dot(x, a)
        if SPLITS:
            _store_unit(acc_a, xa_ptr, scaling_ptr, M, stride_xa, u_slot, u_first, u_len, u_rank,
                        u_slice, offs_m, R)
            # (32-bit: TMA takes 32-bit coordinates)
            for unit in range(tl.program_id(0) + tl.num_programs(0), UNITS, tl.num_programs(0)):
                _shrink_unit(x16_desc, x_ptr, a_desc, a_ptr, xa_ptr, scaling_ptr, table_ptr, M,
                             stride_xm, stride_xa, stride_seg, rank_col, unit, K, R, N_SLICES,
                             ROWS, SPLITS, BLOCK_K, TMA, DOT_F32)
        if EXPAND:
            if PDL:  # the next kernel may launch now (it waits for this one before reading y)
                tl.extra.cuda.gdc_launch_dependents()
            # Every shrink program's rows of xa stored (their tickets are taken: they run).
            target = (launch + 1) * NUM_SHRINK
            arrived = tl.atomic_add(sync_ptr + 1, 0, sem="acquire", scope="gpu")
            while arrived < target:
                arrived = tl.atomic_add(sync_ptr + 1, 0, sem="acquire", scope="gpu")
            acc += _row_delta(b_rows, has, xa_ptr, slc, stride_xa, R, BLOCK_M, BLOCK_N)
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
                 acc.to(y_ptr.dtype.element_ty), mask=offs_m[:, None] < M)


def decode_gemm_lora_triton(x: torch.Tensor, w: torch.Tensor, lora: GemmLora, *,
                            tma: bool = False, pdl: bool = False, prefetch_k: int = 0,
                            block_n: int = 16, block_k: int = 128, num_warps: int = 4,
                            num_stages: int = 4, prefetch_a: int = 0) -> torch.Tensor:
    """x [M, K] @ w [K, N] plus the LoRA delta in one launch (gemm_lora_fits(lora, N,
    block_n), K a multiple of block_k). tma (Hopper): W, x and A tiles by TMA, w a transposed
    view of a contiguous [N, K]; pdl: launched with programmatic dependent launch. prefetch_a
    (with pdl): columns of A each shrink program asks of L2 before its wait (a multiple of 64;
    at most K)."""
    M, K = x.shape
    N = w.shape[1]
    assert gemm_lora_fits(lora, N, block_n) and K % block_k == 0
    splits = lora.shrink_splits
    assert not (splits and lora.expand), "a spread shrink leaves the expand to the next op"
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    r, slices = lora.rank, lora.slices
    block_m = row_tile(M)
    rows = lora.a_all.shape[1]
    a2d = lora.a_all.reshape(-1, K)
    assert a2d.stride(1) == 1 and lora.b_all.stride(1) == 1 and lora.xa.stride(1) == 1
    assert lora.token_rows.stride(1) == 1
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        w_out_in = w.t()
        descs = (TensorDescriptor(x, [tma_rows(x, block_m), K], [x.stride(0), 1], [block_m, block_k]),
                 TensorDescriptor(w_out_in, [N, K], [K, 1], [block_n, block_k]),
                 TensorDescriptor(a2d, list(a2d.shape), [K, 1], [r, block_k]),
                 TensorDescriptor(x, [M, K], [x.stride(0), 1], [16, block_k]))
        w_arg, stride_wn, stride_wk = w_out_in, K, 1
    else:
        descs = (x, w, a2d, x)
        w_arg, stride_wn, stride_wk = w, w.stride(1), w.stride(0)
    offs = [*lora.slice_offsets[1:], N, N][:2]
    table = lora.segment_table
    grid = ((0 if splits else lora.segments * slices) + N // block_n,)
    _decode_gemm_lora_kernel[grid](
        descs[0], x, descs[1], w_arg, y, descs[2], a2d, lora.b_all, lora.xa, lora.scaling, table,
        lora.token_rows, counters_for(lora.sync, block_n), M, offs[0], offs[1], x.stride(0), stride_wn, stride_wk,
        y.stride(0), lora.b_all.stride(0), lora.token_rows.stride(0), lora.xa.stride(0),
        table.stride(0), lora.rank_col, descs[3],
        K=K, R=r, N_SLICES=slices, ROWS=rows, SEGMENTS=lora.segments, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, TMA=tma, PDL=pdl,
        PREFETCH_K=min(prefetch_k, K) if pdl and stride_wk == 1 else 0,
        LINE=128 // w.element_size(), DOT_F32=dot_f32(x.dtype, x.device), EXPAND=lora.expand,
        PREFETCH_A=min(prefetch_a, K) if pdl else 0, SPLITS=splits,
        num_warps=num_warps, num_stages=num_stages, **pdl_launch(pdl),
    )
    return y
