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
SMs: SPLIT_K programs share each tile's K range and write float32 partials that a second small
launch sums in a fixed order (deterministic, so replays are bit-identical). Rows past one tile
(prefill) get programs of their own, the row tile fastest so that the programs running
together share their weight tile in L2.

Everything is sized from shapes, nothing from data: a CUDA graph captures both launches.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..host import cdiv, dot_f32, num_sms
from .shapes import row_tile

MAX_BLOCK_M = 64  # rows a program's tile holds by default; more rows get more programs
MIN_K_TILES_PER_SPLIT = 4  # a split's K range keeps a few tiles to pipeline


@triton.jit
def _dot_wt(x, w, acc, DOT_F32: tl.constexpr):
    """acc + x @ w.T for x [BLOCK_M, BLOCK_K] and w [BLOCK_N, BLOCK_K] e4m3, w widened to x's
    type (exact), or both to float32 with DOT_F32 (kernels/host.py: dot_f32)."""
    if DOT_F32:
        return tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    return tl.dot(x, tl.trans(w.to(x.dtype)), acc)


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, M, N,
    stride_xm, stride_wn, stride_sn, stride_sk, stride_om, stride_split,
    K: tl.constexpr, K_PER_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_SCALES: tl.constexpr, SCALE_BN: tl.constexpr,
    SCALE_BK: tl.constexpr, DOT_F32: tl.constexpr, PARTIAL: tl.constexpr, EVEN_K: tl.constexpr,
):
    """Program (m tile, n tile, K split). PARTIAL: out is the float32 partials [SPLIT_K, M, N]
    (split stride stride_split), summed by _split_k_sum; else out is y and gets x's dtype.
    BLOCK_SCALES: s is [ceil(N/SCALE_BN), ceil(K/SCALE_BK)] and BLOCK_K divides SCALE_BK; else
    s is [N] (stride stride_sn). EVEN_K: BLOCK_K divides K (no column mask)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
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
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0)  # [BLOCK_N, BLOCK_K] e4m3
        else:
            in_k = (k0 + offs_k) < K
            x = tl.load(x_ptrs, mask=mask_m[:, None] & in_k[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=mask_n[:, None] & in_k[None, :], other=0.0)
        if BLOCK_SCALES:  # this K tile's scales, applied to its products only
            part = _dot_wt(x, w, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), DOT_F32)
            scale = tl.load(s_ptrs + (k0 // SCALE_BK) * stride_sk, mask=mask_n, other=0.0)
            acc += part * scale.to(tl.float32)[None, :]
        else:
            acc = _dot_wt(x, w, acc, DOT_F32)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if not BLOCK_SCALES:
        scale = tl.load(s_ptr + offs_n * stride_sn, mask=mask_n, other=0.0)
        acc = acc * scale.to(tl.float32)[None, :]
    out_ptrs = (out_ptr + pid_k * stride_split + offs_m[:, None].to(tl.int64) * stride_om
                + offs_n[None, :])
    mask = mask_m[:, None] & mask_n[None, :]
    if PARTIAL:
        tl.store(out_ptrs, acc, mask=mask)
    else:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _split_k_sum(part_ptr, y_ptr, numel, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """y (contiguous [M, N]) = the sum over splits of the partials [SPLIT_K, M, N], in split
    order, rounded once to y's dtype."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + s * numel + offs, mask=mask, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def auto_split_k(programs: int, k_tiles: int, sms: int) -> int:
    """The fewest K splits (a power of two) that give at least one program per SM, each split
    keeping MIN_K_TILES_PER_SPLIT K tiles."""
    split = 1
    while programs * split < sms and k_tiles // (2 * split) >= MIN_K_TILES_PER_SPLIT:
        split *= 2
    return split


def fp8_gemm_triton(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                    block: tuple[int, int] | None, *, block_m: int | None = None,
                    block_n: int = 64, block_k: int = 128, split_k: int | None = None,
                    num_warps: int = 4, num_stages: int = 4) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32, K contiguous) @ dequant(weight [N, K] float8_e4m3fn, K
    contiguous).T -> [M, N] in x's dtype. scale: float32 [N] (block None), else
    [ceil(N/block[0]), ceil(K/block[1])] with block_k dividing block[1]. block_m: rows a
    program takes (None: every row of a decode batch, up to MAX_BLOCK_M; at least 16, the
    tensor cores' smallest); split_k: programs sharing a tile's K range (None: enough to give
    every SM a program, auto_split_k)."""
    M, K = x.shape
    N = weight.shape[0]
    if weight.shape[1] != K or weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"weight {tuple(weight.shape)} {weight.dtype}: expected [N, {K}] float8_e4m3fn")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight must be contiguous along K")
    if block is not None and block[1] % block_k:
        raise ValueError(f"block_k {block_k} must divide the scale block's {block[1]} columns")
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    block_m = block_m or min(row_tile(M), MAX_BLOCK_M)
    tiles_m, tiles_n, k_tiles = cdiv(M, block_m), cdiv(N, block_n), cdiv(K, block_k)
    if split_k is None:
        split_k = auto_split_k(tiles_m * tiles_n, k_tiles, num_sms(x.device))
    split_k = max(1, min(split_k, k_tiles))
    k_per_split = cdiv(k_tiles, split_k) * block_k
    split_k = cdiv(K, k_per_split)  # no split left without columns
    partial = split_k > 1
    out = torch.empty(split_k, M, N, dtype=torch.float32, device=x.device) if partial else y
    if block is None:
        scale_bn, scale_bk, stride_sn, stride_sk = 1, 1, scale.stride(0), 0
    else:
        (scale_bn, scale_bk), (stride_sn, stride_sk) = block, scale.stride()
    _fp8_gemm_kernel[(tiles_m, tiles_n, split_k)](
        x, weight, scale, out, M, N,
        x.stride(0), weight.stride(0), stride_sn, stride_sk, N, M * N,
        K=K, K_PER_SPLIT=k_per_split, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        BLOCK_SCALES=block is not None, SCALE_BN=scale_bn, SCALE_BK=scale_bk,
        DOT_F32=dot_f32(x.dtype, x.device), PARTIAL=partial, EVEN_K=K % block_k == 0,
        num_warps=num_warps, num_stages=num_stages,
    )
    if partial:
        sum_block = 1024
        _split_k_sum[(cdiv(M * N, sum_block),)](out, y, M * N, SPLIT_K=split_k, BLOCK=sum_block,
                                               num_warps=4)
    return y
