"""The runner of a tensor-parallel rank other than 0. Rank 0's ModelRunner schedules, stages
and samples; each other rank holds its shard of the model, of the KV cache (its own KV heads,
the same block ids) and of the adapter slots, and runs every step rank 0 staged the same way
(the same graph, the same pieces, or the same eager forward), meeting rank 0's forward at
its collectives. Its logits are dropped."""
from __future__ import annotations

import gc

import torch

from ..engine.kv_cache import KVCache
from ..model.forward import Decoder
from .decode_graphs import StagedDecode
from .eager import EagerForward, EagerStep
from .graph_plan import GraphPlan
from .launches import StepLaunches
from .lora.plan import LoraStepPlan
from .runner import Staged


class RankRunner:
    def __init__(self, model: Decoder, launches: StepLaunches, kv: KVCache, lora: LoraStepPlan | None) -> None:
        self.model, self.launches, self.kv, self.lora = model, launches, kv, lora
        self.eager = EagerForward(model, launches, kv, lora, feedback=None)
        self.decode_graphs = self.piecewise_graphs = None

    def capture(self, plan: GraphPlan) -> None:
        """The graphs rank 0 has: the same sizes, buckets and LoRA variants, captured in its
        order (decode graphs, then the pieces). The feedback buffer only gives the graphs'
        token gather a valid place to read: the broadcast from rank 0 replaces what it reads."""
        feedback = torch.zeros(plan.feedback_rows, dtype=torch.long, device=self.model.device)
        self.decode_graphs, self.piecewise_graphs = plan.build(self.model, self.launches, self.kv, self.lora,
                                                               feedback)
        with torch.inference_mode():
            if self.decode_graphs is not None:
                self.decode_graphs.capture_all()
            if self.piecewise_graphs is not None:
                self.piecewise_graphs.capture_all()

    @torch.inference_mode()
    def run(self, step: Staged) -> None:
        if isinstance(step, EagerStep):
            way = self.eager
        elif isinstance(step, StagedDecode):
            way = self.decode_graphs
        else:
            way = self.piecewise_graphs
        way.load(step)
        way.run(step)

    def release_graphs(self) -> None:
        """Drops the captured graphs before the group ends (their collectives may hold it)."""
        self.decode_graphs = self.piecewise_graphs = None
        gc.collect()
