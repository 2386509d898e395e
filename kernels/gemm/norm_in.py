"""The residual add and RMSNorm between two decode GEMMs, split over their launches
(triton_kernel.py: RESIDUAL, NORM): the GEMM before (o or down) adds its output to the residual
stream and writes each row's sum of squares over its tile's columns; the GEMM after (gate/up or
the next layer's q/k/v) sums those, and normalises and weights its input tiles as it reads
them. No add + norm launch, and the normalised rows are never written. Host-side only (no
Triton import)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class NormedInput:
    """A layer input whose RMSNorm is left to the GEMM that reads it."""

    hidden: torch.Tensor   # [T, H]: the residual stream after the add
    sums: torch.Tensor     # [P, T] float32: each row's sum of squares over P column tiles
    weight: torch.Tensor   # [H]: the norm's weight
    eps: float

    def fits(self, x_rows: int, k: int) -> bool:
        """Whether a GEMM of K = k over x_rows rows can take this as its input."""
        return (self.hidden.shape == (x_rows, k) and self.hidden.stride(1) == 1
                and self.sums.shape[1] == x_rows and self.sums.is_contiguous()
                and self.weight.shape == (k,) and self.weight.dtype == self.hidden.dtype)

    def kernel_args(self) -> tuple:
        """The launch's norm arguments (triton_kernel.py: after RoPE's)."""
        return (self.hidden, self.sums, self.weight, 0, self.eps)


def residual_args(hidden: torch.Tensor, sums: torch.Tensor) -> tuple:
    """The launch's arguments for a RESIDUAL epilogue reading `hidden` and writing `sums`."""
    return (hidden, sums, hidden, hidden.stride(0), 0.0)


def no_norm_args(t: torch.Tensor) -> tuple:
    """Placeholders for a launch with neither (never read)."""
    return (t, t, t, 0, 0.0)
