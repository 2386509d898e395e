"""SiLU(gate) * up (+ the gate/up LoRA delta) dispatcher: the fused Triton kernel on CUDA,
the PyTorch reference elsewhere."""
from __future__ import annotations

import torch

from ._dispatch import use_triton
from .lora_delta import LoraDelta
from .silu_mul_ref import silu_mul as silu_mul_ref


def silu_mul_lora(gate_up: torch.Tensor, delta: LoraDelta | None) -> torch.Tensor:
    """SiLU(gate + its delta) * (up + its delta), see silu_mul_ref.silu_mul."""
    if use_triton(gate_up):
        try:
            from .silu_mul_triton import silu_mul_triton
        except ImportError:  # Triton absent: the reference serves
            pass
        else:
            return silu_mul_triton(gate_up, delta)
    return silu_mul_ref(gate_up, delta.dense() if delta is not None else None)
