"""A fused group's LoRA shrink computed by the residual add + norm that writes the group's
input, so that the group's matmul runs as the plain decode GEMM.

Why: gate/up's shrink as programs of its own GEMM (kernels/lora_gemm.py, expand=False) adds
64 programs to the GEMM's 512 tiles at 32 adapters, past two waves of an H100's slots; with
those programs left out (timing only) the step of 32 adapters on gate/up alone was 0.05 ms
faster (docs/PERFORMANCE.md). The add + norm before gate/up, spread over column programs
(kernels/lora_delta.py: ColumnSplit), already holds each row's new residual columns.

How (kernels/norm_triton.py): each program multiplies its columns of the new residual row,
times the norm's weight, by the row's adapter's A over those columns and stores that partial
sum; the row's last program, which alone knows the row's 1/rms, adds the partials in column
order, scales them by it and by the adapter's scaling, and stores x @ A.T for the op after
the matmul (SiLU) to expand. The same as the shrink of the normalised row, except that the
row is not rounded to the model's dtype before A: exact in float32.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .lora_delta import ColumnSplit, LoraDelta, scaled_shrink


@dataclass(frozen=True)
class NormShrink:
    """What the add + norm needs to store the next group's shrink (adapters/slots.py layout)."""

    a_all: torch.Tensor          # [S, slices x R, H]: a slot's A, slice by slice
    scaling: torch.Tensor        # [S] float32
    token_slots: torch.Tensor    # [T] int32, -1 for none
    b: tuple[torch.Tensor, ...]  # per slice [S, out_i, R]: for the op that expands
    xa: torch.Tensor             # [>= T, slices x R] float32: the rows' x @ A.T, scaled
    partials: torch.Tensor       # [>= T, >= chunks, slices x R] float32 scratch
    column_split: ColumnSplit    # the add + norm's split (the shrink needs its programs)

    @property
    def rank(self) -> int:
        return self.a_all.shape[1] // len(self.b)

    def fits(self, rows: int, columns: int) -> bool:
        """Whether the split add + norm can compute it for rows x columns."""
        split = self.column_split
        return (split.block < columns and split.fits(rows, columns)
                and self.partials.shape[0] >= rows
                and self.partials.shape[1] >= -(-columns // split.block))

    def store_reference(self, x: torch.Tensor) -> None:
        """xa's rows from the normalised rows x, as the kernel stores them (PyTorch)."""
        self.xa[:x.shape[0], :self.a_all.shape[1]] = scaled_shrink(
            x, self.a_all, self.scaling, self.token_slots[:x.shape[0]])

    def unexpanded(self, rows: int) -> LoraDelta:
        """The stored rows as the delta for the op after the group's matmul to expand."""
        return LoraDelta.from_rows(self.xa, rows, self.rank, self.b, self.token_slots)
