"""SwiGLU's SiLU(gate) * up: the PyTorch reference (the CPU path and the fused Triton
kernel's oracle)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..lora.delta import with_delta


def silu_mul(gate_up: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up: [T, 2 I] (gate columns, then up); delta: their float32 LoRA delta or None."""
    gate, up = with_delta(gate_up, delta).chunk(2, dim=-1)
    return F.silu(gate) * up
