"""The experts' LoRA of resident adapters on a mixture-of-experts base model, on the device:
per adapter slot, each MoE layer's A [experts, r, in] and B [experts, out, r] of the expert
parameters it targets (model/moe.py adds them beside each expert's matmuls).

Not paged in the arenas' rank rows (slots.py): an adapter's expert LoRA is allocated when its
slot is written and freed with the slot. Under tensor parallelism each rank keeps the
experts' block of intermediate columns its base experts hold: gate/up's B rows (gate's block,
then up's), down's A columns.
"""
from __future__ import annotations

import torch

from ..parallel.shard import Shard
from .weights import AdapterWeights

# (A [experts, r, in], B [experts, out, r], scaling) by (layer, expert parameter)
ExpertPairs = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]]


class ExpertSlots:
    def __init__(self, inter: int, dtype: torch.dtype, device: torch.device, shard: Shard = Shard()) -> None:
        """inter: each expert's intermediate width on this rank."""
        self.inter, self.dtype, self.device, self.shard = inter, dtype, device, shard
        self.held: dict[int, ExpertPairs] = {}

    def write(self, slot: int, weights: AdapterWeights) -> None:
        """Copies the adapter's expert LoRA (this rank's part) to the device (in the caller's
        stream), or forgets the slot's where it has none."""
        self.held.pop(slot, None)
        if not weights.experts:
            return
        self.held[slot] = {key: (*self._part(parameter, a, b), scaling)
                           for key, (a, b, scaling) in weights.experts.items() for parameter in (key[1],)}

    def _part(self, parameter: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.shard.size > 1:
            lo, hi = self.shard.block(self.inter * self.shard.size)
            if parameter == "gate_up_proj":
                full = self.inter * self.shard.size
                b = torch.cat([b[:, lo:hi], b[:, full + lo:full + hi]], dim=1)
            else:
                a = a[:, :, lo:hi]
        move = dict(device=self.device, dtype=self.dtype, non_blocking=True)
        return a.to(**move).contiguous(), b.to(**move).contiguous()

    def free(self, slot: int) -> None:
        self.held.pop(slot, None)

    def of(self, slot: int) -> ExpertPairs | None:
        """The slot's expert LoRA (None: its adapter has none)."""
        return self.held.get(slot)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pairs in self.held.values()
                   for a, b, _ in pairs.values() for t in (a, b))
