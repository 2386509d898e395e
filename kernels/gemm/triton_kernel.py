"""x @ W for a decode batch (at most 64 rows): a weight stream, one output tile per program.

At decode a projection reads megabytes of weights for 64 rows of input, so its time is the
weight stream plus a fixed cost: the first loads' latency and the gap after the kernel before
it, which for cuBLASLt's kernels of the smaller projections (q/k/v, o, down) is a large share
(docs/PERFORMANCE.md). This kernel gives each program a [BLOCK_N, K] slab of W (one
output tile, no split-K, no reduction launch), and with programmatic dependent launch
(PDL=True, Hopper) it starts before the kernel ahead of it has finished: the weights do not
depend on that kernel, so the program asks L2 for the first PREFETCH_K columns of its slab,
then waits (gdc_wait) for the input rows. The kernels ahead of it (add + norm, attention,
SiLU) let it launch early by calling gdc_launch_dependents at their start.

W is addressed through strides: [out, in] with `in` contiguous (a slab is BLOCK_N contiguous
rows) or [in, out] with `out` contiguous.

With ROPE the launch is q/k/v's and its epilogue is the op after it (kernels/rope): each
program takes columns d0.. of the first half of one head and the same columns of its second
half (the pairs RoPE's rotate_half mixes), rotates query and key heads at their rows'
positions, and writes queries to their buffer and keys and values to their cache slots: no
RoPE launch, and no q/k/v output written and read back.

On Hopper, decode_gemm_tma is the same product with its x and W tiles fetched by the tensor
memory accelerator (one copy instruction a tile): ncu showed the pointer-load kernel
issue-bound (for down, 1 warp per scheduler issuing every 3.7 cycles, DRAM at 47% of peak),
and TMA made the decode graph faster (docs/PERFORMANCE.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..activation.triton_kernel import silu_times
from ..host import dot_f32, pdl_launch
from .fp8 import SplitSums
from .rope_out import RopeOut, no_rope_args
from .shapes import MAX_ROWS, empty_rows, row_tile, tma_fits, tma_rows


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the lines at `ptrs` (no registers filled, nothing waited for)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _first_column(pid, BLOCK_N: tl.constexpr, ROPE: tl.constexpr, D: tl.constexpr):
    """The program's first output column: tiles side by side, or with ROPE BLOCK_N columns
    into the first half of head pid // (tiles a half)."""
    if ROPE:
        per_half: tl.constexpr = D // 2 // BLOCK_N
        return (pid // per_half) * D + (pid % per_half) * BLOCK_N
    return pid * BLOCK_N


@triton.jit
def _split_of(pid, K: tl.constexpr, SPLIT_K: tl.constexpr):
    """(the program's output tile, the first column of K it sums over): a tile's K splits are
    neighbouring programs, each over K / SPLIT_K columns."""
    return pid // SPLIT_K, (pid % SPLIT_K) * (K // SPLIT_K)


@triton.jit
def _store_partial(part_ptr, acc, M, pid, offs_m, offs_n, N, SPLIT_K: tl.constexpr):
    """The program's float32 partial sum into parts [SPLIT_K, M, N] (SplitSums)."""
    split = pid % SPLIT_K
    rows = (split * M + offs_m).to(tl.int64)
    tl.store(part_ptr + rows[:, None] * N + offs_n[None, :], acc, mask=offs_m[:, None] < M)


@triton.jit
def _rope_reads(M, pid, q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, stride_qt,
                stride_qh, stride_kb, stride_kp, stride_kh, stride_vb, stride_vp, stride_vh,
                stride_cos, page, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """What the ROPE epilogue reads besides the accumulators: its rows' cos and sin for both
    halves (ones and zeros for value heads) and where it stores. All are step inputs, not the
    kernel ahead's output, so the kernels read them before their wait: the dependent loads
    (positions, then the tables; the slots) hide under the weight stream."""
    HALF: tl.constexpr = D // 2
    per_half: tl.constexpr = HALF // BLOCK_N
    head = pid // per_half
    offs_d = (pid % per_half) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    rows = offs_m < M
    if head < HQ + HKV:
        pos = tl.load(pos_ptr + offs_m, mask=rows, other=0)
        trig = pos[:, None] * stride_cos + offs_d[None, :]
        c1 = tl.load(cos_ptr + trig, mask=rows[:, None], other=0.0)
        s1 = tl.load(sin_ptr + trig, mask=rows[:, None], other=0.0)
        c2 = tl.load(cos_ptr + trig + HALF, mask=rows[:, None], other=0.0)
        s2 = tl.load(sin_ptr + trig + HALF, mask=rows[:, None], other=0.0)
    else:
        c1 = tl.full((BLOCK_M, BLOCK_N), 1.0, tl.float32)
        s1 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        c2 = c1
        s2 = s1
    if head < HQ:
        dst = q_ptr + offs_m[:, None].to(tl.int64) * stride_qt + head * stride_qh
    else:
        slot = tl.load(slot_ptr + offs_m, mask=rows, other=0).to(tl.int64)
        if head < HQ + HKV:
            dst = (k_ptr + (slot // page) * stride_kb + (slot % page) * stride_kp
                   + (head - HQ) * stride_kh)[:, None]
        else:
            dst = (v_ptr + (slot // page) * stride_vb + (slot % page) * stride_vp
                   + (head - HQ - HKV) * stride_vh)[:, None]
    return c1, s1, c2, s2, dst + offs_d[None, :]


@triton.jit
def _rope_store(acc1, acc2, M, c1, s1, c2, s2, dst, D: tl.constexpr, BLOCK_M: tl.constexpr):
    """The ROPE epilogue: acc1 and acc2 hold the program's columns of the first and second
    half of one head. Rounded to the output dtype first (as the plain launch stores them for
    the RoPE kernel), rotated for query and key heads in float32 as kernels/rope does
    ((x1, x2) -> (x1 c1 - x2 s1, x2 c2 + x1 s2)), and stored at dst (_rope_reads): queries to
    their buffer, keys and values to their rows' cache slots."""
    HALF: tl.constexpr = D // 2
    rows = tl.arange(0, BLOCK_M) < M
    dtype = dst.dtype.element_ty
    x1 = acc1.to(dtype).to(tl.float32)
    x2 = acc2.to(dtype).to(tl.float32)
    y1 = x1 * c1 - x2 * s1
    y2 = x2 * c2 + x1 * s2
    tl.store(dst, y1.to(dtype), mask=rows[:, None])
    tl.store(dst + HALF, y2.to(dtype), mask=rows[:, None])


@triton.jit(do_not_specialize=["M"])
def _decode_gemm_kernel(
    x_ptr, w_ptr, y_ptr, part_ptr, M, N,
    stride_xm, stride_wn, stride_wk, stride_ym, pair_offset,
    k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, stride_qh, stride_kb, stride_kp,
    stride_kh, stride_vb, stride_vp, stride_vh, stride_cos, page,
    K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr, PREFETCH_K: tl.constexpr, LINE: tl.constexpr, DOT_F32: tl.constexpr,
    EARLY_TRIGGER: tl.constexpr = False, GATED: tl.constexpr = False, ROPE: tl.constexpr = False,
    HQ: tl.constexpr = 1, HKV: tl.constexpr = 1, D: tl.constexpr = 2, SPLIT_K: tl.constexpr = 1,
):
    """GATED: W is gate/up's [gate; up] (up from output column pair_offset) and each program
    writes SiLU(x @ gate) * (x @ up) for its BLOCK_N columns of both. ROPE: W is q/k/v's
    (HQ, HKV heads of D), y the queries [M, HQ, D], and the program's second columns lie
    pair_offset (D / 2) after its first (_rope_store). SPLIT_K > 1 (plain launches only): each
    program sums K / SPLIT_K columns of K and stores its float32 partial (_store_partial)."""
    PAIRED: tl.constexpr = GATED or ROPE
    pid = tl.program_id(0)
    tile, k_lo = _split_of(pid, K, SPLIT_K)
    offs_n = (_first_column(tile, BLOCK_N, ROPE, D) + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = k_lo + tl.arange(0, BLOCK_K)
    if ROPE:
        c1, s1, c2, s2, dst = _rope_reads(M, pid, y_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr,
                                          slot_ptr, stride_ym, stride_qh, stride_kb, stride_kp,
                                          stride_kh, stride_vb, stride_vp, stride_vh, stride_cos,
                                          page, HQ, HKV, D, BLOCK_M, BLOCK_N)
    if PDL:
        if PREFETCH_K > 0:
            # One prefetch per 128-byte line of the slab's first PREFETCH_K columns (W is
            # [out, in] here: each of the slab's rows is contiguous).
            lines = k_lo + tl.arange(0, PREFETCH_K // LINE) * LINE
            prefetch_l2(w_ptr + offs_n[:, None] * stride_wn + lines[None, :] * stride_wk)
            if PAIRED:
                prefetch_l2(w_ptr + (pair_offset + offs_n[:, None]) * stride_wn
                            + lines[None, :] * stride_wk)
        tl.extra.cuda.gdc_wait()  # the input rows are the previous kernel's output
        if EARLY_TRIGGER:  # every program runs: the next kernel may launch and wait
            tl.extra.cuda.gdc_launch_dependents()
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn  # [K, N] tile
    mask_m = offs_m[:, None] < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # PAIRED only: up, or RoPE's 2nd half
    for _ in range(0, K // SPLIT_K, BLOCK_K):
        x = tl.load(x_ptrs, mask=mask_m, other=0.0)
        w = tl.load(w_ptrs)
        if DOT_F32:  # kernels/host.py: dot_f32
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, w)
        if PAIRED:
            w_up = tl.load(w_ptrs + pair_offset * stride_wn)
            if DOT_F32:
                acc_up += tl.dot(x.to(tl.float32), w_up.to(tl.float32), input_precision="ieee")
            else:
                acc_up += tl.dot(x, w_up)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    if PDL and not EARLY_TRIGGER:  # the next kernel may launch now (it waits for this one)
        tl.extra.cuda.gdc_launch_dependents()
    if ROPE:
        _rope_store(acc, acc_up, M, c1, s1, c2, s2, dst, D, BLOCK_M)
    elif SPLIT_K > 1:
        _store_partial(part_ptr, acc, M, pid, offs_m, offs_n, N, SPLIT_K)
    else:
        y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
        if GATED:
            tl.store(y_ptrs, silu_times(acc, acc_up, y_ptr.dtype.element_ty), mask=mask_m)
        else:
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m)


@triton.jit(do_not_specialize=["M"])
def _decode_gemm_tma_kernel(
    x_desc, w_desc, w_ptr, y_ptr, part_ptr, M, N, stride_wn, stride_ym, pair_offset,
    k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, stride_qh, stride_kb, stride_kp,
    stride_kh, stride_vb, stride_vp, stride_vh, stride_cos, page,
    K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr, PREFETCH_K: tl.constexpr, LINE: tl.constexpr, DOT_F32: tl.constexpr,
    EARLY_TRIGGER: tl.constexpr = False, GATED: tl.constexpr = False, ROPE: tl.constexpr = False,
    HQ: tl.constexpr = 1, HKV: tl.constexpr = 1, D: tl.constexpr = 2, SPLIT_K: tl.constexpr = 1,
):
    """The same product with the tiles fetched by the tensor memory accelerator (Hopper): one
    copy instruction a tile, where the pointer loads issue one per 16 bytes per thread and
    left the SM issue-bound (ncu, down projection: 1 warp per scheduler, 3.7 cycles between
    issues, DRAM at 47% of peak). Rows past M read as zero. GATED, ROPE and SPLIT_K as in the
    pointer kernel."""
    PAIRED: tl.constexpr = GATED or ROPE
    pid = tl.program_id(0)
    tile, k_lo = _split_of(pid, K, SPLIT_K)
    n0 = _first_column(tile, BLOCK_N, ROPE, D)
    offs_n = (n0 + tl.arange(0, BLOCK_N)).to(tl.int64)
    if ROPE:
        c1, s1, c2, s2, dst = _rope_reads(M, pid, y_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr,
                                          slot_ptr, stride_ym, stride_qh, stride_kb, stride_kp,
                                          stride_kh, stride_vb, stride_vp, stride_vh, stride_cos,
                                          page, HQ, HKV, D, BLOCK_M, BLOCK_N)
    if PDL:
        if PREFETCH_K > 0:
            lines = k_lo + tl.arange(0, PREFETCH_K // LINE) * LINE
            prefetch_l2(w_ptr + offs_n[:, None] * stride_wn + lines[None, :])
            if PAIRED:
                prefetch_l2(w_ptr + (pair_offset + offs_n[:, None]) * stride_wn + lines[None, :])
        tl.extra.cuda.gdc_wait()
        if EARLY_TRIGGER:
            tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # PAIRED only: up, or RoPE's 2nd half
    for k0 in range(k_lo, k_lo + K // SPLIT_K, BLOCK_K):
        x = x_desc.load([0, k0])
        w = w_desc.load([n0, k0])  # [BLOCK_N, BLOCK_K] of W [out, in]
        if DOT_F32:  # kernels/host.py: dot_f32
            acc += tl.dot(x, w.T, input_precision="ieee")
        else:
            acc += tl.dot(x, w.T)
        if PAIRED:
            w_up = w_desc.load([pair_offset + n0, k0])
            if DOT_F32:
                acc_up += tl.dot(x, w_up.T, input_precision="ieee")
            else:
                acc_up += tl.dot(x, w_up.T)
    if PDL and not EARLY_TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    if ROPE:
        _rope_store(acc, acc_up, M, c1, s1, c2, s2, dst, D, BLOCK_M)
    elif SPLIT_K > 1:
        _store_partial(part_ptr, acc, M, pid, tl.arange(0, BLOCK_M), offs_n, N, SPLIT_K)
    else:
        offs_m = tl.arange(0, BLOCK_M)
        y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
        if GATED:
            tl.store(y_ptrs, silu_times(acc, acc_up, y_ptr.dtype.element_ty), mask=offs_m[:, None] < M)
        else:
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=offs_m[:, None] < M)


def decode_gemm_tma(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, *,
                    pdl: bool = False, prefetch_k: int = 0, block_n: int = 16, block_k: int = 128,
                    num_warps: int = 4, num_stages: int = 4, early_trigger: bool = False,
                    gated: bool = False, rope: RopeOut | None = None, split_k: int = 1
                    ) -> torch.Tensor | SplitSums:
    """decode_gemm_triton with TMA tile loads (CUDA, Hopper or newer; tma_fits(x, w))."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    M, K = x.shape
    N = w.shape[1]
    w_out_in = w.t()
    assert tma_fits(x, w) and M <= MAX_ROWS
    y, programs, pair_offset, rope_args, heads = _launch_shape(x, w, out, block_n, block_k, gated,
                                                               rope, split_k)
    parts = _partials(y, split_k)
    if M == 0:
        return SplitSums(parts, x.dtype) if split_k > 1 else y
    block_m = row_tile(M)
    x_desc = TensorDescriptor(x, [tma_rows(x, block_m), K], [x.stride(0), 1], [block_m, block_k])
    w_desc = TensorDescriptor(w_out_in, [N, K], [K, 1], [block_n, block_k])
    _decode_gemm_tma_kernel[(programs,)](
        x_desc, w_desc, w_out_in, y, parts, M, N, K, y.stride(0), pair_offset, *rope_args,
        K=K, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PDL=pdl,
        PREFETCH_K=min(prefetch_k, K // split_k) if pdl else 0, LINE=128 // w.element_size(),
        DOT_F32=dot_f32(x.dtype, x.device), EARLY_TRIGGER=pdl and early_trigger, GATED=gated,
        ROPE=rope is not None, **heads, SPLIT_K=split_k,
        num_warps=num_warps, num_stages=num_stages, **pdl_launch(pdl),
    )
    return SplitSums(parts, x.dtype) if split_k > 1 else y


def _partials(y: torch.Tensor, split_k: int) -> torch.Tensor:
    """The float32 partials [split_k, M, N] of a K-split launch writing y [M, N] (y itself,
    never written, where the launch is not split)."""
    if split_k == 1:
        return y
    return torch.empty(split_k, *y.shape, dtype=torch.float32, device=y.device)


def _launch_shape(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None, block_n: int,
                  block_k: int, gated: bool, rope: RopeOut | None, split_k: int = 1) -> tuple:
    """(output, programs, the offset of a program's second columns, RoPE's arguments, its
    head counts): N columns, or with `gated` half of them (SiLU(gate) * up), or with `rope`
    the queries (each program two tiles of one head); split_k programs a tile (plain only)."""
    M, K = x.shape
    N = w.shape[1]
    assert K % (block_k * split_k) == 0, "K tiles must divide the weight (each split of it)"
    assert split_k == 1 or not (gated or rope), "only a plain launch splits K"
    if rope is not None:
        assert not gated and rope.fits(x, w, block_n), "a RoPE launch needs q/k/v's weight"
        heads = dict(HQ=rope.num_heads, HKV=rope.num_kv_heads, D=rope.head_dim)
        return rope.q, N // (2 * block_n), rope.head_dim // 2, (*rope.kernel_args(),), heads
    cols = N // 2 if gated else N
    assert N % (2 if gated else 1) == 0 and cols % block_n == 0, \
        "tiles must divide the weight (each half of it, gated)"
    y = out if out is not None else empty_rows(M, cols, dtype=x.dtype, device=x.device)  # gate/up's: down's x
    return y, cols // block_n * split_k, cols, no_rope_args(y), {}


def decode_gemm_triton(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, *,
                       pdl: bool = False, prefetch_k: int = 0, block_n: int = 16,
                       block_k: int = 128, num_warps: int = 4, num_stages: int = 4,
                       early_trigger: bool = False, gated: bool = False,
                       rope: RopeOut | None = None, split_k: int = 1) -> torch.Tensor | SplitSums:
    """x [M, K] @ w [K, N] for M <= MAX_ROWS (w may be a transposed view of an [N, K] matrix).
    pdl: launch with programmatic dependent launch (CUDA, Hopper or newer only); prefetch_k:
    columns of each program's slab asked of L2 before the wait (a multiple of 64);
    early_trigger (with pdl): the next kernel may launch once every program is past its wait
    (with several waves of tiles: once the last wave has started), not after the main loops;
    gated: w is gate/up's [gate | up] and the launch writes SiLU(x @ gate) * (x @ up), [M, N / 2]
    (block_n columns of each half a program), with no SiLU launch after it; rope: w is q/k/v's
    and the launch also does kernels/rope's work (RoPE, the KV-cache write), writing the
    queries to rope.q (returned), block_n columns of each half of a head a program; split_k
    (plain launches): each tile's K summed by split_k programs, whose float32 partials come
    back unsummed (SplitSums) for the add + norm after o or down to sum: wider tiles as many
    programs, so each program reads fewer rows of x from L2 for the weight bytes it streams."""
    M, K = x.shape
    assert w.shape[0] == K and x.stride(1) == 1 and M <= MAX_ROWS
    y, programs, pair_offset, rope_args, heads = _launch_shape(x, w, out, block_n, block_k, gated,
                                                               rope, split_k)
    parts = _partials(y, split_k)
    if M == 0:
        return SplitSums(parts, x.dtype) if split_k > 1 else y
    line = 128 // w.element_size()
    if w.stride(0) != 1:  # [in, out] layout: a slab's rows are not contiguous lines
        prefetch_k = 0
    _decode_gemm_kernel[(programs,)](
        x, w, y, parts, M, y.shape[1], x.stride(0), w.stride(1), w.stride(0), y.stride(0), pair_offset,
        *rope_args, K=K, BLOCK_M=row_tile(M), BLOCK_N=block_n, BLOCK_K=block_k,
        PDL=pdl, PREFETCH_K=min(prefetch_k, K // split_k) if pdl else 0, LINE=line,
        DOT_F32=dot_f32(x.dtype, x.device), EARLY_TRIGGER=pdl and early_trigger, GATED=gated,
        ROPE=rope is not None, **heads, SPLIT_K=split_k,
        num_warps=num_warps, num_stages=num_stages, **pdl_launch(pdl),
    )
    return SplitSums(parts, x.dtype) if split_k > 1 else y
