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

import torch

from ..host import cdiv


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


def scaled_shrink(x: torch.Tensor, a_all: torch.Tensor, scaling: torch.Tensor,
                  token_slots: torch.Tensor) -> torch.Tensor:
    """[T, slices x R] float32: every row's x @ A.T (a_all [S, slices x R, K], a slot's A
    slice by slice), scaled, zero for rows without an adapter: the reference of the kernels
    that store the shrink's rows for the next op to expand."""
    slots = token_slots.long()
    active = slots >= 0
    safe = slots.clamp(min=0)
    scale = torch.where(active, scaling[safe], 0.0)[:, None]
    return torch.einsum("tk,tjk->tj", x.float(), a_all[safe].float()) * scale


@dataclass(frozen=True)
class LoraDelta:
    """partials[:, i, t] summed, times B_i[slot_t].T, is the delta of row t on slice i of the
    projection (slices side by side, in order). The sums are zero past the slot's rank on the
    slice (kernels.lora.lora_shrink_partials) and B is zero there too (the slot pool pads
    ranks with zeros), so an op expanding them needs only the row's slot: one memory latency
    before it can read B, not a chain of slot -> rank -> masked loads."""

    partials: torch.Tensor          # [splits, n_slices, T, R] float32, scaled; rows of slot -1
                                    # are zero (a workspace zeroed once per step)
    b: tuple[torch.Tensor, ...]     # per slice [S, out_i, R]
    token_slots: torch.Tensor       # [T] int32: each row's adapter slot, -1 for none
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
                  token_slots: torch.Tensor, column_split: ColumnSplit | None = None
                  ) -> "LoraDelta":
        """The shrink's rows stored by the kernel ahead of the op (xa [>= rows, slices x
        rank], slice by slice; rows without an adapter unwritten) as a one-split delta whose
        sums that op reads only after its PDL wait."""
        n = len(b)
        partials = xa[:rows, :n * rank].view(rows, n, rank).permute(1, 0, 2).unsqueeze(0)
        return cls(partials, b, token_slots[:rows], column_split=column_split,
                   sums_after_wait=True)

    @property
    def splits(self) -> int:
        return self.partials.shape[0]

    def dense(self) -> torch.Tensor:
        """[T, sum(out_i)] float32: the delta itself (the reference the fused ops are
        checked against, and the CPU path)."""
        if self.expanded is not None:
            return self.expanded
        slots = self.token_slots.long()
        active = (slots >= 0)[:, None, None]
        # Rows without an adapter: their sums may be unwritten (GemmLora.unexpanded).
        h = torch.where(active[None, :, :, 0], self.partials.sum(0), 0.0)  # [n_slices, T, R]
        safe = slots.clamp(min=0)
        outs = [torch.einsum("tr,tor->to", h[i], torch.where(active, b[safe].float(), 0.0))
                for i, b in enumerate(self.b)]
        return torch.cat(outs, dim=1) if outs else h.new_zeros(h.shape[1], 0)
