"""LoRA beside the base matmuls: decode steps compute each fused projection's delta on a
side CUDA stream while the base matmul runs, and the fused op after it adds the delta.

In a decode step the LoRA kernels are short and many (a shrink and an expand per fused
projection per layer). Run after each matmul, their launch gaps and ramp-up add straight to
the step; run on a second stream from the moment the matmul's input exists, they share the
GPU with it and the step waits only for what is left when the matmul ends. The deltas go to
static float32 buffers (one per fused group, sized for the largest graph batch) that the
next fused elementwise op reads: RoPE for q/k/v, the residual add and norm for o and down,
SiLU for gate/up, so the adds cost no launches of their own.

Why each delta buffer is zeroed once per step rather than per layer: the expand writes, it
does not add, and which (row, slice) pairs it writes depends only on the step's metadata and
the slots' ranks, the same in every layer; rows of base-model requests and padding are
never written and stay zero.

Inside a CUDA graph the fork and join become graph edges, so a replay runs both branches
with no host involvement. On a CPU (CI) there is no side stream: the same code runs in
order, which tests the delta buffers and the fused adds.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch

from kernels.lora import add_lora, lora_workspace_numel
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
        first = buffers.layers[0]
        self.deltas = {group: torch.zeros(max_tokens, sum(b.shape[1] for b in first[group].b),
                                          dtype=torch.float32, device=device)
                       for group in FUSED_MODULES}
        slices = max(len(m) for m in FUSED_MODULES.values())
        self.workspace = torch.empty(lora_workspace_numel(max_tokens, slices, buffers.max_rank),
                                     dtype=torch.float32, device=device)
        self.stream = (torch.cuda.Stream(device, priority=side_priority)
                       if device.type == "cuda" else None)

    def applier(self, meta: LoraBatchMeta, groups: frozenset[str] | None = None) -> "OverlappedLoraApplier":
        return OverlappedLoraApplier(self, meta, groups)


class OverlappedLoraApplier:
    """One step's LoRA on the side stream; `end` joins it and returns the group's delta."""

    def __init__(self, overlap: LoraOverlap, meta: LoraBatchMeta,
                 groups: frozenset[str] | None = None) -> None:
        """groups: the fused groups to apply (None: all); the others launch nothing."""
        tokens = meta.num_tokens
        assert tokens <= overlap.max_tokens, f"{tokens} tokens, delta buffers hold {overlap.max_tokens}"
        self.overlap, self.meta = overlap, meta
        self.deltas = {group: d[:tokens] for group, d in overlap.deltas.items()
                       if groups is None or group in groups}
        with self._side():
            for delta in self.deltas.values():
                delta.zero_()

    def _side(self):
        """The side stream, after all work queued so far on the current one."""
        stream = self.overlap.stream
        if stream is None:
            return nullcontext()
        stream.wait_stream(torch.cuda.current_stream())
        return torch.cuda.stream(stream)

    def begin(self, layer: int, group: str, x: torch.Tensor) -> None:
        if group not in self.deltas:
            return
        buffers = self.overlap.buffers
        buf = buffers.layers[layer][group]
        with self._side():
            add_lora(x, self.deltas[group], buf.a, buf.b, self.meta, buffers.scaling, buf.offsets,
                     slot_ranks=buffers.slice_ranks[group], accumulate=False,
                     workspace=self.overlap.workspace,
                     rank_col=SEGMENT_TABLE_RANKS + GROUP_FIRST_MODULE[group])

    def end(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        if group not in self.deltas:
            return None
        if self.overlap.stream is not None:
            torch.cuda.current_stream().wait_stream(self.overlap.stream)
        return self.deltas[group]
