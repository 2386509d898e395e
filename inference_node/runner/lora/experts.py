"""The experts' LoRA of one eager step on a mixture-of-experts model (model/moe.py): each
row routed to an expert gets its own adapter's LoRA of that expert, beside the expert's
matmul. The reference path: per expert, one shrink and expand per adapter among its rows."""
from __future__ import annotations

import torch

from ...adapters.experts import ExpertArenas


class ExpertLoraApplier:
    def __init__(self, store: ExpertArenas, token_slots: list[int]) -> None:
        """token_slots: each token's adapter slot (-1: none)."""
        held = {slot: store.of(slot) for slot in set(token_slots) if slot >= 0}
        self.held = {slot: pairs for slot, pairs in held.items() if pairs is not None}
        self.token_slots = torch.tensor(token_slots, dtype=torch.long).to(store.device, non_blocking=True)

    def add(self, layer: int, parameter: str, expert: int, token_idx: torch.Tensor,
            x: torch.Tensor, y: torch.Tensor) -> None:
        """Adds into y [n, out] (rows x [n, in] of the step's tokens token_idx) each row's
        adapter's LoRA of `parameter` of `expert`, computed in float32."""
        slots = self.token_slots[token_idx]
        for slot, pairs in self.held.items():
            pair = pairs.get((layer, parameter))
            if pair is None:
                continue
            rows = (slots == slot).nonzero()[:, 0]
            if rows.numel() == 0:
                continue
            a, b, scaling = pair
            delta = (x[rows].float() @ a[expert].float().t()) @ b[expert].float()  # B: rank rows
            y.index_add_(0, rows, (delta * scaling).to(y.dtype))
