"""Residual add (+ a LoRA delta) + RMSNorm dispatcher: the fused Triton kernel on CUDA, the
PyTorch reference elsewhere."""
from __future__ import annotations

import torch

from ._dispatch import use_triton
from .lora_delta import LoraDelta
from .norm_ref import add_rms_norm as add_rms_norm_ref


def add_rms_norm_lora(hidden: torch.Tensor, out: torch.Tensor, weight: torch.Tensor, eps: float,
                      delta: LoraDelta | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden + out + the expanded delta, that normalised), see norm_ref.add_rms_norm."""
    if use_triton(hidden):
        try:
            from .norm_triton import add_rms_norm_triton
        except ImportError:  # Triton absent: the reference serves
            pass
        else:
            return add_rms_norm_triton(hidden, out, weight, eps, delta)
    return add_rms_norm_ref(hidden, out, weight, eps, delta.dense() if delta is not None else None)
