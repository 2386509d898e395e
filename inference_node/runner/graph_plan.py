"""What graphs a runner captures, as the other ranks of a tensor-parallel node must capture
them too (in the same order, so every graph's collectives meet): plain data, sent over the
ranks' control line, and the graphs it builds on any rank."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine.config import EngineConfig
from ..engine.kv_cache import KVCache
from ..model.forward import Decoder
from .decode_graphs import LORA_GROUP_VARIANTS, DecodeGraphs
from .launches import StepLaunches
from .lora.plan import LoraStepPlan
from .piecewise_graphs import PiecewiseGraphs


@dataclass(frozen=True)
class GraphPlan:
    scratch_block: int      # the KV block padded rows write into
    max_model_len: int
    feedback_rows: int      # rows of the sampled-token feedback buffer the graphs read
    decode_batch: int       # the decode graphs' largest batch (0: no decode graphs)
    pieces_tokens: int      # the piecewise graphs' largest token bucket (0: none)
    pieces_seqs: int        # the most sequences a piecewise step holds

    @classmethod
    def of(cls, config: EngineConfig) -> "GraphPlan":
        """The graphs an engine of this config runs (one feedback row a sequence)."""
        return cls(config.num_kv_blocks, config.max_model_len, config.max_num_seqs,
                   min(config.max_num_seqs, config.max_graph_batch) if config.decode_graphs else 0,
                   config.max_num_batched_tokens if config.piecewise_graphs else 0,
                   config.max_num_seqs if config.piecewise_graphs else 0)

    def build(self, model: Decoder, launches: StepLaunches, kv: KVCache, lora: LoraStepPlan | None,
              feedback: torch.Tensor) -> tuple[DecodeGraphs | None, PiecewiseGraphs | None]:
        """The decode graphs and the piecewise graphs of this plan (None where it has none),
        reading the previous step's tokens from `feedback`; not yet captured."""
        decode = pieces = None
        if self.decode_batch:
            decode = DecodeGraphs(
                model, launches, kv, scratch_block=self.scratch_block, max_model_len=self.max_model_len,
                max_batch=self.decode_batch, feedback=feedback,
                lora=lora.graph_lora(self.decode_batch) if lora is not None else None,
                group_variants=lora.graph_variants() if lora is not None else LORA_GROUP_VARIANTS)
        if self.pieces_tokens:
            pieces = PiecewiseGraphs(
                model, launches, kv, scratch_block=self.scratch_block, max_model_len=self.max_model_len,
                max_tokens=self.pieces_tokens, max_seqs=self.pieces_seqs, feedback=feedback,
                lora=lora.piecewise_lora() if lora is not None else None)
        return decode, pieces
