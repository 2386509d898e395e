"""The gated MLP's act(gate) * up, SwiGLU's SiLU or GeGLU's tanh-approximated GeLU (Gemma):
the PyTorch reference (the CPU path and the fused Triton kernel's oracle)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..lora.delta import with_delta


ACTIVATIONS = ("silu", "gelu_tanh")


def silu_mul(gate_up: torch.Tensor, delta: torch.Tensor | None = None,
             activation: str = "silu") -> torch.Tensor:
    """gate_up: [T, 2 I] (gate columns, then up); delta: their float32 LoRA delta or None;
    activation: "silu" or "gelu_tanh" (transformers' gelu_pytorch_tanh)."""
    gate, up = with_delta(gate_up, delta).chunk(2, dim=-1)
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    return F.silu(gate) * up
