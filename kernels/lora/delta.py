"""A fused projection's LoRA delta left unexpanded, for the op after the projection to expand.

In a decode step a LoRA expand is a small kernel whose launch and ramp-up cost more than the
bytes it reads, and whose float32 output (the delta) is written only to be read back by the
next op (RoPE with the KV-cache write, the residual add and norm, SiLU). That next op reads
the projection's output row by row anyway, so it expands the delta itself: it sums the
shrink's split partials for the row, reads the row's adapter's B columns and adds the
product before doing its own work. No expand launch, no delta buffer.

Where the projection's matmul is long enough (gate/up, down), the expand can instead run on
the side stream right after the shrink, beside the matmul, into a float32 delta buffer: the
next op then adds `expanded` row by row, a read of the delta instead of the adapter's B.

The residual add + norm after o and down reduces over a whole row, so it runs one program per
row: at decode batch that is 64 programs, each reading its adapter's whole B slice, on a chip
of 132 SMs. A `ColumnSplit` lets it spread each row over several programs instead
(kernels/norm/triton_kernel.py): each program expands and adds its columns and leaves its part of the
row's sum of squares; the last one of the row to arrive normalises the row.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..host import cdiv
from .rows import gather_rows


@dataclass(frozen=True)
class ColumnSplit:
    """Scratch for an op that reduces over whole rows (the add + norm) to cover each row with
    several programs of `block` columns. `arrivals` counts the programs of a row that are done;
    it is zero between launches (the row's last program resets it), so one launch after
    another, and a CUDA graph's replays, need no clearing. `sums` holds each program's partial
    sum, added in column order by the last one (deterministic: no float atomics)."""

    block: int                  # columns per program (a power of 2)
    arrivals: torch.Tensor      # [max rows] int32, zero between launches
    sums: torch.Tensor          # [max rows, max chunks] float32

    @classmethod
    def allocate(cls, block: int, max_rows: int, max_columns: int,
                 device: torch.device) -> "ColumnSplit":
        assert block > 0 and block & (block - 1) == 0, "block must be a power of 2"
        return cls(block, torch.zeros(max_rows, dtype=torch.int32, device=device),
                   torch.zeros(max_rows, cdiv(max_columns, block), dtype=torch.float32, device=device))

    def fits(self, rows: int, columns: int) -> bool:
        """Whether a launch over rows x columns fits this scratch (else: one program a row)."""
        return rows <= self.arrivals.shape[0] and cdiv(columns, self.block) <= self.sums.shape[1]


def with_delta(y: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
    """y plus a float32 LoRA delta, rounded once to y's dtype (as the kernels that add it do):
    the references' way of adding a delta."""
    if delta is None:
        return y
    return (y.float() + delta).to(y.dtype)


def scaled_shrink(x: torch.Tensor, a: Sequence[torch.Tensor], scaling: torch.Tensor,
                  token_slots: torch.Tensor, token_rows: torch.Tensor, max_rank: int) -> torch.Tensor:
    """[T, slices x R] float32: every row's x @ A.T slice by slice (a: per slice [arena rows,
    K]; token_rows [T, 2 x slices]: each row's (rank, first row) per slice), scaled, zero past
    each rank and for rows without an adapter: the reference of the kernels that store the
    shrink's rows for the next op to expand."""
    slots = token_slots.long()
    active = slots >= 0
    scale = torch.where(active, scaling[slots.clamp(min=0)], 0.0)[:, None]
    parts = []
    for i, arena in enumerate(a):
        rows = gather_rows(arena, token_rows[:, 2 * i + 1], token_rows[:, 2 * i], max_rank)
        parts.append(torch.einsum("tk,trk->tr", x.float(), rows) * scale)
    return torch.cat(parts, dim=1)


@dataclass(frozen=True)
class LoraDelta:
    """partials[:, i, t] summed, times the B rows of row t's adapter on slice i, is the delta
    of row t on slice i of the projection (slices side by side, in order). token_rows gives
    each row's (rank, first arena row) per slice, beside its slot in the step's inputs, so an
    op expanding the delta finds the row's B in one memory latency and reads no row past the
    rank (kernels/lora/rows.py). The sums are zero past the rank too."""

    partials: torch.Tensor          # [splits, n_slices, T, R] float32, scaled; rows without an
                                    # adapter may be unwritten (never read: their rank is 0)
    b: tuple[torch.Tensor, ...]     # per slice [arena rows, out_i]
    token_rows: torch.Tensor        # [T, 2 x n_slices] int32: (rank, first row) per slice
    # [T, sum(out_i)] float32, or None: the delta already expanded (slices side by side,
    # rows of slot -1 zero); an op given it adds it and ignores partials and b.
    expanded: torch.Tensor | None = None
    # Scratch that lets the add + norm after o and down spread a row over several programs
    # (None: one program a row). Ops that work column by column ignore it.
    column_split: ColumnSplit | None = None
    # The sums are written by the kernel just ahead of the op (a shrink-only fold,
    # GemmLora.unexpanded), not by the side stream: an op launched early under PDL reads
    # them only after its wait (B it may read before).
    sums_after_wait: bool = False

    @classmethod
    def from_rows(cls, xa: torch.Tensor, rows: int, rank: int, b: tuple[torch.Tensor, ...],
                  token_rows: torch.Tensor, column_split: ColumnSplit | None = None,
                  splits: int = 1) -> "LoraDelta":
        """The shrink's rows stored by the kernel ahead of the op (xa [>= rows, splits x
        slices x rank], split by split, slice by slice; rows without an adapter unwritten) as
        a delta whose sums that op reads only after its PDL wait."""
        n = len(b)
        partials = xa[:rows, :splits * n * rank].view(rows, splits, n, rank).permute(1, 2, 0, 3)
        return cls(partials, b, token_rows[:rows], column_split=column_split,
                   sums_after_wait=True)

    @property
    def splits(self) -> int:
        return self.partials.shape[0]

    def dense(self) -> torch.Tensor:
        """[T, sum(out_i)] float32: the delta itself (the reference the fused ops are
        checked against, and the CPU path)."""
        if self.expanded is not None:
            return self.expanded
        rank = self.partials.shape[3]
        h = self.partials.sum(0)  # [n_slices, T, R]
        outs = []
        for i, b in enumerate(self.b):
            ranks, first = self.token_rows[:, 2 * i], self.token_rows[:, 2 * i + 1]
            live = torch.arange(rank, device=h.device)[None, :] < ranks.long()[:, None]
            # Rows without an adapter (rank 0): their sums may be unwritten (GemmLora.unexpanded).
            hi = torch.where(live, h[i], 0.0)
            outs.append(torch.einsum("tr,tro->to", hi, gather_rows(b, first, ranks, rank)))
        return torch.cat(outs, dim=1) if outs else h.new_zeros(h.shape[1], 0)
