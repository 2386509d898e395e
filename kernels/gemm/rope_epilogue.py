"""The ROPE epilogue of q/k/v's decode GEMM (triton_kernel.py): what kernels/rope's launch
does after a plain q/k/v GEMM, done on the GEMM's accumulators instead, with no q/k/v written
and read back.

A program holds BLOCK_N columns of the first half of one head and the same columns of its
second half (the pairs RoPE's rotate_half mixes). The families' options follow the unfused
path's rounding points, so the launch writes what the GEMM then the RoPE kernel write:
- BIAS (Qwen2/2.5's q/k/v bias): added to the float32 accumulator and rounded once to the
  output dtype, as a biased matmul (cuBLAS's addmm) rounds its output;
- QK_NORM (Qwen3, Gemma 3: UNIT_OFFSET for Gemma's (1 + w)): each query and key head
  RMS-normalised in float32 over its D columns before the rotation, then weighted and rounded
  as kernels/rope's kernel does (kernels/norm: _weigh). The sum of squares needs the whole
  head, so such a launch takes BLOCK_N = D / 2 (kernels/gemm/shapes.py: whole_head_tiling);
  value heads are not normalised.
Everything an epilogue reads besides the accumulators is a step input or a weight, not the
kernel ahead's output, so the kernels read it before their wait (rope_tables, rope_reads).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..norm.triton_kernel import _weigh


@triton.jit
def rope_tables(M, pid, cos_ptr, sin_ptr, pos_ptr, stride_cos, HQ: tl.constexpr, HKV: tl.constexpr,
                D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Its rows' cos and sin for its columns of both halves (ones and zeros for value heads):
    read before the wait, the dependent loads (positions, then the tables) hide under the
    weight stream. Not with QK_NORM (rope_store reads them, rope_trig)."""
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
    return c1, s1, c2, s2


@triton.jit
def rope_trig(M, pid, cos_ptr, sin_ptr, pos_ptr, stride_cos, SECOND: tl.constexpr,
              HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr):
    """rope_tables' cos and sin of one half: the first, or the SECOND (rope_store with
    QK_NORM reads them one half at a time)."""
    HALF: tl.constexpr = D // 2
    per_half: tl.constexpr = HALF // BLOCK_N
    head = pid // per_half
    offs_d = (pid % per_half) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    rows = offs_m < M
    if head < HQ + HKV:
        pos = tl.load(pos_ptr + offs_m, mask=rows, other=0)
        trig = pos[:, None] * stride_cos + offs_d[None, :] + (HALF if SECOND else 0)
        c = tl.load(cos_ptr + trig, mask=rows[:, None], other=0.0)
        s = tl.load(sin_ptr + trig, mask=rows[:, None], other=0.0)
    else:
        c = tl.full((BLOCK_M, BLOCK_N), 1.0, tl.float32)
        s = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    return c, s


@triton.jit
def rope_reads(M, pid, q_ptr, k_ptr, v_ptr, slot_ptr, bias_ptr, qn_ptr, kn_ptr, stride_qt, stride_qh,
               stride_kb, stride_kp, stride_kh, stride_vb, stride_vp, stride_vh, page,
               HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BIAS: tl.constexpr, QK_NORM: tl.constexpr):
    """Where the program stores, the bias of its columns and the norm weights of its head (ones
    for value heads, never applied): read before the wait."""
    HALF: tl.constexpr = D // 2
    per_half: tl.constexpr = HALF // BLOCK_N
    head = pid // per_half
    offs_d = (pid % per_half) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    rows = offs_m < M
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
    if BIAS:  # the head's columns d0.. of each half, in the weight's column order
        b1 = tl.load(bias_ptr + head * D + offs_d).to(tl.float32)
        b2 = tl.load(bias_ptr + head * D + HALF + offs_d).to(tl.float32)
    else:
        b1 = tl.zeros((BLOCK_N,), tl.float32)
        b2 = b1
    if QK_NORM:  # BLOCK_N == HALF: offs_d is the whole first half
        if head < HQ:
            w1 = tl.load(qn_ptr + offs_d)
            w2 = tl.load(qn_ptr + HALF + offs_d)
        elif head < HQ + HKV:
            w1 = tl.load(kn_ptr + offs_d)
            w2 = tl.load(kn_ptr + HALF + offs_d)
        else:
            w1 = tl.full((BLOCK_N,), 1.0, qn_ptr.dtype.element_ty)
            w2 = w1
    else:
        w1 = tl.zeros((BLOCK_N,), tl.float32)
        w2 = w1
    return dst + offs_d[None, :], b1, b2, w1, w2


@triton.jit
def rope_store(acc1, acc2, M, pid, c1, s1, c2, s2, b1, b2, w1, w2, dst, norm_eps, cos_ptr, sin_ptr,
               pos_ptr, stride_cos, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BIAS: tl.constexpr,
               QK_NORM: tl.constexpr, UNIT_OFFSET: tl.constexpr):
    """acc1 and acc2 hold the program's columns of the first and second half of one head.
    Rounded to the output dtype first (with the bias added in float32 where BIAS: as the
    plain launch, or a biased matmul, stores them for the RoPE kernel), normalised where
    QK_NORM (query and key heads), rotated for query and key heads in float32 as kernels/rope
    does ((x1, x2) -> (x1 c1 - x2 s1, x2 c2 + x1 s2)), and stored at dst (rope_reads):
    queries to their buffer, keys and values to their rows' cache slots.

    With QK_NORM the program holds a whole head, and its tables (c1 .. s2 unused) are read
    here, one half's at a time: held through the main loop, or all four at once, a whole
    head's at 64 rows took the launch past 255 registers a thread (ptxas, sm_90)."""
    HALF: tl.constexpr = D // 2
    rows = tl.arange(0, BLOCK_M) < M
    dtype = dst.dtype.element_ty
    if BIAS:
        acc1 = acc1 + b1[None, :]
        acc2 = acc2 + b2[None, :]
    x1 = acc1.to(dtype).to(tl.float32)
    x2 = acc2.to(dtype).to(tl.float32)
    if QK_NORM:
        head = pid // (HALF // BLOCK_N)
        if head < HQ + HKV:  # the head's RMS over its D columns (kernels/rope's sum, rstd)
            rstd = 1.0 / tl.sqrt(tl.sum(x1 * x1 + x2 * x2, axis=1) / D + norm_eps)
            x1 = _weigh(x1.to(dtype), rstd[:, None], w1[None, :], UNIT_OFFSET).to(dtype).to(tl.float32)
            x2 = _weigh(x2.to(dtype), rstd[:, None], w2[None, :], UNIT_OFFSET).to(dtype).to(tl.float32)
        c1, s1 = rope_trig(M, pid, cos_ptr, sin_ptr, pos_ptr, stride_cos, False, HQ, HKV, D, BLOCK_M,
                           BLOCK_N)
        tl.store(dst, (x1 * c1 - x2 * s1).to(dtype), mask=rows[:, None])
        c2, s2 = rope_trig(M, pid, cos_ptr, sin_ptr, pos_ptr, stride_cos, True, HQ, HKV, D, BLOCK_M,
                           BLOCK_N)
        tl.store(dst + HALF, (x2 * c2 + x1 * s2).to(dtype), mask=rows[:, None])
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
        tl.store(dst, y1.to(dtype), mask=rows[:, None])
        tl.store(dst + HALF, y2.to(dtype), mask=rows[:, None])
