"""Greedy argmax: the Triton kernels (triton_kernel.py) where Triton runs, the PyTorch
reference (reference.py) elsewhere. Both return torch.argmax's index: the first maximum."""
from __future__ import annotations

import torch

from ..dispatch import triton_kernel
from .reference import first_argmax_ref


def first_argmax(logits: torch.Tensor) -> torch.Tensor:
    """[rows] int64, the first index of each row's maximum, left on the logits' device."""
    kernel = (triton_kernel(logits, "kernels.sampling.triton_kernel", "first_argmax_triton")
              if logits.stride(-1) == 1 else None)
    if kernel is not None:
        return kernel(logits)
    return first_argmax_ref(logits)
