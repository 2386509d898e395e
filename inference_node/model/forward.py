"""What a decoder's forward pass takes besides its weights, one step's flattened inputs
(ForwardBatch) and the LoRA deltas of its tokens (LoraApplier), and what a decoder offers the
model runner (Decoder). Every family's decoder takes and offers the same, so the runner stages
steps and captures graphs without knowing a model's internals."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kernels.gemm import GemmLora
from kernels.lora import LoraDelta

from ..parallel.group import TensorParallel
from .config import ModelConfig
from .launch import LaunchChoices


@dataclass
class ForwardBatch:
    """One engine step, flattened over all scheduled sequences (built once per step)."""

    input_ids: torch.Tensor        # [T] int64
    positions: torch.Tensor        # [T] int64
    slot_mapping: torch.Tensor     # [T] int64: KV cache slot (block * block_size + offset)
    block_tables: torch.Tensor     # [B, max_blocks] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor         # [B] int32
    logits_indices: torch.Tensor | None  # [N] int64: rows whose logits are needed; None: all
    max_query_len: int
    max_seq_len: int
    # A decode graph's tokens: where feedback_rows[t] >= 0, token t is feedback[that row] (the
    # previous step's sample, never read back by the host) instead of input_ids[t].
    feedback: torch.Tensor | None = None        # [rows] int64
    feedback_rows: torch.Tensor | None = None   # [T] int64


class LoraApplier(Protocol):
    """The LoRA deltas of one step's tokens for each fused projection."""

    # The embedding's and LM head's LoRA of the step (runner/lora/edge.py: `embedding(ids)`,
    # `lm_head(x, columns)`), None where no adapter of the step has them.
    edge: Any
    # Whether `end` adds the delta into the matmul's output (which must then exist summed),
    # rather than handing it to the next op: an FP8 GEMM's K splits may then go to that op.
    adds_into_output: bool

    def begin(self, layer: int, group: str, x: torch.Tensor) -> None:
        """Called before the base matmul of `group` is launched: may start the delta beside it."""

    def end(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> LoraDelta | None:
        """Called after it: adds the delta into y (returns None), or returns it unexpanded
        for the next fused op to expand and add."""

    def fold(self, layer: int, group: str) -> GemmLora | None:
        """The group's LoRA for its matmul to add in the same launch (kernels/gemm/fold.py),
        or only to shrink in it (GemmLora.expand False: the next op expands), or None: then
        begin and end apply it."""

    def applies_to(self, group: str) -> bool:
        """Whether the step has LoRA on `group` (else its matmul runs as in a base step)."""


class Decoder(Protocol):
    """What the model runner needs of a decoder (model/llama.py's LlamaModel; other families'
    alike): weights behind a forward over a paged KV cache, and that forward's pieces, which
    the piecewise graphs capture one by one with attention run between them."""

    config: ModelConfig          # the shapes this process computes with (its shard's under TP)
    device: torch.device
    dtype: torch.dtype
    tp: TensorParallel | None
    gemm_groups: frozenset[str]  # projections laid out for the decode GEMM (fixed at load)

    def forward(self, batch: ForwardBatch, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                launch: LaunchChoices, lora: LoraApplier | None = None) -> torch.Tensor:
        """Logits [N, vocab] of the batch's logits rows."""

    def embed_inputs(self, batch: ForwardBatch, launch: LaunchChoices, lora: LoraApplier | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the residual stream, that normalised for layer 0; lora: its embedding LoRA)."""

    def attention_inputs(self, i: int, x: torch.Tensor, batch: ForwardBatch, k_caches: list[torch.Tensor],
                         v_caches: list[torch.Tensor], launch: LaunchChoices, lora: LoraApplier | None,
                         q_out: torch.Tensor | None = None) -> torch.Tensor:
        """Layer i's queries (into q_out where given); its keys and values written to the cache."""

    def attend(self, i: int, q: torch.Tensor, batch: ForwardBatch, k_caches: list[torch.Tensor],
               v_caches: list[torch.Tensor], launch: LaunchChoices,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """Layer i's attention output (into out where given)."""

    def after_attention(self, i: int, attn: torch.Tensor, hidden: torch.Tensor, launch: LaunchChoices,
                        lora: LoraApplier | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The rest of layer i: (the residual stream, that normalised for the next layer)."""

    def logits(self, x: torch.Tensor, rows: torch.Tensor | None, out: torch.Tensor | None = None,
               lora: LoraApplier | None = None) -> torch.Tensor:
        """The LM head over the final-normed rows `rows` (None: all), with their LM head LoRA,
        into out where given."""
