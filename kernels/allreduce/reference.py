"""What the fused all-reduce computes, in PyTorch: the oracle of its kernel and of the unfused
ops it replaces."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from ..norm.reference import add_rms_norm


def all_reduce_add_rms_norm(partials: Sequence[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor,
                            eps: float, bias: torch.Tensor | None = None, unit_offset: bool = False,
                            out_norm: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + the ranks' summed partials (+ bias), that normalised), as the node's
    all-reduce followed by its add + norm (kernels/norm) computes them, the sum taken in float32
    in rank order and rounded once to the model's dtype: every rank adds the same numbers in the
    same order, so every rank gets the same bits."""
    total = partials[0].float()
    for part in partials[1:]:
        total = total + part.float()
    out = total.to(residual.dtype)
    if bias is not None:
        out = out + bias
    return add_rms_norm(residual, out, weight, eps, None, unit_offset, out_norm)
