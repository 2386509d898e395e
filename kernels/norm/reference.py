"""RMSNorm and the residual add before it: the PyTorch reference (the CPU path, the first
norm's compiled path on CUDA, and the fused Triton kernel's oracle)."""
from __future__ import annotations

import torch

from ..lora.delta import with_delta


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalised in float32, rounded to x's dtype, then scaled by the weight (as HF Llama)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(hidden: torch.Tensor, out: torch.Tensor, weight: torch.Tensor, eps: float,
                 delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden + out (+ its LoRA delta), that normalised): the residual stream and the next
    layer's input."""
    hidden = hidden + with_delta(out, delta)
    return hidden, rms_norm(hidden, weight, eps)
