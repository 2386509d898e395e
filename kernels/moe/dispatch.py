"""The routed experts: the fused Triton kernel (triton_kernel.py) where Triton runs and no row
carries expert LoRA, the PyTorch reference (reference.py) elsewhere."""
from __future__ import annotations

from typing import Mapping

import torch

from ..dispatch import triton_kernel
from ..tuning import Tiling
from .reference import ExpertDelta, experts_reference


def routed_experts(x: torch.Tensor, weights: torch.Tensor, picks: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor, lora: ExpertDelta | None = None,
                   tilings: Mapping[str, Tiling] | None = None) -> torch.Tensor:
    """sum over each row's picks of weight * down_e(silu(gate_e(x)) * up_e(x)), with each
    row's expert LoRA where `lora` is given (then the reference runs: its loop is a host
    sync, so such steps run eagerly); tilings: the fused kernel's (Tuning.moe_tilings)."""
    kernel = triton_kernel(x, "kernels.moe.triton_kernel", "fused_experts_triton") if lora is None else None
    if kernel is not None:
        return kernel(x, weights, picks, gate_up, down, tilings)
    return experts_reference(x, weights, picks, gate_up, down, lora)
