"""x @ dequant(W).T with W stored as float8_e4m3fn: the weight-only FP8 GEMM (kernels/gemm/fp8.py
says when it runs).

At decode a projection's time is its weight stream: one byte a weight here against two in
bf16. Each program streams a [BLOCK_N, K-range] slab of W (rows contiguous in K, as
checkpoints store W [out, in]), widens the e4m3 bytes in registers to x's 16-bit type (exact:
e4m3's 3 mantissa bits and exponents fit bf16 and fp16), and multiplies on the tensor cores
with float32 accumulation. The scales are applied to the accumulator, never to the weights, so
the products are exact and the result is the reference's up to float32 summation order:
per-channel scales once per output at the end, block scales ([ceil(N/bn), ceil(K/bk)], Hugging
Face's fine-grained FP8) once per K tile (a K tile never straddles two scale blocks).

A decode batch has one row tile, so an N of 4096 in 64-column tiles gives 64 programs for 132
SMs: SPLIT_K programs share each tile's K range, each stores its float32 partial and counts
itself in on the tile's counter, and the last to arrive sums the tile's partials in split
order (deterministic: replays are bit-identical whichever program sums) into y and zeroes the
counter for the next launch. The sum then needs no launch of its own: a launch less per split
projection in the decode graph. That program reads all SPLIT_K partial tiles alone, so past
LAST_SUMS_MAX_ROWS rows a tile a second launch sums them instead (_split_k_sum: the same
order, the same bits). The counters are one buffer a device (tile_counters), so two split
GEMMs must not run at once on one device: the node launches them one after another on one
stream. Past that, where the kernel after the GEMM can sum the partials as it reads them (the
add + norm after o and down), the GEMM hands them on unsummed (SplitSums) and no sum launch
runs. Rows past one tile (prefill) get programs of their own, the row tile fastest so that
the programs running together share their weight tile in L2.

GATED (gate/up): each program multiplies its columns of gate and the same columns of up, and
its epilogue writes SiLU(gate) * up, rounded as the plain launch then the SiLU kernel round
(silu_times): half the output written and no SiLU launch. K is never split there.

On Hopper the tile's product runs on wgmma, whose second operand must sit in shared memory and
whose first may come from registers. As x @ W.T the widened weight is the second operand: each
K tile is widened in registers, written back to shared memory and multiplied with a wait for
the MMA (ttgir: local_alloc, warp_group_dot, pendings 0). With SWAP_AB each tile is computed as
W @ x.T, the decode GEMM's usual orientation: the widened weight is the register operand (no
shared-memory round trip, and the MMAs of a K tile overlap), the large N is the MMA's 64-row
dimension and the batch's rows its N (16 to 64). TMA: the x and W tiles are fetched by the
tensor memory accelerator (one instruction a tile; zero past the matrices' edges) where the
pointer loads issue one 16-byte copy per thread. WIDEN_PRMT: e4m3 -> bf16 by integer ops
(E4M3_TO_BF16_ASM) where Triton's conversion takes one F2F (a quarter-rate conversion) per
element. All three are exact; which is fastest is measured (inference_node/tuner/fp8_gemm.py
--sweep).

Everything is sized from shapes, nothing from data: a CUDA graph captures the launch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from ..host import arrival_counts, cdiv, dot_f32, hopper, interpreting, num_sms, pdl_launch
from ..activation.triton_kernel import silu_times
from .fold import GemmLora, shrink_fits
from .fp8 import MAX_BLOCK_M, SplitSums
from .fold_triton_kernel import _shrink_unit
from .fp8_rows_triton import row_scale, to_e4m3
from .shapes import empty_rows, row_tile, tma_rows
from .triton_kernel import prefetch_l2

MIN_K_TILES_PER_SPLIT = 4  # a split's K range keeps a few tiles to pipeline


# e4m3 -> bf16 in four bytes at a time (WIDEN_PRMT): each byte moved to the top of a 16-bit lane
# (prmt), its 7 magnitude bits shifted under bf16's sign (shr, and, or): that bf16 is the e4m3
# value times 2^-120 (the exponent biases differ by 120; e4m3's subnormals land on bf16's, the
# same mantissa bits), and one packed multiply by 2^120 (0x7B80) makes it the value, exactly
# (a power of two; subnormal inputs come out normal). fma with -0.0 added is the multiply, on
# sm_80 and newer. Triton's own widening goes through f16 with one F2F per element.
E4M3_TO_BF16_ASM = tl.constexpr("""
{
.reg .b32 lo, hi, t, two120, nz;
mov.b32 two120, 0x7B807B80;
mov.b32 nz, 0x80008000;
prmt.b32 lo, $2, 0, 0x1404;
prmt.b32 hi, $2, 0, 0x3424;
shr.b32 t, lo, 4;
and.b32 t, t, 0x07F007F0;
and.b32 lo, lo, 0x80008000;
or.b32 lo, lo, t;
shr.b32 t, hi, 4;
and.b32 t, t, 0x07F007F0;
and.b32 hi, hi, 0x80008000;
or.b32 hi, hi, t;
fma.rn.bf16x2 $0, lo, two120, nz;
fma.rn.bf16x2 $1, hi, two120, nz;
}
""")


@triton.jit
def _widen(w, dtype: tl.constexpr, WIDEN_PRMT: tl.constexpr):
    """e4m3 w in `dtype` (exact): Triton's conversion, or with WIDEN_PRMT (bf16 only) the
    integer path of E4M3_TO_BF16_ASM."""
    if WIDEN_PRMT:
        wide = tl.inline_asm_elementwise(E4M3_TO_BF16_ASM, "=r,=r,r", [w.to(tl.uint8, bitcast=True)],
                                         dtype=tl.bfloat16, is_pure=True, pack=4)
    else:
        wide = w.to(dtype)
    return wide


@triton.jit
def _tile_product(x, w, acc, SWAP_AB: tl.constexpr, DOT_F32: tl.constexpr,
                  WIDEN_PRMT: tl.constexpr, W8A8: tl.constexpr = False):
    """acc + x @ w.T ([BLOCK_M, BLOCK_N]), or with SWAP_AB acc + w @ x.T ([BLOCK_N, BLOCK_M]),
    for x [BLOCK_M, BLOCK_K] and w [BLOCK_N, BLOCK_K] e4m3, w widened to x's type (exact),
    or both to float32 with DOT_F32 (kernels/host.py: dot_f32). W8A8: x is e4m3 too and the
    two multiply as they are (the fp8 tensor cores; products exact, their chained sums on
    Hopper in less than float32: kernels/gemm/fp8.py)."""
    if DOT_F32:
        a = w.to(tl.float32)
        b = x.to(tl.float32)
    elif W8A8:
        a = w
        b = x
    else:
        a = _widen(w, x.dtype, WIDEN_PRMT)
        b = x
    if SWAP_AB:
        acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee" if DOT_F32 else None)
    else:
        acc = tl.dot(b, tl.trans(a), acc, input_precision="ieee" if DOT_F32 else None)
    return acc


@triton.jit
def _along_n(v, SWAP_AB: tl.constexpr):
    """A per-column vector [BLOCK_N] shaped to broadcast over the accumulator."""
    if SWAP_AB:
        shaped = v[:, None]
    else:
        shaped = v[None, :]
    return shaped


@triton.jit
def _fp8_tile(
    x_ptr, w_ptr, x_desc, w_desc, s_ptr, xs_ptr, out_ptr, y_ptr, counter_ptr, M, N,
    stride_xm, stride_wn, stride_sn, stride_sk, stride_om, stride_split, pair_offset,
    K: tl.constexpr, K_PER_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_SCALES: tl.constexpr, SCALE_BN: tl.constexpr,
    SCALE_BK: tl.constexpr, DOT_F32: tl.constexpr, PARTIAL: tl.constexpr, EVEN_K: tl.constexpr,
    SWAP_AB: tl.constexpr = False, TMA: tl.constexpr = False, WIDEN_PRMT: tl.constexpr = False,
    W8A8: tl.constexpr = False, SPLIT_K: tl.constexpr = 1, LAST_SUMS: tl.constexpr = False,
    GATED: tl.constexpr = False, PDL: tl.constexpr = False, PREFETCH_K: tl.constexpr = 0,
    TRIGGER: tl.constexpr = False,
    SHRINK_COLS: tl.constexpr = 0, pid_n=0,
):
    """Program (m tile, n tile pid_n, K split; SHRINK_COLS: the grid's columns in front of
    the tiles, the shrink's). PARTIAL: out is the float32 partials [SPLIT_K, M, N]
    (split stride stride_split), summed into y ([M, N], row stride stride_om) by the tile's
    last program to arrive with LAST_SUMS (counter_ptr: a zero int32 a tile, left zero), else
    by _split_k_sum; not PARTIAL: out is y and gets x's dtype (y_ptr unused).
    BLOCK_SCALES: s is [ceil(N/SCALE_BN), ceil(K/SCALE_BK)] and BLOCK_K divides SCALE_BK; else
    s is [N] (stride stride_sn). EVEN_K: BLOCK_K divides K (no column mask). SWAP_AB: the
    tile is computed as W @ x.T (module docstring). TMA: x and W tiles come through the
    descriptors x_desc [M, K] and w_desc [N, K] (zero past their edges), not the pointers.
    W8A8: x is e4m3 with one float32 scale a row (xs [M]), applied with W's at the end.
    GATED (not PARTIAL): W is gate/up's [gate; up], up from row pair_offset; out gets
    SiLU(x @ gate.T) * (x @ up.T), N its columns (the program's of both halves).
    PDL (launched with programmatic dependent launch): the program asks L2 for the first
    PREFETCH_K columns of its W slab (of both halves, GATED), which the kernel ahead does not
    write, then waits for that kernel (x) to end. TRIGGER (Hopper): the kernel after this one,
    launched with PDL, may launch once every program has left its K loop (else once this
    kernel ends), to wait on the SMs while the epilogues store."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + (k_start + offs_k)[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k_start + offs_k)[None, :]
    if BLOCK_SCALES:
        s_ptrs = s_ptr + (offs_n // SCALE_BN) * stride_sn
    if BLOCK_SCALES and GATED:
        s_up_ptrs = s_ptr + ((offs_n + pair_offset) // SCALE_BN) * stride_sn
    if PDL:
        if PREFETCH_K > 0:  # one prefetch per 128-byte line (128 e4m3 weights) of each row
            lines = k_start + tl.arange(0, PREFETCH_K // 128) * 128
            slab = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + lines[None, :]
            prefetch_l2(slab)
            if GATED:
                prefetch_l2(slab + pair_offset * stride_wn)
        tl.extra.cuda.gdc_wait()  # x is the kernel ahead's output
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros_like(acc)  # GATED only
    for k0 in range(k_start, k_end, BLOCK_K):
        if TMA:
            x = x_desc.load([pid_m * BLOCK_M, k0])
            w = w_desc.load([pid_n * BLOCK_N, k0])  # [BLOCK_N, BLOCK_K] e4m3
            if GATED:
                w_up = w_desc.load([pid_n * BLOCK_N + pair_offset, k0])
        elif EVEN_K:
            x = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0)
            if GATED:
                w_up = tl.load(w_ptrs + pair_offset * stride_wn, mask=mask_n[:, None], other=0.0)
        else:
            in_k = (k0 + offs_k) < K
            x = tl.load(x_ptrs, mask=mask_m[:, None] & in_k[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=mask_n[:, None] & in_k[None, :], other=0.0)
            if GATED:
                w_up = tl.load(w_ptrs + pair_offset * stride_wn, mask=mask_n[:, None] & in_k[None, :],
                               other=0.0)
        if BLOCK_SCALES:  # this K tile's scales, applied to its products only
            part = _tile_product(x, w, tl.zeros_like(acc), SWAP_AB, DOT_F32, WIDEN_PRMT, W8A8)
            scale = tl.load(s_ptrs + (k0 // SCALE_BK) * stride_sk, mask=mask_n, other=0.0)
            acc += part * _along_n(scale.to(tl.float32), SWAP_AB)
            if GATED:
                part = _tile_product(x, w_up, tl.zeros_like(acc), SWAP_AB, DOT_F32, WIDEN_PRMT, W8A8)
                scale = tl.load(s_up_ptrs + (k0 // SCALE_BK) * stride_sk, mask=mask_n, other=0.0)
                acc_up += part * _along_n(scale.to(tl.float32), SWAP_AB)
        else:
            acc = _tile_product(x, w, acc, SWAP_AB, DOT_F32, WIDEN_PRMT, W8A8)
            if GATED:
                acc_up = _tile_product(x, w_up, acc_up, SWAP_AB, DOT_F32, WIDEN_PRMT, W8A8)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if TRIGGER:  # only the epilogues left: the next kernel may launch and wait for them
        tl.extra.cuda.gdc_launch_dependents()
    if not BLOCK_SCALES:
        scale = tl.load(s_ptr + offs_n * stride_sn, mask=mask_n, other=0.0)
        acc = acc * _along_n(scale.to(tl.float32), SWAP_AB)
        if GATED:
            scale = tl.load(s_ptr + (offs_n + pair_offset) * stride_sn, mask=mask_n, other=0.0)
            acc_up = acc_up * _along_n(scale.to(tl.float32), SWAP_AB)
    if W8A8:
        row_scale = tl.load(xs_ptr + offs_m, mask=mask_m, other=0.0)
        if SWAP_AB:
            row_scale = row_scale[None, :]
        else:
            row_scale = row_scale[:, None]
        acc = acc * row_scale
        if GATED:
            acc_up = acc_up * row_scale
    if GATED:  # rounded where the plain launch then the SiLU kernel round (silu_times)
        acc = silu_times(acc, acc_up, out_ptr.dtype.element_ty)
    rows = offs_m.to(tl.int64) * stride_om
    if SWAP_AB:
        offs = offs_n[:, None] + rows[None, :]
        mask = mask_n[:, None] & mask_m[None, :]
    else:
        offs = rows[:, None] + offs_n[None, :]
        mask = mask_m[:, None] & mask_n[None, :]
    if not PARTIAL:
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + pid_k * stride_split + offs, acc, mask=mask)
    if LAST_SUMS:
        # Every thread's partial stored before the count (a release at GPU scope): the program
        # that sees the full count then sees every split's partial of the tile.
        tl.debug_barrier()
        counter = counter_ptr + pid_m * (tl.num_programs(1) - SHRINK_COLS) + pid_n
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # zero for the next launch
            # _split_k_sum's order and rounding, so y is the same bits whichever path sums;
            # .cg: the other splits' partials were written by other SMs (past this one's L1)
            total = tl.zeros_like(acc)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(out_ptr + s * stride_split + offs, mask=mask, other=0.0,
                                 cache_modifier=".cg")
            tl.store(y_ptr + offs, total.to(y_ptr.dtype.element_ty), mask=mask)




@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(
    x_ptr, w_ptr, x_desc, w_desc, s_ptr, xs_ptr, out_ptr, y_ptr, counter_ptr, M, N,
    stride_xm, stride_wn, stride_sn, stride_sk, stride_om, stride_split, pair_offset,
    K: tl.constexpr, K_PER_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_SCALES: tl.constexpr, SCALE_BN: tl.constexpr,
    SCALE_BK: tl.constexpr, DOT_F32: tl.constexpr, PARTIAL: tl.constexpr, EVEN_K: tl.constexpr,
    SWAP_AB: tl.constexpr = False, TMA: tl.constexpr = False, WIDEN_PRMT: tl.constexpr = False,
    W8A8: tl.constexpr = False, SPLIT_K: tl.constexpr = 1, LAST_SUMS: tl.constexpr = False,
    GATED: tl.constexpr = False, PDL: tl.constexpr = False, PREFETCH_K: tl.constexpr = 0,
    TRIGGER: tl.constexpr = False,
    lx_ptr=None, la_ptr=None, lxa_ptr=None, lscale_ptr=None, ltable_ptr=None, stride_lxm=0,
    stride_lxa=0, stride_lseg=0, lrank_col=0, SHRINK_UNITS: tl.constexpr = 0,
    SHRINK_COLS: tl.constexpr = 0, R: tl.constexpr = 16, N_SLICES: tl.constexpr = 1,
    A_ROWS: tl.constexpr = 1, SHRINK_K: tl.constexpr = 128, SHRINK_F32: tl.constexpr = False,
):
    """The GEMM's tiles (_fp8_tile), and with SHRINK_UNITS the programs of a LoRA shrink in
    front of them (fp8_gemm_triton's lora): the first SHRINK_COLS columns of the grid, each
    of their programs one unit (an adapter's segment of rows on one slice, over the whole K)
    of x16 @ A.T, scaled, into xa for the op after the GEMM to expand. They read the 16-bit
    rows (lx) the e4m3 copy was made from: the adapters' shrink is not quantized."""
    if SHRINK_UNITS:
        pid_n = tl.program_id(1)
        if pid_n < SHRINK_COLS:
            if PDL:
                tl.extra.cuda.gdc_wait()  # x is the kernel ahead's output
            unit = (tl.program_id(2) * SHRINK_COLS + pid_n) * tl.num_programs(0) + tl.program_id(0)
            if unit < SHRINK_UNITS:
                _shrink_unit(lx_ptr, lx_ptr, la_ptr, la_ptr, lxa_ptr, lscale_ptr, ltable_ptr, M,
                             stride_lxm, stride_lxa, stride_lseg, lrank_col, unit, K, R, N_SLICES,
                             A_ROWS, 1, SHRINK_K, False, SHRINK_F32)
        else:
            _fp8_tile(
                x_ptr, w_ptr, x_desc, w_desc, s_ptr, xs_ptr, out_ptr, y_ptr, counter_ptr, M, N,
                stride_xm, stride_wn, stride_sn, stride_sk, stride_om, stride_split, pair_offset,
                K, K_PER_SPLIT, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_SCALES, SCALE_BN, SCALE_BK,
                DOT_F32, PARTIAL, EVEN_K, SWAP_AB, TMA, WIDEN_PRMT, W8A8, SPLIT_K, LAST_SUMS,
                GATED, PDL, PREFETCH_K, TRIGGER, SHRINK_COLS, pid_n - SHRINK_COLS)
    else:
        _fp8_tile(
            x_ptr, w_ptr, x_desc, w_desc, s_ptr, xs_ptr, out_ptr, y_ptr, counter_ptr, M, N,
            stride_xm, stride_wn, stride_sn, stride_sk, stride_om, stride_split, pair_offset, K,
            K_PER_SPLIT, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_SCALES, SCALE_BN, SCALE_BK, DOT_F32,
            PARTIAL, EVEN_K, SWAP_AB, TMA, WIDEN_PRMT, W8A8, SPLIT_K, LAST_SUMS, GATED, PDL,
            PREFETCH_K, TRIGGER, 0, tl.program_id(1))


@triton.jit
def _split_k_sum(part_ptr, y_ptr, numel, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """y (contiguous [M, N]) = the sum over splits of the partials [SPLIT_K, M, N], in split
    order, rounded once to y's dtype: the launch after the GEMM's where its programs do not
    sum their tiles themselves (fp8_gemm_triton)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + s * numel + offs, mask=mask, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, BLOCK: tl.constexpr,
                          ONE_PASS: tl.constexpr, PDL: tl.constexpr = False):
    """Row m of x as e4m3 (q) with its float32 scale (s[m] = amax / 448): the division
    correctly rounded and the rounding to nearest even, as kernels/gemm/fp8.py's quantize_rows.
    One program a row, the row read once into registers where BLOCK covers K (a decode
    batch's launch is its latency: one load, one reduction, one store): ONE_PASS, BLOCK >= K;
    else in BLOCK steps and read again (from L2) to quantize. PDL: the GEMM after it may
    launch at once (it asks L2 for its weights, then waits for this kernel), and this one
    waits for the kernel ahead (x) before reading."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    x_row, q_row = x_ptr + row * stride_xm, q_ptr + row * stride_qm
    if ONE_PASS:
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        amax = tl.abs(x)
    else:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            part = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0)
            amax = tl.maximum(amax, tl.abs(part.to(tl.float32)))
    scale = row_scale(tl.max(amax, axis=0), BLOCK)
    tl.store(s_ptr + row + offs, scale, mask=offs < 1)
    if ONE_PASS:
        q = to_e4m3(x, scale)
        tl.store(q_row + offs, q.to(q_ptr.dtype.element_ty), mask=offs < K)
    else:
        for k0 in range(0, K, BLOCK):
            part = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
            q = to_e4m3(part, scale)
            tl.store(q_row + k0 + offs, q.to(q_ptr.dtype.element_ty), mask=k0 + offs < K)


ONE_PASS_K = 16384  # a row up to this many columns is held in registers (32 a thread at 16 warps)


def quantize_rows_triton(x: torch.Tensor, block: int | None = None,
                         pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [M, K] in e4m3, float32 scales [M]) with x ~ e4m3 * scale per row: one launch, the
    W8A8 GEMM's activation operand (kernels/gemm/fp8.py: quantize_rows is the reference).
    block: columns a step (None: the whole row up to ONE_PASS_K); pdl: launched with
    programmatic dependent launch where the device has it (Hopper)."""
    pdl = pdl and hopper(x)
    M, K = x.shape
    q = empty_rows(M, K, dtype=torch.float8_e4m3fn, device=x.device)  # a W8A8 GEMM's x: tma_rows
    scale = torch.empty(M, dtype=torch.float32, device=x.device)
    if M and K:
        block = block or min(triton.next_power_of_2(K), ONE_PASS_K)
        _quantize_rows_kernel[(M,)](x, q, scale, K, x.stride(0), q.stride(0), BLOCK=block,
                                    ONE_PASS=block >= K, PDL=pdl,
                                    num_warps=max(4, min(16, block // 1024)), **pdl_launch(pdl))
    return q, scale


def launch_splits(programs: int, K: int, block_k: int, split_k: int | None, sms: int,
                  split_fill: float = 1.0, split_columns: int = 0) -> tuple[int, int]:
    """(K splits, columns of K a split) of a launch of `programs` output tiles: split_k's,
    else auto_split_k's, cut to what K's tiles allow, no split left without columns."""
    k_tiles = cdiv(K, block_k)
    if split_k is None:
        split_k = auto_split_k(programs, k_tiles, sms, split_fill, split_columns // block_k)
    split_k = max(1, min(split_k, k_tiles))
    k_per_split = cdiv(k_tiles, split_k) * block_k
    return cdiv(K, k_per_split), k_per_split


def auto_split_k(programs: int, k_tiles: int, sms: int, fill: float = 1.0, max_tiles: int = 0) -> int:
    """The fewest K splits (a power of two) that give at least fill x one program per SM and,
    where max_tiles, at most max_tiles K tiles a split; each split keeping
    MIN_K_TILES_PER_SPLIT K tiles."""
    split = 1
    while ((programs * split < fill * sms or (max_tiles and k_tiles > max_tiles * split))
           and k_tiles // (2 * split) >= MIN_K_TILES_PER_SPLIT):
        split *= 2
    return split


COUNTER_TILES = 4096  # output tiles a split launch can count (8B decode splits 64 to 96)
# The most rows a tile (BLOCK_M) has where its last program sums the splits. H200, 8B widths,
# replays of a graph of split launches: 0.1 to 1 us faster than the sum launch at 1 to 16 rows;
# at 48 and 64 rows, where the one program reads SPLIT_K float32 tiles of 64 rows, 0.1 to 1.4
# us slower (W8A8's o worst), and mixed at 24 and 32.
LAST_SUMS_MAX_ROWS = 16


def tile_counters(device: torch.device) -> torch.Tensor | None:
    """The device's arrival counters of split launches (host.arrival_counts): COUNTER_TILES
    int32 zeros, left zero by each launch's last programs, so a replay needs no clearing.
    Shared by every split launch on the device: two must not run at once (the node runs them
    on one stream, one after another). None during a graph capture before they exist:
    _split_k_sum sums that launch."""
    return arrival_counts(device, "fp8_gemm", COUNTER_TILES)


def tma_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether TMA descriptors can address x [M, K] and weight [N, K]: 16-byte aligned bases
    and row strides (a K of one byte a weight that is a multiple of 16), K contiguous."""
    return (x.stride(1) == 1 and weight.stride(1) == 1 and x.data_ptr() % 16 == 0
            and weight.data_ptr() % 16 == 0 and (x.stride(0) * x.element_size()) % 16 == 0
            and weight.stride(0) % 16 == 0)


def descriptors(x: torch.Tensor, weight: torch.Tensor, block_m: int, block_n: int,
                block_k: int) -> tuple[object, object] | tuple[None, None]:
    """TMA descriptors of x [M, K] and weight [N, K] for [block_m, block_k] and [block_n,
    block_k] tiles where TMA runs them (Hopper, or Triton's interpreter, and tma_fits); else
    (None, None): the pointer loads."""
    if not (tma_fits(x, weight) and (hopper(x) or interpreting())):
        return None, None
    from triton.tools.tensor_descriptor import TensorDescriptor

    (M, K), N = x.shape, weight.shape[0]
    return (TensorDescriptor(x, [tma_rows(x, block_m), K], [x.stride(0), 1], [block_m, block_k]),
            TensorDescriptor(weight, [N, K], [weight.stride(0), 1], [block_n, block_k]))


def fp8_gemm_triton(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                    block: tuple[int, int] | None, *, block_m: int | None = None,
                    block_n: int = 64, block_k: int = 128, split_k: int | None = None,
                    num_warps: int = 4, num_stages: int = 4, swap_ab: bool = False,
                    tma: bool = False, widen_prmt: bool = False,
                    x_scale: torch.Tensor | None = None,
                    out_dtype: torch.dtype | None = None, gated: bool = False,
                    leave_sums: bool = False, split_fill: float = 1.0,
                    split_columns: int = 0, pdl: bool = False,
                    prefetch_k: int = 0, trigger: bool = False, lora: GemmLora | None = None,
                    x16: torch.Tensor | None = None) -> "torch.Tensor | SplitSums":
    """x [M, K] (bf16/fp16/fp32, K contiguous) @ dequant(weight [N, K] float8_e4m3fn, K
    contiguous).T -> [M, N] in x's dtype. W8A8: x is e4m3 too, x_scale its float32 scale a row
    [M] (quantize_rows_triton), out_dtype the result's. scale: float32 [N] (block None), else
    [ceil(N/block[0]), ceil(K/block[1])] with block_k dividing block[1]. block_m: rows a program
    takes (None: every row of a decode batch, up to MAX_BLOCK_M; at least 16, the tensor cores'
    smallest); split_k: programs sharing a tile's K range (None: auto_split_k, split_fill x one
    program per SM, at most split_columns of K a split where given). swap_ab: each tile computed
    as W @ x.T (the widened weight the MMA's register operand); tma: tiles fetched by the tensor
    memory accelerator where the device has one (Hopper) and tma_fits, else by pointer loads;
    widen_prmt: e4m3 -> bf16 by E4M3_TO_BF16_ASM for bf16 x on a compiled GPU (Triton's
    conversion elsewhere). gated: weight is gate/up's [gate; up] (2 I rows) and the result
    SiLU(x @ gate.T) * (x @ up.T), [M, I], with no SiLU launch after it: block_n columns of each
    half a program, K never split (the SiLU needs a column's whole sum). leave_sums: where the
    splits would be summed by a launch of their own, SplitSums instead (the next kernel sums).
    pdl: launched with programmatic dependent launch where the device has it (Hopper), each
    program first asking L2 for prefetch_k columns (a multiple of 128) of its weight slab.
    trigger: a PDL launch after this one may start once the K loops are done (TRIGGER; Hopper).
    lora (expand False, shrink_fits): the adapters' shrink of the 16-bit rows x16 (x itself
    when x is 16-bit) computed by programs of this launch, its rows stored in lora.xa for the
    op after the GEMM to expand: no shrink launch, nor a side stream, in the decode step."""
    M, K = x.shape
    N = weight.shape[0] // 2 if gated else weight.shape[0]
    pdl = pdl and hopper(x)
    trigger = trigger and hopper(x)
    if weight.shape[1] != K or weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"weight {tuple(weight.shape)} {weight.dtype}: expected [N, {K}] float8_e4m3fn")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight must be contiguous along K")
    if block is not None and block[1] % block_k:
        raise ValueError(f"block_k {block_k} must divide the scale block's {block[1]} columns")
    w8a8 = x_scale is not None
    if w8a8 and (x.dtype != torch.float8_e4m3fn or out_dtype is None):
        raise ValueError("W8A8 takes x in float8_e4m3fn, its row scales and an out_dtype")
    if gated and weight.shape[0] % 2:
        raise ValueError(f"a gated weight stacks gate and up: {weight.shape[0]} rows are not two halves")
    y = empty_rows(M, N, dtype=out_dtype or x.dtype, device=x.device)  # gate/up's: down's x
    if M == 0 or N == 0:
        return y
    block_m = block_m or min(row_tile(M), MAX_BLOCK_M)
    tiles_m, tiles_n = cdiv(M, block_m), cdiv(N, block_n)
    split_k, k_per_split = launch_splits(tiles_m * tiles_n, K, block_k, 1 if gated else split_k,
                                         num_sms(x.device), split_fill, split_columns)
    partial = split_k > 1
    out = torch.empty(split_k, M, N, dtype=torch.float32, device=x.device) if partial else y
    counters = tile_counters(x.device) if partial and block_m <= LAST_SUMS_MAX_ROWS else None
    last_sums = counters is not None and tiles_m * tiles_n <= counters.numel()
    if block is None:
        scale_bn, scale_bk, stride_sn, stride_sk = 1, 1, scale.stride(0), 0
    else:
        (scale_bn, scale_bk), (stride_sn, stride_sk) = block, scale.stride()
    f32 = dot_f32(y.dtype if w8a8 else x.dtype, x.device)
    shrink = shrink_arguments(lora, x if x16 is None else x16, tiles_m * split_k)
    x_desc, w_desc = descriptors(x, weight, block_m, block_n, block_k) if tma else (None, None)
    constants = dict(
        K=K, K_PER_SPLIT=k_per_split, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        BLOCK_SCALES=block is not None, SCALE_BN=scale_bn, SCALE_BK=scale_bk,
        DOT_F32=f32, PARTIAL=partial, EVEN_K=K % block_k == 0, SWAP_AB=swap_ab,
        TMA=x_desc is not None, WIDEN_PRMT=widen_prmt and x.dtype == torch.bfloat16 and not f32,
        W8A8=w8a8, SPLIT_K=split_k, LAST_SUMS=last_sums, GATED=gated, num_warps=num_warps,
        PDL=pdl, PREFETCH_K=min(prefetch_k, k_per_split) // 128 * 128 if pdl else 0, **pdl_launch(pdl),
        TRIGGER=trigger, **shrink)
    # What sizes the pipeline's shared memory; no lookup at all until a launch has not fitted.
    pipeline = (x.device, x.dtype, block_m, block_n, block_k, num_stages, w8a8, gated, swap_ab, tma)
    stages = _FITTED_STAGES.get(pipeline, num_stages) if _FITTED_STAGES else num_stages
    while True:
        try:
            _fp8_gemm_kernel[(tiles_m, tiles_n + shrink.get("SHRINK_COLS", 0), split_k)](
                x, weight, x_desc, w_desc, scale, x_scale, out, y, counters if last_sums else None, M, N,
                x.stride(0), weight.stride(0), stride_sn, stride_sk, N, M * N, N, **constants,
                num_stages=stages)
            break
        except OutOfResources:  # raised before the launch: nothing ran
            if stages == 1:
                raise
            stages -= 1
            _FITTED_STAGES[pipeline] = stages
    if partial and not last_sums:
        if leave_sums:
            return SplitSums(out, y.dtype)
        split_k_total(out, y.dtype, y)
    return y


def shrink_arguments(lora: GemmLora | None, x16: torch.Tensor, programs_a_column: int) -> dict:
    """The kernel's keywords for `lora`'s shrink programs over x16: one a (segment, slice),
    in as many grid columns in front of the tiles as they fill (programs_a_column: the grid's
    row tiles x K splits)."""
    if lora is None or lora.segments == 0:
        return {}
    if not shrink_fits(lora, x16):
        raise ValueError("this LoRA shrink does not fit the FP8 GEMM's launch (shrink_fits)")
    units = lora.segments * lora.slices
    a2d = lora.a_all.reshape(-1, x16.shape[1])
    assert a2d.stride(1) == 1 and lora.xa.stride(1) == 1
    k = x16.shape[1]
    return dict(lx_ptr=x16, la_ptr=a2d, lxa_ptr=lora.xa, lscale_ptr=lora.scaling,
                ltable_ptr=lora.segment_table, stride_lxm=x16.stride(0), stride_lxa=lora.xa.stride(0),
                stride_lseg=lora.segment_table.stride(0), lrank_col=lora.rank_col, SHRINK_UNITS=units,
                SHRINK_COLS=cdiv(units, programs_a_column), R=lora.rank, N_SLICES=lora.slices,
                A_ROWS=lora.a_all.shape[1], SHRINK_K=next(b for b in (128, 64, 32, 16) if k % b == 0),
                SHRINK_F32=dot_f32(x16.dtype, x16.device))


# A launch's pipeline stages, cut to what the GPU's shared memory holds, by the tiles and stages
# it was asked (tables are tuned in 16-bit types; a float32 node's x tiles are twice as large).
# Another kernel variant of the same tiles may then start lower than it needed: slower, never
# refused, since each launch still steps down until it fits.
_FITTED_STAGES: dict[tuple, int] = {}


def split_k_total(parts: torch.Tensor, dtype: torch.dtype, y: torch.Tensor | None = None) -> torch.Tensor:
    """The sum of float32 partials [SPLIT_K, M, N] over splits, in split order, in `dtype` (into
    y where given): _split_k_sum's launch."""
    split_k, M, N = parts.shape
    if y is None:
        y = torch.empty(M, N, dtype=dtype, device=parts.device)
    sum_block = 1024
    if M * N:
        _split_k_sum[(cdiv(M * N, sum_block),)](parts, y, M * N, SPLIT_K=split_k, BLOCK=sum_block,
                                               num_warps=4)
    return y
