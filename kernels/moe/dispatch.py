"""The routed experts: the fused Triton kernels (triton_kernel.py) where Triton runs, the
PyTorch reference (reference.py) elsewhere."""
from __future__ import annotations

from typing import Mapping

import torch

from ..dispatch import triton_kernel
from ..tuning import Tiling
from .reference import PairLora, experts_reference, pair_lora_hook


def routed_experts(x: torch.Tensor, weights: torch.Tensor, picks: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor, tilings: Mapping[str, Tiling] | None = None,
                   lora: tuple[PairLora | None, PairLora | None] = (None, None),
                   lora_launches: Mapping[str, Tiling] | None = None) -> torch.Tensor:
    """sum over each row's picks of weight * down_e(silu(gate_e(x)) * up_e(x)), with each
    row's expert LoRA where `lora` (gate/up's, down's) has one: where Triton runs, the
    grouped GEMMs (at `tilings`, Tuning.moe_tilings) with each pair's delta beside them
    (launched as Tuning.moe_lora_launches says); elsewhere the reference, a loop over the
    experts hit."""
    module = "kernels.moe.triton_kernel"
    if lora == (None, None):
        kernel = triton_kernel(x, module, "fused_experts_triton")
        if kernel is not None:
            return kernel(x, weights, picks, gate_up, down, tilings)
        return experts_reference(x, weights, picks, gate_up, down)
    kernel = triton_kernel(x, module, "fused_experts_lora_triton")
    if kernel is not None:
        return kernel(x, weights, picks, gate_up, down, tilings, *lora, lora_launches)
    return experts_reference(x, weights, picks, gate_up, down, pair_lora_hook(*lora))
