"""Rows to e4m3 with one float32 scale a row, quantize_rows's math bit for bit (the scale amax /
448 correctly rounded, each element divided correctly rounded and rounded to the nearest e4m3):
the pieces the row quantizer (fp8_triton_kernel.py) is made of, and the same done inside the
kernel that writes the rows (the residual add + RMSNorm: quantize_stored_row), so the W8A8
GEMM after it needs no quantizing launch (kernels/gemm/fp8.py: Fp8Rows)."""
from __future__ import annotations

import triton
import triton.language as tl

E4M3_MAX = tl.constexpr(448.0)
MIN_AMAX = tl.constexpr(1e-12)  # an all-zero row's amax (quantize_rows's clamp)


@triton.jit
def round_to_e4m3(v):
    """float32 v (|v| <= 448) rounded to the nearest e4m3 value, ties to even, still float32:
    adding and taking back 1.5 * 2^(e + 20) (e: v's exponent, at least e4m3's -6) leaves |v|
    rounded to a multiple of 2^(e - 3), e4m3's spacing there (3 mantissa bits), and v's sign
    goes back on after (a tiny negative v is -0, as torch rounds it). The cast to fp8 after it
    is then exact on every path: Triton's interpreter rounds float32 -> e4m3 wrongly where the
    mantissa carries into the exponent (124.3 -> 64, not 128)."""
    bits = v.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    magic = (((exponent + 147) << 23) | 0x400000).to(tl.float32, bitcast=True)
    rounded = (tl.abs(v) + magic) - magic
    # the sign bit ORed back (Triton compiles -x as 0 - x, which turns -0 into +0)
    return (rounded.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def row_scale(amax, BLOCK: tl.constexpr):
    """A row's scale from its largest magnitude (a float32 scalar), amax / 448 correctly
    rounded, as a [BLOCK] vector (div_rn takes tensors)."""
    zero = tl.zeros((BLOCK,), dtype=tl.float32)
    return tl.math.div_rn(zero + tl.maximum(amax, MIN_AMAX), zero + E4M3_MAX)


@triton.jit
def to_e4m3(x, scale):
    """float32 x divided by its row's scale, correctly rounded, clamped and rounded to e4m3."""
    return round_to_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -E4M3_MAX), E4M3_MAX))


@triton.jit
def quantize_stored_row(x_row, q_row, s_ptr, amax, K, BLOCK: tl.constexpr):
    """Row x_row [K], already stored, whose largest magnitude is amax (a float32 scalar), as
    e4m3 into q_row, its scale into s_ptr. The caller stored the row with BLOCK-wide steps
    (each thread reads back what it wrote, after a barrier for good measure)."""
    offs = tl.arange(0, BLOCK)
    scale = row_scale(amax, BLOCK)
    tl.store(s_ptr + offs, scale, mask=offs < 1)
    tl.debug_barrier()
    for k0 in range(0, K, BLOCK):
        mask = k0 + offs < K
        x = tl.load(x_row + k0 + offs, mask=mask, other=0.0)
        q = to_e4m3(x.to(tl.float32), scale)
        tl.store(q_row + k0 + offs, q.to(q_row.dtype.element_ty), mask=mask)


@triton.jit
def quantize_row(x, q_row, s_ptr, offs, mask, BLOCK: tl.constexpr):
    """A row held whole in registers (float32 x [BLOCK], masked columns zero) as e4m3 into
    q_row at offs, its scale into s_ptr: quantize_stored_row's bits without reading it back."""
    scale = row_scale(tl.max(tl.abs(x), axis=0), BLOCK)
    tl.store(s_ptr + offs, scale, mask=offs < 1)
    tl.store(q_row + offs, to_e4m3(x, scale).to(q_row.dtype.element_ty), mask=mask)
