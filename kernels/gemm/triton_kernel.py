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
from .shapes import MAX_ROWS, row_tile, tma_fits


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the lines at `ptrs` (no registers filled, nothing waited for)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit(do_not_specialize=["M"])
def _decode_gemm_kernel(
    x_ptr, w_ptr, y_ptr, M,
    stride_xm, stride_wn, stride_wk, stride_ym, up_first,
    K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr, PREFETCH_K: tl.constexpr, LINE: tl.constexpr, DOT_F32: tl.constexpr,
    EARLY_TRIGGER: tl.constexpr = False, GATED: tl.constexpr = False,
):
    """GATED: W is gate/up's [gate; up] (up from output column up_first) and each program
    writes SiLU(x @ gate) * (x @ up) for its BLOCK_N columns of both."""
    pid = tl.program_id(0)
    offs_n = (pid * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    if PDL:
        if PREFETCH_K > 0:
            # One prefetch per 128-byte line of the slab's first PREFETCH_K columns (W is
            # [out, in] here: each of the slab's rows is contiguous).
            lines = tl.arange(0, PREFETCH_K // LINE) * LINE
            prefetch_l2(w_ptr + offs_n[:, None] * stride_wn + lines[None, :] * stride_wk)
            if GATED:
                prefetch_l2(w_ptr + (up_first + offs_n[:, None]) * stride_wn + lines[None, :] * stride_wk)
        tl.extra.cuda.gdc_wait()  # the input rows are the previous kernel's output
        if EARLY_TRIGGER:  # every program runs: the next kernel may launch and wait
            tl.extra.cuda.gdc_launch_dependents()
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn  # [K, N] tile
    mask_m = offs_m[:, None] < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # GATED only
    for _ in range(0, K, BLOCK_K):
        x = tl.load(x_ptrs, mask=mask_m, other=0.0)
        w = tl.load(w_ptrs)
        if DOT_F32:  # kernels/host.py: dot_f32
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, w)
        if GATED:
            w_up = tl.load(w_ptrs + up_first * stride_wn)
            if DOT_F32:
                acc_up += tl.dot(x.to(tl.float32), w_up.to(tl.float32), input_precision="ieee")
            else:
                acc_up += tl.dot(x, w_up)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    if PDL and not EARLY_TRIGGER:  # the next kernel may launch now (it waits for this one)
        tl.extra.cuda.gdc_launch_dependents()
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    if GATED:
        tl.store(y_ptrs, silu_times(acc, acc_up, y_ptr.dtype.element_ty), mask=mask_m)
    else:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m)


@triton.jit(do_not_specialize=["M"])
def _decode_gemm_tma_kernel(
    x_desc, w_desc, w_ptr, y_ptr, M, stride_wn, stride_ym, up_first,
    K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr, PREFETCH_K: tl.constexpr, LINE: tl.constexpr, DOT_F32: tl.constexpr,
    EARLY_TRIGGER: tl.constexpr = False, GATED: tl.constexpr = False,
):
    """The same product with the tiles fetched by the tensor memory accelerator (Hopper): one
    copy instruction a tile, where the pointer loads issue one per 16 bytes per thread and
    left the SM issue-bound (ncu, down projection: 1 warp per scheduler, 3.7 cycles between
    issues, DRAM at 47% of peak). Rows past M read as zero. GATED as in the pointer kernel."""
    pid = tl.program_id(0)
    n0 = pid * BLOCK_N
    offs_n = (n0 + tl.arange(0, BLOCK_N)).to(tl.int64)
    if PDL:
        if PREFETCH_K > 0:
            lines = tl.arange(0, PREFETCH_K // LINE) * LINE
            prefetch_l2(w_ptr + offs_n[:, None] * stride_wn + lines[None, :])
            if GATED:
                prefetch_l2(w_ptr + (up_first + offs_n[:, None]) * stride_wn + lines[None, :])
        tl.extra.cuda.gdc_wait()
        if EARLY_TRIGGER:
            tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # GATED only
    for k0 in range(0, K, BLOCK_K):
        x = x_desc.load([0, k0])
        w = w_desc.load([n0, k0])  # [BLOCK_N, BLOCK_K] of W [out, in]
        if DOT_F32:  # kernels/host.py: dot_f32
            acc += tl.dot(x, w.T, input_precision="ieee")
        else:
            acc += tl.dot(x, w.T)
        if GATED:
            w_up = w_desc.load([up_first + n0, k0])
            if DOT_F32:
                acc_up += tl.dot(x, w_up.T, input_precision="ieee")
            else:
                acc_up += tl.dot(x, w_up.T)
    if PDL and not EARLY_TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    offs_m = tl.arange(0, BLOCK_M)
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    if GATED:
        tl.store(y_ptrs, silu_times(acc, acc_up, y_ptr.dtype.element_ty), mask=offs_m[:, None] < M)
    else:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=offs_m[:, None] < M)


def decode_gemm_tma(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, *,
                    pdl: bool = False, prefetch_k: int = 0, block_n: int = 16, block_k: int = 128,
                    num_warps: int = 4, num_stages: int = 4,
                    early_trigger: bool = False, gated: bool = False) -> torch.Tensor:
    """decode_gemm_triton with TMA tile loads (CUDA, Hopper or newer; tma_fits(x, w))."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    M, K = x.shape
    N = w.shape[1]
    w_out_in = w.t()
    assert tma_fits(x, w) and M <= MAX_ROWS
    cols = _output_columns(N, block_n, K, block_k, gated)
    y = out if out is not None else torch.empty(M, cols, dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    block_m = row_tile(M)
    x_desc = TensorDescriptor(x, [M, K], [x.stride(0), 1], [block_m, block_k])
    w_desc = TensorDescriptor(w_out_in, [N, K], [K, 1], [block_n, block_k])
    _decode_gemm_tma_kernel[(cols // block_n,)](
        x_desc, w_desc, w_out_in, y, M, K, y.stride(0), cols,
        K=K, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PDL=pdl,
        PREFETCH_K=min(prefetch_k, K) if pdl else 0, LINE=128 // w.element_size(),
        DOT_F32=dot_f32(x.dtype, x.device), EARLY_TRIGGER=pdl and early_trigger, GATED=gated,
        num_warps=num_warps, num_stages=num_stages, **pdl_launch(pdl),
    )
    return y


def _output_columns(N: int, block_n: int, K: int, block_k: int, gated: bool) -> int:
    """Columns the launch writes: N, or with `gated` half of them (SiLU(gate) * up)."""
    cols = N // 2 if gated else N
    assert N % (2 if gated else 1) == 0 and cols % block_n == 0 and K % block_k == 0, \
        "tiles must divide the weight (each half of it, gated)"
    return cols


def decode_gemm_triton(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, *,
                       pdl: bool = False, prefetch_k: int = 0, block_n: int = 16,
                       block_k: int = 128, num_warps: int = 4, num_stages: int = 4,
                       early_trigger: bool = False, gated: bool = False) -> torch.Tensor:
    """x [M, K] @ w [K, N] for M <= MAX_ROWS (w may be a transposed view of an [N, K] matrix).
    pdl: launch with programmatic dependent launch (CUDA, Hopper or newer only); prefetch_k:
    columns of each program's slab asked of L2 before the wait (a multiple of 64);
    early_trigger (with pdl): the next kernel may launch once every program is past its wait
    (with several waves of tiles: once the last wave has started), not after the main loops;
    gated: w is gate/up's [gate | up] and the launch writes SiLU(x @ gate) * (x @ up), [M, N / 2]
    (block_n columns of each half a program), with no SiLU launch after it."""
    M, K = x.shape
    N = w.shape[1]
    assert w.shape[0] == K and x.stride(1) == 1 and M <= MAX_ROWS
    cols = _output_columns(N, block_n, K, block_k, gated)
    y = out if out is not None else torch.empty(M, cols, dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    line = 128 // w.element_size()
    if w.stride(0) != 1:  # [in, out] layout: a slab's rows are not contiguous lines
        prefetch_k = 0
    _decode_gemm_kernel[(cols // block_n,)](
        x, w, y, M, x.stride(0), w.stride(1), w.stride(0), y.stride(0), cols,
        K=K, BLOCK_M=row_tile(M), BLOCK_N=block_n, BLOCK_K=block_k,
        PDL=pdl, PREFETCH_K=min(prefetch_k, K) if pdl else 0, LINE=line,
        DOT_F32=dot_f32(x.dtype, x.device), EARLY_TRIGGER=pdl and early_trigger, GATED=gated,
        num_warps=num_warps, num_stages=num_stages, **pdl_launch(pdl),
    )
    return y
