"""Row quantization inside the kernel that writes the rows (the residual add + RMSNorm): its
rows leave in e4m3 too, one float32 scale a row, so the W8A8 GEMM after them needs
no quantizing launch (kernels/gemm/fp8.py: Fp8Rows). The math is quantize_rows's, bit for bit:
the scale amax / 448 correctly rounded, each element divided correctly rounded and rounded to
the nearest e4m3 (round_to_e4m3)."""
from __future__ import annotations

import triton
import triton.language as tl

from .fp8_triton_kernel import round_to_e4m3

E4M3_MAX = tl.constexpr(448.0)
MIN_AMAX = tl.constexpr(1e-12)  # an all-zero row's amax (quantize_rows's clamp)


@triton.jit
def quantize_stored_row(x_row, q_row, s_ptr, amax, K, BLOCK: tl.constexpr):
    """Row x_row [K], already stored, whose largest magnitude is amax (a float32 scalar), as
    e4m3 into q_row, its scale into s_ptr. The caller stored the row with BLOCK-wide steps
    (each thread reads back what it wrote, after a barrier for good measure)."""
    offs = tl.arange(0, BLOCK)
    zero = tl.zeros((BLOCK,), dtype=tl.float32)
    scale = tl.math.div_rn(zero + tl.maximum(amax, MIN_AMAX), zero + E4M3_MAX)
    tl.store(s_ptr + offs, scale, mask=offs < 1)
    tl.debug_barrier()
    for k0 in range(0, K, BLOCK):
        mask = k0 + offs < K
        x = tl.load(x_row + k0 + offs, mask=mask, other=0.0)
        q = round_to_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(x.to(tl.float32), scale), -E4M3_MAX), E4M3_MAX))
        tl.store(q_row + k0 + offs, q.to(q_row.dtype.element_ty), mask=mask)
