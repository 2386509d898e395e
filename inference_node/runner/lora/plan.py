"""The LoRA step plan: for every engine step, which kernels add each token's adapter delta,
read from the adapter slots' GPU buffers (adapters/slots.py, filled by the adapter manager).

Eager and piecewise-graph steps (prefill, mixed batches) add each delta after its matmul
(eager.py). Decode graph steps run LoRA beside the base matmuls, folded into them or expanded
by the ops after them, as the node's Tuning says (overlap.py). The model runner takes this one
object; the adapter manager (adapters/manager.py) only decides which adapter sits in which slot.
"""
from __future__ import annotations

import numpy as np

from kernels.gemm import MAX_ROWS
from kernels.lora import LoraBatchMeta
from kernels.tuning import DEFAULT_TUNING, Tuning

from ...adapters.slots import SlotBuffers
from ...engine.scheduler import ScheduledChunk
from ..decode_graphs import EXPERT_VARIANTS, EXPERTS, LORA_GROUP_VARIANTS, GraphLora
from ..piecewise_graphs import PiecewiseLora
from .eager import StepLoraApplier, applier_for_slots
from .experts import ExpertLoraApplier
from .overlap import LoraOverlap


class LoraStepPlan:
    def __init__(self, buffers: SlotBuffers, tuning: Tuning = DEFAULT_TUNING) -> None:
        self.buffers = buffers
        self.tuning = tuning

    @property
    def max_loras(self) -> int:
        """Adapter slots: the most distinct adapters in one step."""
        return self.buffers.max_loras

    @property
    def module_rows(self) -> np.ndarray:
        """Host mirror of every slot's (rank, first arena row) per LoRA module."""
        return self.buffers.module_rows

    def groups_of(self, slots) -> frozenset[str]:
        """The fused projection groups the adapters in these slots target."""
        return self.buffers.groups_of(slots)

    def needs_eager(self, chunks: list[ScheduledChunk]) -> bool:
        """Whether an adapter of the step has embedding or LM head LoRA: such steps run
        eagerly (the graphs' appliers have none)."""
        return bool(self.buffers.edges_of([c.request.lora_slot for c in chunks]))

    def graph_variants(self) -> tuple[frozenset[str], ...]:
        """The decode graphs' LoRA group variants: with EXPERTS where adapters may bring
        expert LoRA (the node reserved expert arenas)."""
        return EXPERT_VARIANTS if any(self.buffers.experts.rows.values()) else LORA_GROUP_VARIANTS

    def applier(self, chunk_slots: list[tuple[int, int]], logits_rows: list[int] = ()) -> StepLoraApplier | None:
        """An eager step's applier, from each chunk's (adapter slot, tokens) and the tokens
        whose logits it samples; None when no scheduled token uses an adapter."""
        if all(slot < 0 for slot, _ in chunk_slots):
            return None
        return applier_for_slots(self.buffers, chunk_slots, logits_rows)

    def warmup_applier(self, token_slots: list[int]) -> StepLoraApplier:
        """An eager applier over the given slots for every fused group, whatever the slots
        hold (empty slots have rank 0): it launches each kernel an eager step can (the
        engine's warm-up)."""
        return StepLoraApplier(self.buffers, LoraBatchMeta.build(token_slots, self.buffers.device))

    def piecewise_lora(self) -> PiecewiseLora:
        """The piecewise graphs' LoRA (prefill and mixed steps): each delta added after its
        matmul, as in eager steps, over metadata in static buffers; the experts' (every
        parameter the arenas hold: rows without one exit at once) in their own variant."""
        buffers = self.buffers

        def applier(meta: LoraBatchMeta, experts: bool) -> StepLoraApplier:
            return StepLoraApplier(buffers, meta, experts=ExpertLoraApplier(buffers.experts, meta.token_slots)
                                   if experts else None)

        return PiecewiseLora(applier, buffers.max_loras,
                             buffers.has_experts if any(buffers.experts.rows.values()) else None)

    def graph_lora(self, max_tokens: int) -> GraphLora:
        """The decode graphs' LoRA: appliers over static buffers for up to `max_tokens` rows."""
        buffers = self.buffers

        def groups_of(slots) -> frozenset[str]:
            return buffers.groups_of(slots) | ({EXPERTS} if buffers.has_experts(slots) else frozenset())

        return GraphLora(GraphAppliers(buffers, max_tokens, self.tuning).applier, buffers.max_loras, groups_of,
                         buffers.module_rows)


class GraphAppliers:
    """Decode graphs' appliers: LoRA beside the base matmuls (overlap.py) up to the decode
    GEMM's rows (kernels.gemm MAX_ROWS), whose kernels the overlap's folds and expands are
    built around; after the matmuls (eager.py) in graphs of more rows, whose base matmuls are
    cuBLAS's."""

    def __init__(self, buffers: SlotBuffers, max_tokens: int, tuning: Tuning) -> None:
        self.buffers = buffers
        self.max_rows = MAX_ROWS
        self.beside = LoraOverlap(buffers, min(max_tokens, MAX_ROWS), tuning)

    def applier(self, meta: LoraBatchMeta, groups: frozenset[str] | None = None):
        experts = groups is not None and EXPERTS in groups
        if experts:
            groups = groups - {EXPERTS}
        if meta.num_active_tokens <= self.max_rows:
            applier = self.beside.applier(meta, groups)
        else:
            applier = StepLoraApplier(self.buffers, meta, groups)
        if experts:  # every expert parameter the arenas hold: rows without one exit at once
            applier.experts = ExpertLoraApplier(self.buffers.experts, meta.token_slots)
        return applier
