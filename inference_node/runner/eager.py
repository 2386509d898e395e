"""Steps no graph takes (larger than the graphs, or graphs off), run op by op: the step's inputs
built from host lists and copied to the device per step (batch.py), then the forward with its
bucket's launch choices.

Under tensor parallelism rank 0 sends the other ranks the step's host inputs and each chunk's
adapter slot (EagerStep) but not its token ids: a decode row's token is the previous step's
sample, which only rank 0's device holds, so every rank takes the ids from a broadcast of
rank 0's, then all run the same forward and meet at its collectives. Rank 0 samples; the
others drop their logits.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine.kv_cache import KVCache
from ..engine.scheduler import ScheduledChunk
from ..model.forward import Decoder, ForwardBatch
from .batch import HostBatch, build_host_batch
from .launches import StepLaunches
from .lora.plan import LoraStepPlan

StepLogits = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]  # logits, greedy, finite


@dataclass(frozen=True)
class EagerStep:
    """An eager step's inputs as rank 0 staged them (the other ranks receive them without
    the token ids)."""

    host: HostBatch
    chunk_slots: list[tuple[int, int]]   # (adapter slot, tokens) per chunk, in batch order


class EagerForward:
    def __init__(self, model: Decoder, launches: StepLaunches, kv: KVCache, lora: LoraStepPlan | None,
                 feedback: torch.Tensor | None) -> None:
        """feedback: the device tokens the previous step sampled (rank 0's); None on the other
        ranks of a tensor-parallel node, which take the token ids from rank 0's broadcast."""
        self.model, self.launches, self.kv, self.lora = model, launches, kv, lora
        self.feedback = feedback

    def stage(self, chunks: list[ScheduledChunk]) -> EagerStep:
        return EagerStep(build_host_batch(chunks, self.kv.block_size),
                         [(c.request.lora_slot, c.num_new_tokens) for c in chunks])

    def load(self, step: EagerStep) -> None:
        """Nothing to load: the inputs go to the device when the step runs."""

    def run(self, step: EagerStep) -> StepLogits:
        """The step's logits (its greedy tokens and finite flags left to the sampler)."""
        batch = self._inputs(step.host)
        applier = self.lora.applier(step.chunk_slots, step.host.logits_indices) if self.lora is not None else None
        tp = self.model.tp
        if tp is not None and self.feedback is not None:  # rank 0: its ids to the other ranks
            tp.broadcast(batch.input_ids, 0)
        # Rows and distinct adapters counted alike on every rank, from the same step: with
        # the one tuning table every rank reads, every rank takes the same bucket.
        adapters = len({slot for slot, _ in step.chunk_slots if slot >= 0})
        launch = self.launches.for_step(len(batch.input_ids), adapters)
        return self.model.forward(batch, self.kv.k, self.kv.v, launch, applier), None, None

    def _inputs(self, host: HostBatch) -> ForwardBatch:
        device = self.model.device
        if self.feedback is not None:
            return host.to_device(device, self.feedback)
        ids = torch.empty(len(host.positions), dtype=torch.long, device=device)
        self.model.tp.broadcast(ids, 0)  # rank 0's token ids
        return host.to_device(device, input_ids=ids)
