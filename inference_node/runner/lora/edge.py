"""The embedding's and LM head's LoRA of one eager step (kernels/lora/edge.py): which rows
use which adapter, grouped by adapter on the host, and the deltas the model adds to the
embeddings and to the sampled rows' logits."""
from __future__ import annotations

from collections import defaultdict

import torch

from kernels.lora.edge import EdgeGroup, embedding_lora, linear_lora

from ...adapters.slots import SlotBuffers


class EdgeLora:
    def __init__(self, buffers: SlotBuffers, token_slots: list[int], row_slots: list[int]) -> None:
        """token_slots: each token's adapter slot (-1: none); row_slots: each logits row's."""
        self.buffers = buffers
        self.embed_groups = self._groups("embed_tokens", token_slots)
        self.head_groups = self._groups("lm_head", row_slots)

    def _groups(self, module: str, slots: list[int]) -> list[EdgeGroup]:
        rows: dict[int, list[int]] = defaultdict(list)
        held = self.buffers.edge_rows[module]
        for i, slot in enumerate(slots):
            if slot >= 0 and held[slot, 0] > 0:
                rows[slot].append(i)
        device = self.buffers.device
        return [EdgeGroup(torch.tensor(idx, dtype=torch.long).to(device, non_blocking=True),
                          int(held[slot, 0]), int(held[slot, 1]), self.buffers.table[slot][3])
                for slot, idx in rows.items()]

    def embedding(self, ids: torch.Tensor) -> torch.Tensor | None:
        """[T, hidden] float32 delta of the step's tokens' embeddings, or None: no token's
        adapter has an embedding LoRA."""
        if not self.embed_groups:
            return None
        a, b = self.buffers.edges["embed_tokens"]
        return embedding_lora(ids, a, b, self.embed_groups)

    def lm_head(self, x: torch.Tensor, columns: tuple[int, int] | None = None) -> torch.Tensor | None:
        """[N, columns] float32 delta of the sampled rows' logits (columns: a tensor-parallel
        rank's block of the vocabulary), or None: no row's adapter has an LM head LoRA."""
        if not self.head_groups:
            return None
        a, b = self.buffers.edges["lm_head"]
        return linear_lora(x, a, b, self.head_groups, columns)
