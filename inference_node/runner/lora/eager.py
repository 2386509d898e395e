"""LoRA after each matmul, for eager steps (prefill and mixed batches): the kernels' metadata
is built once per step from each token's slot, then every layer's fused projections add their
deltas in one launch each. Groups that no adapter in the step targets (the MLP, for q/v
adapters) launch nothing. The embedding's and LM head's LoRA, where an adapter of the step
has them, come with the applier (`edge`, edge.py), as do the experts' LoRA of a mixture-of-
experts model (`experts`, experts.py)."""
from __future__ import annotations

import torch

from kernels.lora import MODULE_COLUMNS, SEGMENT_TABLE_RANKS, LoraBatchMeta, add_lora

from ...adapters.slots import SlotBuffers
from ...model.llama import GROUP_FIRST_MODULE
from .edge import EdgeLora
from .experts import ExpertLoraApplier


class StepLoraApplier:
    """Adds each delta into its projection's output, after the base matmul."""

    adds_into_output = True

    def __init__(self, buffers: SlotBuffers, meta: LoraBatchMeta,
                 groups: frozenset[str] | None = None, edge: EdgeLora | None = None,
                 experts: ExpertLoraApplier | None = None) -> None:
        """groups: the fused groups to apply (None: all); edge: the embedding's and LM head's
        LoRA, experts: the experts' (None: no adapter of the step has one)."""
        self.buffers = buffers
        self.meta = meta
        self.groups = groups
        self.edge = edge
        self.experts = experts

    def begin(self, layer: int, group: str, x: torch.Tensor) -> None:
        return None

    def fold(self, layer: int, group: str) -> None:
        return None  # eager steps: rows are not grouped into contiguous segments

    def applies_to(self, group: str) -> bool:
        return self.groups is None or group in self.groups

    def end(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        if self.groups is not None and group not in self.groups:
            return None
        buf = self.buffers.layers[layer][group]
        add_lora(x, y, buf.a, buf.b, self.meta, self.buffers.scaling, buf.offsets,
                 self.buffers.slot_rows(group),
                 rank_col=SEGMENT_TABLE_RANKS + MODULE_COLUMNS * GROUP_FIRST_MODULE[group])
        return None


def applier_for_slots(buffers: SlotBuffers, chunk_slots: list[tuple[int, int]],
                      logits_rows: list[int] = ()) -> StepLoraApplier:
    """The applier of an eager step given as (adapter slot, tokens) per chunk, in batch order
    (each chunk's tokens on its request's adapter slot), and the tokens whose logits it
    samples (the embedding's and LM head's LoRA read each row's adapter)."""
    token_slots: list[int] = []
    for slot, tokens in chunk_slots:
        token_slots += [slot] * tokens
    slots = {slot for slot, _ in chunk_slots}
    edge = None
    if buffers.edges_of(slots):
        edge = EdgeLora(buffers, token_slots, [token_slots[i] for i in logits_rows])
    meta = LoraBatchMeta.build(token_slots, buffers.device)
    held = buffers.expert_parameters(slots)
    experts = ExpertLoraApplier(buffers.experts, meta.token_slots, held) if held else None
    return StepLoraApplier(buffers, meta, buffers.groups_of(slots), edge=edge, experts=experts)
