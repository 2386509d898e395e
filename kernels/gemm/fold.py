"""A fused projection's LoRA folded into its decode matmul: y = x @ W + every row's delta,
one launch (fold_triton_kernel.py), the PyTorch reference (reference_gemm_lora) elsewhere.

Why: at decode a step's adapters add bytes (A and B of each distinct adapter) to a matmul
that is itself a stream of weight bytes. Run as kernels of their own, or inside the op after
the matmul, the LoRA parts are short launches bound by latency, not bytes: on an H100 with
32 adapters the ops that expanded B took more than twice their B's read time
(docs/PERFORMANCE.md). Folded in, A and B are read beside the weight stream: the shrink
programs read each adapter's A once, and each output tile reads its rows' B columns while
it streams W, leaving a short tail (a wait for the shrinks, a read of their rows) after the
matmul. That tail and the shrink programs cost a few microseconds per wave of tiles, so it
pays for o (one wave), not for gate/up or q/k/v (kernels/tuning.py: fold_groups).

For q/k/v, gate/up and (in steps of many adapters) o the launch only shrinks (expand=False):
the op after the matmul (RoPE, SiLU, the split add + norm) reads the rows' B anyway, and
with no side-stream edge before it, it launches early and reads B while the matmul streams
its weights (kernels/tuning.py: shrink_fold_groups).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..lora.delta import ColumnSplit, LoraDelta, scaled_shrink
from ..lora.rows import gather_rows

# A whole fold's tiles wait for its shrink programs through two counters that only grow
# (tickets taken, shrinks finished): launch i of a site owns tickets i*programs ..
# (i+1)*programs - 1, so every launch on the same counters must have the same grid
# (segments x slices + N / block_n). A site's segments pick its counters (runner/lora/overlap.py);
# the tuning table may give steps of other sizes another block_n at the same segments, so the
# counters hold one row per block_n a tiling may take.
SYNC_BLOCK_N = (16, 32, 64, 128, 256)


def fold_counters(*sites: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Zeroed counters for launch sites of shape `sites`: [*sites, len(SYNC_BLOCK_N), 2]."""
    return torch.zeros(*sites, len(SYNC_BLOCK_N), 2, dtype=torch.int64, device=device)


def counters_for(sync: torch.Tensor, block_n: int) -> torch.Tensor:
    """The [2] counters of a site's launches of `block_n` columns a tile."""
    if block_n not in SYNC_BLOCK_N:
        raise ValueError(f"a fold's block_n is one of {SYNC_BLOCK_N}, not {block_n}")
    return sync[SYNC_BLOCK_N.index(block_n)]


@dataclass(frozen=True)
class GemmLora:
    """What the matmul of one fused group needs to add its LoRA (adapters/slots.py layout:
    arenas of rank rows, kernels/lora/rows.py)."""

    a_all: torch.Tensor          # [slices, rows, K]: slice i's A rows
    b_all: torch.Tensor          # [rows, N]: B rows, each slice's at its output columns
    scaling: torch.Tensor        # [S] float32
    slice_offsets: tuple[int, ...]  # first output column of each slice
    segment_table: torch.Tensor  # [>= segments, >= 3] int32: slot, first row, length (rows
                                 # of a segment contiguous; empty rows after the real ones),
                                 # and at rank_col + 2i, + 2i + 1: slice i's rank and first row
    segments: int                # table rows a launch reads (a graph's bucket)
    rank_col: int                # the column of slice 0's rank in the segment table
    max_rank: int                # the largest rank of a slot: the kernel's rank tile R
    token_slots: torch.Tensor    # [T] int32, -1 for none (the reference's input)
    token_rows: torch.Tensor     # [T, 2 x slices] int32: each row's (rank, first row) per slice
    xa: torch.Tensor             # [>= T, slices x R] float32 scratch for the shrink's rows
    sync: torch.Tensor           # [len(SYNC_BLOCK_N), 2] int64 counters of one launch site
                                 # (fold_counters), zero before its first launch
    # False: the launch only shrinks beside the matmul (y = x @ W, xa's rows stored) and the
    # op after it expands (unexpanded()): the fold of a group whose next op reads B anyway.
    expand: bool = True
    # expand=False for o or down: the add + norm's scratch to spread each row over several
    # programs (LoraDelta.column_split), which then read their B columns before their wait.
    column_split: ColumnSplit | None = None
    # expand=False: 0, the shrink runs in programs of its own, one a (segment, slice) over
    # the whole K; n > 0, the tile programs compute it in units of (segment, slice, one of n
    # K ranges), each range's partial sums in xa's columns j x slices x R onwards (xa then
    # holds n x slices x R columns).
    shrink_splits: int = 0

    @property
    def rank(self) -> int:
        return self.max_rank

    @property
    def slices(self) -> int:
        return len(self.slice_offsets)

    def shrink(self, x: torch.Tensor) -> torch.Tensor:
        """[T, slices x R] float32: every row's x @ A.T, scaled, zero past its rank and for
        rows without an adapter (the reference of the kernel's xa)."""
        return scaled_shrink(x, tuple(self.a_all), self.scaling, self.token_slots,
                             self.token_rows, self.max_rank)

    @property
    def splits(self) -> int:
        """Partial sums a row's shrink leaves in xa (expand=False)."""
        return max(1, self.shrink_splits)

    def store_shrink(self, x: torch.Tensor) -> None:
        """expand=False on the reference path: xa's rows as the kernel stores them (the whole
        sum in the first split, zeros in the others)."""
        width = self.slices * self.rank
        self.xa[:x.shape[0], :width] = self.shrink(x)
        self.xa[:x.shape[0], width:self.splits * width] = 0.0

    def b_slices(self) -> tuple[torch.Tensor, ...]:
        """Each slice's B, [rows, out_i] views of b_all."""
        bounds = [*self.slice_offsets, self.b_all.shape[1]]
        return tuple(self.b_all[:, lo:hi] for lo, hi in zip(bounds, bounds[1:]))

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """[T, N] float32: every row's delta (the reference the kernel is checked against)."""
        xa = self.shrink(x)
        r = self.rank
        return torch.cat([torch.einsum("tr,tro->to", xa[:, i * r:(i + 1) * r],
                                       gather_rows(b, self.token_rows[:, 2 * i + 1],
                                                   self.token_rows[:, 2 * i], r))
                          for i, b in enumerate(self.b_slices())], dim=1)

    def unexpanded(self, rows: int) -> LoraDelta:
        """expand=False: the shrink's rows of xa (stored by the launch) as a LoraDelta of its
        splits, for the op after the matmul to expand. Rows without an adapter are not
        stored; the ops expanding it read no sums for them."""
        return LoraDelta.from_rows(self.xa, rows, self.rank, self.b_slices(), self.token_rows,
                                   self.column_split, self.splits)


def gemm_lora_fits(lora: GemmLora, n: int, block_n: int) -> bool:
    """Whether the Triton kernel takes this fold: every tile inside one slice (at most 3),
    a rank the tensor cores take (a power of 2, 16 or more), a segment table, and room in xa
    for every split's sums."""
    r = lora.rank
    return (lora.slices <= 3 and r >= 16 and r & (r - 1) == 0 and n % block_n == 0
            and all(off % block_n == 0 for off in lora.slice_offsets)
            and lora.segment_table.shape[0] >= lora.segments
            and lora.xa.shape[1] >= lora.splits * lora.slices * r)


def shrink_fits(lora: GemmLora, x16: torch.Tensor) -> bool:
    """Whether the FP8 GEMM's launch can run `lora`'s shrink (fp8_triton_kernel.py): expand
    False and unspread (the op after the GEMM expands the whole sums), a rank the tensor
    cores take, a K step dividing K, 16-bit rows contiguous along K."""
    r, k = lora.rank, x16.shape[1]
    return (not lora.expand and lora.shrink_splits == 0 and r >= 16 and r & (r - 1) == 0
            and k % 16 == 0 and x16.stride(1) == 1 and x16.dtype != torch.float8_e4m3fn
            and lora.segment_table.shape[0] >= lora.segments
            and lora.xa.shape[1] >= lora.slices * r)


def reference_gemm_lora(x: torch.Tensor, w: torch.Tensor, lora: GemmLora) -> torch.Tensor:
    """x @ w plus the delta, in x's dtype; with expand=False, x @ w with xa's rows stored."""
    if not lora.expand:
        lora.store_shrink(x)
        return torch.mm(x, w)
    return (torch.mm(x, w).float() + lora.delta(x)).to(x.dtype)
