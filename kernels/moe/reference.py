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


class PairLora:
    """One expert parameter's LoRA for each (token, pick) pair of a step, read from an arena
    of rank rows shared by the resident adapters (inference_node/adapters/experts.py): A [E,
    R, in] and B [E, R, out]; each token's adapter slot (-1: none), and per slot its first
    row, its rank there (0: none) and its scaling. Graph-safe: all of it on the device, read
    by each token's slot, so a captured step replays over whatever slots its rows hold.
    max_rank: the most rows any slot's rank may be (the arena's depth where None), known on
    the host: the kernels' rank tile, which an arena of many adapters' rows would otherwise set."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor, first: torch.Tensor,
                 rank: torch.Tensor, scaling: torch.Tensor, max_rank: int | None = None) -> None:
        self.a, self.b, self.token_slots = a, b, token_slots
        self.first, self.rank, self.scaling = first, rank, scaling
        self.max_rank = min(max_rank, a.shape[1]) if max_rank else a.shape[1]

    def of_tokens(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(first row, rank, scaling) of each token's adapter (rank 0 where it has none)."""
        slots = self.token_slots.long()
        has = slots >= 0
        at = slots.clamp(min=0)
        return self.first[at].long(), torch.where(has, self.rank[at].long(), 0), self.scaling[at]


def pair_lora_reference(x: torch.Tensor, picks: torch.Tensor, lora: PairLora, y: torch.Tensor,
                        x_per_pair: bool) -> None:
    """Adds into y [pairs, out] each pair's LoRA of its expert: (x_p A_e^T) B_e * scaling over
    its token's adapter's rows (rows past its rank masked), in float32, rounded to y's dtype
    once as the per-expert reference adds it; x: [tokens, in], or [pairs, in] where x_per_pair."""
    top_k = picks.shape[1]
    token = torch.arange(picks.numel(), device=y.device) // top_k
    rows = (x if x_per_pair else x[token]).float()
    expert = picks.flatten()
    first, rank, scaling = (t[token] for t in lora.of_tokens())
    ranks = torch.arange(lora.a.shape[1], device=y.device)
    live = ranks[None, :] < rank[:, None]                                      # [pairs, R]
    index = torch.where(live, first[:, None] + ranks[None, :], 0)
    a = lora.a[expert[:, None], index].float() * live[:, :, None]             # [pairs, R, in]
    b = lora.b[expert[:, None], index].float()                                # [pairs, R, out]
    shrunk = torch.einsum("pi,pri->pr", rows, a)
    delta = torch.einsum("pr,pro->po", shrunk, b) * scaling[:, None]
    y += delta.to(y.dtype)


def pair_lora_hook(gate_up: PairLora | None, down: PairLora | None) -> ExpertDelta:
    """experts_reference's per-expert hook over the pairs' LoRA (CPUs): for an expert's rows,
    each row's adapter's delta, masked past its rank."""
    def add(parameter: str, expert: int, token_idx: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> None:
        lora = gate_up if parameter == "gate_up_proj" else down
        if lora is None:
            return
        first, rank, scaling = (t[token_idx] for t in lora.of_tokens())
        ranks = torch.arange(lora.a.shape[1], device=y.device)
        live = ranks[None, :] < rank[:, None]
        index = torch.where(live, first[:, None] + ranks[None, :], 0)
        a = lora.a[expert][index].float() * live[:, :, None]                  # [n, R, in]
        b = lora.b[expert][index].float()                                     # [n, R, out]
        delta = torch.einsum("nr,nro->no", torch.einsum("ni,nri->nr", x.float(), a), b) * scaling[:, None]
        y += delta.to(y.dtype)
    return add
