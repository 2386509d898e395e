"""LoRA beside the base matmuls: decode steps run each fused projection's LoRA shrink on a
side CUDA stream while the base matmul runs, and the fused op after the matmul expands it.

In a decode step the LoRA kernels are short and many. The shrink (x @ A) needs only the
matmul's input, so it runs on a second stream from the moment that input exists, sharing the
GPU with the matmul; the step waits only for what is left of it when the matmul ends. The
expand (h @ B) needs nothing the next op does not already read row by row, so the next fused
op does it (kernels/lora_delta.py): RoPE with the KV-cache write for q/k/v, the residual add
and norm for o and down, SiLU for gate/up. No expand launches, no float32 delta buffers.

The shrink writes its split partial sums into one static workspace (sized for the largest
graph batch) that every group reuses: a group's shrink is queued on the side stream after
the main stream's op that read the previous group's sums. The workspace is zeroed once per
step: rows without an adapter are never written, and must read as zero.

Inside a CUDA graph the fork and join become graph edges, so a replay runs both branches
with no host involvement. On a CPU (CI) there is no side stream: the same code runs in
order, and the fused ops expand the sums with the PyTorch reference.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch

from kernels.lora import lora_shrink_partials, lora_workspace_numel
from kernels.lora_delta import LoraDelta
from kernels.lora_meta import SEGMENT_TABLE_RANKS, LoraBatchMeta

from ..model.llama import FUSED_MODULES, GROUP_FIRST_MODULE
from .slots import SlotBuffers


class LoraOverlap:
    """The static buffers and the side stream that decode-graph appliers share."""

    def __init__(self, buffers: SlotBuffers, max_tokens: int, side_priority: int = 0) -> None:
        """side_priority: the side stream's CUDA priority (0 = default; lower is higher:
        torch.cuda.Stream.priority_range()); CUDA graphs keep it per kernel node."""
        self.buffers = buffers
        self.max_tokens = max_tokens
        device = buffers.device
        slices = max(len(m) for m in FUSED_MODULES.values())
        self.workspace = torch.empty(lora_workspace_numel(max_tokens, slices, buffers.max_rank),
                                     dtype=torch.float32, device=device)
        self.stream = (torch.cuda.Stream(device, priority=side_priority)
                       if device.type == "cuda" else None)

    def applier(self, meta: LoraBatchMeta, groups: frozenset[str] | None = None) -> "OverlappedLoraApplier":
        return OverlappedLoraApplier(self, meta, groups)


class OverlappedLoraApplier:
    """One step's LoRA shrinks on the side stream; `end` joins and returns the group's delta,
    unexpanded, for the op after the matmul."""

    def __init__(self, overlap: LoraOverlap, meta: LoraBatchMeta,
                 groups: frozenset[str] | None = None) -> None:
        """groups: the fused groups to apply (None: all); the others launch nothing."""
        tokens = meta.num_tokens
        assert tokens <= overlap.max_tokens, f"{tokens} tokens, the workspace holds {overlap.max_tokens}"
        self.overlap, self.meta = overlap, meta
        self.groups = frozenset(FUSED_MODULES) if groups is None else groups
        self._partials: torch.Tensor | None = None
        with self._side():
            # Rows without an adapter are in no segment: no shrink of this step writes them,
            # so zeroed here they stay zero for every group's sums (kernels/lora_delta.py).
            overlap.workspace.zero_()

    def _side(self):
        """The side stream, after all work queued so far on the current one."""
        stream = self.overlap.stream
        if stream is None:
            return nullcontext()
        stream.wait_stream(torch.cuda.current_stream())
        return torch.cuda.stream(stream)

    def begin(self, layer: int, group: str, x: torch.Tensor) -> None:
        if group not in self.groups:
            return
        buffers = self.overlap.buffers
        buf = buffers.layers[layer][group]
        with self._side():
            self._partials = lora_shrink_partials(
                x, buf.a, self.meta, buffers.scaling, buffers.slice_ranks[group],
                workspace=self.overlap.workspace,
                rank_col=SEGMENT_TABLE_RANKS + GROUP_FIRST_MODULE[group])

    def end(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> LoraDelta | None:
        if group not in self.groups:
            return None
        if self.overlap.stream is not None:
            torch.cuda.current_stream().wait_stream(self.overlap.stream)
        buffers = self.overlap.buffers
        return LoraDelta(self._partials, tuple(buffers.layers[layer][group].b),
                         self.meta.token_slots)
