"""The experts' LoRA of one step on a mixture-of-experts model (model/moe.py): each row
routed to an expert gets its own adapter's LoRA of that expert, beside the expert's matmul.
What it hands the routed experts per layer is graph-safe (kernels/moe PairLora): the arenas,
the step's token slots and the arenas' per-slot tables, all on the device, so eager steps
and captured decode graphs run it alike."""
from __future__ import annotations

import torch

from kernels.moe import PairLora

from ...adapters.experts import ExpertArenas
from ...model.families import EXPERT_PARAMETERS


class ExpertLoraApplier:
    def __init__(self, store: ExpertArenas, token_slots: torch.Tensor,
                 parameters: frozenset[str] = frozenset(EXPERT_PARAMETERS)) -> None:
        """token_slots: [T] int32 on the device, each token's adapter slot (-1: none);
        parameters: the expert parameters whose LoRA the step applies (an eager step: those
        its adapters have; a graph: all the arenas hold)."""
        self.store, self.token_slots = store, token_slots
        self.parameters = {p for p in parameters if store.rows.get(f"experts.{p}", 0) > 0}

    def pairs(self, layer: int) -> tuple[PairLora | None, PairLora | None]:
        """Gate/up's and down's LoRA of `layer` for every (token, pick) pair (None: the step
        applies none of that parameter)."""
        gate_up, down = (self.store.pair_lora(layer, p, self.token_slots)
                         if p in self.parameters and (layer, p) in self.store.a else None
                         for p in EXPERT_PARAMETERS)
        return gate_up, down
