"""What a decoder's forward pass takes besides its weights: one step's flattened inputs
(ForwardBatch) and the LoRA deltas of its tokens (LoraApplier). Decoders of every family take
the same two, so the runner stages and hooks them without knowing the model's internals."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from kernels.gemm import GemmLora
from kernels.lora import LoraDelta


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
