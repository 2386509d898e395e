"""SiLU(gate) * up (+ the gate/up LoRA delta): the fused Triton kernel (triton_kernel.py) where
Triton runs, the PyTorch reference (reference.py) elsewhere."""
from __future__ import annotations

import torch

from ..dispatch import triton_kernel
from ..lora.delta import LoraDelta
from ..tuning import DEFAULT_TUNING, Tuning
from .reference import silu_mul


def silu_mul_lora(gate_up: torch.Tensor, delta: LoraDelta | None,
                  tuning: Tuning = DEFAULT_TUNING, *, activation: str = "silu") -> torch.Tensor:
    """act(gate + its delta) * (up + its delta), see reference.silu_mul."""
    kernel = triton_kernel(gate_up, "kernels.activation.triton_kernel", "silu_mul_triton")
    if kernel is not None:
        return kernel(gate_up, delta, tuning=tuning, activation=activation)
    return silu_mul(gate_up, delta.dense() if delta is not None else None, activation)
