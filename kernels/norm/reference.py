"""RMSNorm and the residual add before it: the PyTorch reference (the CPU path, the first
norm's compiled path on CUDA, and the fused Triton kernel's oracle)."""
from __future__ import annotations

import torch

from ..lora.delta import with_delta


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    """Normalised in float32, rounded to x's dtype, then scaled by the weight (as HF Llama);
    unit_offset: scaled by (1 + weight) in float32 and rounded once (as HF Gemma)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (xf * (1.0 + weight.float())).to(x.dtype)
    return weight * xf.to(x.dtype)


def add_rms_norm(hidden: torch.Tensor, out: torch.Tensor, weight: torch.Tensor, eps: float,
                 delta: torch.Tensor | None = None, unit_offset: bool = False,
                 out_norm: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden + out (+ its LoRA delta), that normalised): the residual stream and the next
    layer's input. out_norm: out (with its delta) is normalised by this weight before the add
    (Gemma's norms after attention and after the MLP)."""
    out = with_delta(out, delta)
    if out_norm is not None:
        out = rms_norm(out, out_norm, eps, unit_offset)
    hidden = hidden + out
    return hidden, rms_norm(hidden, weight, eps, unit_offset)
