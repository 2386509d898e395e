"""Triton helpers for the ops that expand a row's LoRA delta from the shrink's sums themselves
(RoPE + KV write, SiLU, the residual add + norm; kernels/lora/delta.py).

B lies in the arena as rank rows [rows, out] (kernels/lora/rows.py): a row of B is contiguous
over the output columns. Loaded as one [columns, rank] tile, the columns take the threads and
the rank takes the warps, and the sum over the rank then crosses warps through shared memory
and barriers. So B is read one rank row at a time, each a [columns] vector spread over all
the warps, and the delta sum_r h[r] * B[r] is a chain of FMAs inside each thread: no shared
memory, no barrier. The rows are unrolled (a tuple of BLOCK_R vectors) so that an op can read
B before its PDL wait and the sums after it.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_b_rows(b_rows, stride_br, cols, mask, r_live, BLOCK_R: tl.constexpr):
    """The row's adapter's B over columns `cols`: a tuple of BLOCK_R [columns] vectors, rank
    row r from b_rows + r rows on; zeros past r_live (0 for a row without an adapter: nothing
    is read, the rows past the rank belong to other adapters)."""
    rows = ()
    for r in tl.static_range(BLOCK_R):
        # tl.where, not `mask & (r < r_live)`: the interpreter widens a scalar & to int32.
        live = tl.where(r < r_live, mask, False)
        rows = rows + (tl.load(b_rows + r * stride_br + cols, mask=live, other=0.0),)
    return rows


@triton.jit
def load_sums(part_row, stride_ps, r_live, SPLITS: tl.constexpr, BLOCK_R: tl.constexpr):
    """The row's shrink sums h (its split partials added, split order): a tuple of BLOCK_R
    float32 scalars, rank column r at part_row + r of each split; zeros past r_live and none
    read there (a row without an adapter may have unwritten sums: GemmLora.unexpanded)."""
    h = ()
    for r in tl.static_range(BLOCK_R):
        h_r = tl.load(part_row + r, mask=r < r_live, other=0.0)
        for s in tl.static_range(1, SPLITS):
            h_r += tl.load(part_row + s * stride_ps + r, mask=r < r_live, other=0.0)
        h = h + (h_r,)
    return h


@triton.jit
def expand_rows(h, b, BLOCK_R: tl.constexpr):
    """The delta h @ B on B's columns (h: load_sums, b: load_b_rows), float32, summed over the
    rank in order within each thread."""
    d = h[0] * b[0].to(tl.float32)
    for r in tl.static_range(1, BLOCK_R):
        d += h[r] * b[r].to(tl.float32)
    return d
