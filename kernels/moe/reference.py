"""Mixture-of-experts routing and experts in PyTorch, as transformers computes them (Qwen3-MoE,
Mixtral): the reference the fused kernel (triton_kernel.py) is checked against, and the path
of CPUs and of steps whose rows carry expert LoRA (`lora`, added beside each expert's matmul)."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

# lora(parameter, expert, token_idx, x, y): adds into y the expert LoRA of rows x (tokens token_idx)
ExpertDelta = Callable[[str, int, torch.Tensor, torch.Tensor, torch.Tensor], None]


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, renormalise: bool,
          weights_in_model_dtype: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-k weights [T, k], expert ids [T, k]) of each row x [T, hidden] under router
    [E, hidden]: logits in x's dtype, softmax in float32, the top k renormalised where asked,
    and rounded back to x's dtype where asked (Qwen3-MoE; Mixtral keeps float32)."""
    logits = F.linear(x, router)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if weights_in_model_dtype:
        weights = weights.to(logits.dtype)
    return weights, experts


def experts_reference(x: torch.Tensor, weights: torch.Tensor, picks: torch.Tensor, gate_up: torch.Tensor,
                      down: torch.Tensor, lora: ExpertDelta | None = None) -> torch.Tensor:
    """sum over each row's picks of weight * down_e(silu(gate_e(x)) * up_e(x)) [T, hidden]:
    gate_up [E, 2 * inter, hidden] (gate rows, then up rows), down [E, hidden, inter]. A loop
    over the experts hit, each over its rows, summed into the output in expert order."""
    out = torch.zeros_like(x)
    hits = torch.zeros(gate_up.shape[0], dtype=torch.long, device=x.device)
    hits.scatter_add_(0, picks.flatten(), torch.ones_like(picks.flatten()))
    for expert in hits.nonzero()[:, 0].tolist():
        token_idx, pick = torch.where(picks == expert)
        rows = x[token_idx]
        projected = F.linear(rows, gate_up[expert])
        if lora is not None:
            lora("gate_up_proj", expert, token_idx, rows, projected)
        gate, up = projected.chunk(2, dim=-1)
        act = F.silu(gate) * up
        result = F.linear(act, down[expert])
        if lora is not None:
            lora("down_proj", expert, token_idx, act, result)
        out.index_add_(0, token_idx, (result * weights[token_idx, pick, None]).to(out.dtype))
    return out
