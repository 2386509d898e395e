"""LoRA beside the base matmuls in decode graph steps: each fused projection's LoRA shrink runs
on a side CUDA stream while the base matmul runs, and the fused op after the matmul expands
it. Or, for the groups of Tuning.fold_groups, inside the matmul itself (kernels/gemm/fold.py);
and for those of Tuning.shrink_fold_groups, the shrink inside the matmul and the expand in the
op after it.

In a decode step the LoRA kernels are short and many. The shrink (x @ A) needs only the
matmul's input, so it runs on a second stream from the moment that input exists, sharing the
GPU with the matmul; the step waits only for what is left of it when the matmul ends. The
expand (h @ B) needs nothing the next op does not already read row by row, so the next fused
op does it (kernels/lora/delta.py): RoPE with the KV-cache write for q/k/v, the residual add
and norm for o and down, SiLU for gate/up. No expand launches, no float32 delta buffers.

Except in steps with few distinct adapters (at most Tuning.side_expand_segments): there the
expand also runs on the side stream, right after the shrink, into a float32 delta buffer, and
the next op adds that delta, a read of 4 bytes a column instead of the adapter's B for every
row. With few segments the expand kernel reads each B tile once for all of a segment's rows,
where the fused ops read B once per row. With many adapters the expand kernel walks many
small segments and the side stream holds SMs the matmul wants, so those steps keep the expand
in the next op. One group has a higher bound of its own (Tuning.side_expand_group_segments):
down, whose matmul is long enough to hide its expand up to 32 adapters.

A shrink folded into its matmul leaves no side-stream edge before the op after it: launched
early (PDL) that op reads its rows' B while the GEMM streams its weights. A group in both
fold sets (o) folds whole in steps of few adapters and only its shrink in the rest, where the
add + norm after it, split into column programs (Tuning.norm_split_groups), reads B before
its wait. A delta expanded on the side stream has no B left to read: its add + norm takes one
program a row (measured faster at 16 adapters, docs/PERFORMANCE.md).

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
from typing import Mapping, NamedTuple

import torch

from kernels.gemm import GemmLora, fold_counters
from kernels.host import num_sms
from kernels.lora import (MODULE_COLUMNS, SEGMENT_TABLE_RANKS, ColumnSplit, LoraBatchMeta,
                          LoraDelta, lora_expand, lora_shrink_partials, lora_workspace_numel)
from kernels.tuning import DEFAULT_TUNING, Tuning

from ...adapters.slots import SlotBuffers
from ...model.llama import FUSED_MODULES, GROUP_FIRST_MODULE

GROUP_INDEX = {g: i for i, g in enumerate(FUSED_MODULES)}
MAX_SHRINK_SPLITS = 8  # K ranges of a shrink spread over a GEMM's tile programs


class LoraOverlap:
    """The static buffers and the side stream that decode-graph appliers share."""

    def __init__(self, buffers: SlotBuffers, max_tokens: int,
                 tuning: Tuning = DEFAULT_TUNING) -> None:
        """max_tokens: the largest graph batch. tuning: which groups fold into their matmul,
        which expand on the side stream and which add + norms split (module docstring)."""
        self.buffers = buffers
        self.max_tokens = max_tokens
        self.side_expand_segments = tuning.side_expand_segments
        self.side_expand_group_segments = dict(tuning.side_expand_group_segments)
        device = buffers.device
        slices = max(len(m) for m in FUSED_MODULES.values())
        self.workspace = torch.empty(lora_workspace_numel(max_tokens, slices, buffers.max_rank),
                                     dtype=torch.float32, device=device)
        # A delta buffer per group, which its layers reuse: an expand writes the rows whose
        # adapter targets the group, the same ones in every layer, and the other rows stay as
        # zeroed at the step's start (a buffer shared between groups would keep one group's
        # delta in rows whose adapter leaves the other alone).
        self.deltas = ({g: torch.empty(max_tokens, buffers.layers[0][g].b_all.shape[1],
                                       dtype=torch.float32, device=device)
                        for g in FUSED_MODULES}
                       if max([self.side_expand_segments,
                               *self.side_expand_group_segments.values()]) > 0
                       and buffers.layers else {})
        # Folded groups: their shrink's rows (one group at a time: a folded matmul writes them
        # after the kernel before it has finished) and the counters of each launch site and
        # grid size (by the step's segment bucket).
        self.fold_groups = tuning.fold_groups
        self.shrink_fold_groups = tuning.shrink_fold_groups
        rank = buffers.max_rank
        if rank < 16 or rank & (rank - 1):  # the kernel's tensor-core tiles need these ranks
            self.fold_groups = self.shrink_fold_groups = frozenset()
        ranks = slices * buffers.max_rank
        any_fold = bool(self.fold_groups or self.shrink_fold_groups)
        self.fold_xa = (torch.empty(max_tokens, ranks, dtype=torch.float32, device=device)
                        if self.fold_groups else None)
        # The shrink-only folds' rows, read by the op after the matmul: a buffer of their own,
        # so no full fold's launch overwrites them before that op has read them; room for
        # MAX_SHRINK_SPLITS partial sums a row where the tile programs shrink.
        self.shrink_fold_spread = tuning.fold_shrink_spread & self.shrink_fold_groups
        self.shrink_fold_xa = (torch.empty(max_tokens, ranks * (MAX_SHRINK_SPLITS if
                                                                self.shrink_fold_spread else 1),
                                           dtype=torch.float32, device=device)
                               if self.shrink_fold_groups else None)
        self.sms = num_sms(device)
        self.fold_sync = (fold_counters(max_tokens + 1, len(buffers.layers), len(FUSED_MODULES),
                                        device=device)
                          if any_fold else None)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # The add + norm's per-row arrival counts and partial sums over the hidden width (o's
        # output), shared by every o and down of a step: those launches run one after
        # another on the main stream.
        norm_split = tuning.norm_split_columns
        self.column_split = (ColumnSplit.allocate(norm_split, max_tokens,
                                                  buffers.layers[0]["o"].b_all.shape[1], device)
                             if norm_split > 0 and buffers.layers else None)
        self.split_groups = tuning.norm_split_groups

    def split_for(self, group: str) -> ColumnSplit | None:
        """The column split of the add + norm after `group`'s matmul, if it takes one."""
        return self.column_split if group in self.split_groups else None

    def applier(self, meta: LoraBatchMeta, groups: frozenset[str] | None = None) -> "OverlappedLoraApplier":
        return OverlappedLoraApplier(self, meta, groups)


class StepLoraPlan(NamedTuple):
    """Where each fused group's LoRA runs in a step (module docstring)."""

    folded: frozenset[str]         # the matmul adds it whole (GemmLora.expand)
    shrink_folded: frozenset[str]  # the matmul shrinks, the op after it expands
    side_expand: frozenset[str]    # shrink and expand on the side stream


def step_lora_plan(groups: frozenset[str], segments: int, segment_table: bool,
                   fold_groups: frozenset[str], shrink_fold_groups: frozenset[str],
                   side_expand_segments: int,
                   side_expand_group_segments: Mapping[str, int]) -> StepLoraPlan:
    """The plan of a step of `segments` distinct adapters over `groups`; folds need the rows
    grouped by adapter (a segment table). Also what the tuner (inference_node/tuner/sweep.py)
    times the folded GEMM in, so its sweep and the node agree on which groups fold, and how."""
    grouped = segment_table and segments > 0
    # A group in both fold sets folds whole only in steps of few adapters (those whose other
    # groups expand on the side stream), and only its shrink in the rest.
    few = segments <= side_expand_segments
    folded = (groups & (fold_groups if few else fold_groups - shrink_fold_groups)
              if grouped else frozenset())
    side_expand = frozenset(
        g for g in groups - folded
        if 0 < segments <= max(side_expand_segments, side_expand_group_segments.get(g, 0)))
    # The groups whose matmul shrinks for the op after it to expand (not those expanded on
    # the side stream in this step).
    shrink_folded = ((groups & shrink_fold_groups) - side_expand - folded
                     if grouped else frozenset())
    return StepLoraPlan(frozenset(folded), frozenset(shrink_folded), side_expand)


def tuning_lora_plan(tuning: Tuning, segments: int,
                     groups: frozenset[str] = frozenset(FUSED_MODULES)) -> StepLoraPlan:
    """step_lora_plan under `tuning`'s fold sets, rows grouped by adapter (a decode graph's
    step) and a rank the fold kernel takes."""
    return step_lora_plan(groups, segments, True, tuning.fold_groups, tuning.shrink_fold_groups,
                          tuning.side_expand_segments, tuning.side_expand_group_segments)


class OverlappedLoraApplier:
    """One step's LoRA shrinks on the side stream; `end` joins and returns the group's delta,
    unexpanded, for the op after the matmul."""

    edge = None  # decode graphs never run a step whose adapters have embedding or LM head LoRA
    experts = None  # a mixture of experts' expert LoRA (plan.GraphAppliers sets it in its variant)
    adds_into_output = False  # the op after the matmul adds every delta

    def __init__(self, overlap: LoraOverlap, meta: LoraBatchMeta,
                 groups: frozenset[str] | None = None) -> None:
        """groups: the fused groups to apply (None: all); the others launch nothing."""
        tokens = meta.num_tokens
        assert tokens <= overlap.max_tokens, f"{tokens} tokens, the workspace holds {overlap.max_tokens}"
        self.overlap, self.meta = overlap, meta
        self.groups = frozenset(FUSED_MODULES) if groups is None else groups
        # The groups whose matmul adds their LoRA itself (rows grouped by adapter only). A
        # group in both fold sets folds whole only in steps of few adapters (those whose other
        # groups expand on the side stream), and only its shrink in the rest.
        self.folded, self.shrink_folded, self.side_expand = step_lora_plan(
            self.groups, meta.num_segments, meta.segment_table is not None, overlap.fold_groups,
            overlap.shrink_fold_groups, overlap.side_expand_segments,
            overlap.side_expand_group_segments)
        self._partials: torch.Tensor | None = None
        self._expanded: torch.Tensor | None = None
        # Zeroed with the step's first shrink on the side stream, whose end() joins it: a step
        # that shrinks nothing there (every group folded, or a mixture of experts' routed
        # layers, which have no dense gate/up or down) leaves no side work unjoined, which a
        # decode graph's capture refuses.
        self._zeroed = False

    def _zero_rows(self) -> None:
        """Rows without an adapter are in no segment: no shrink of this step writes them, so
        zeroed here they stay zero for every group's sums (kernels/lora/delta.py); the same
        for the expanded deltas' rows. On the side stream, before the first shrink."""
        self.overlap.workspace.zero_()
        for group in self.side_expand:
            self.overlap.deltas[group][:self.meta.num_tokens].zero_()
        self._zeroed = True

    def _side(self):
        """The side stream, after all work queued so far on the current one."""
        stream = self.overlap.stream
        if stream is None:
            return nullcontext()
        stream.wait_stream(torch.cuda.current_stream())
        return torch.cuda.stream(stream)

    def applies_to(self, group: str) -> bool:
        return group in self.groups

    def fold(self, layer: int, group: str) -> GemmLora | None:
        expand = group in self.folded
        if not expand and group not in self.shrink_folded:
            return None
        overlap = self.overlap
        buf = overlap.buffers.layers[layer][group]
        segments = self.meta.num_segments
        splits = (spread_splits(overlap.sms, segments, len(buf.offsets))
                  if not expand and group in overlap.shrink_fold_spread else 0)
        return GemmLora(buf.a_all, buf.b_all, overlap.buffers.scaling, tuple(buf.offsets),
                        self.meta.segment_table, segments, _rank_col(group),
                        overlap.buffers.max_rank, self.meta.token_slots,
                        self._token_rows(group),
                        overlap.fold_xa if expand else overlap.shrink_fold_xa,
                        overlap.fold_sync[segments, layer, GROUP_INDEX[group]], expand,
                        None if expand else overlap.split_for(group), splits)

    def _token_rows(self, group: str) -> torch.Tensor:
        """[T, 2 x slices]: each row's adapter's (rank, first row) on the group's slices."""
        first = MODULE_COLUMNS * GROUP_FIRST_MODULE[group]
        return self.meta.token_table[:, first:first + MODULE_COLUMNS * len(FUSED_MODULES[group])]

    def begin(self, layer: int, group: str, x: torch.Tensor) -> None:
        if group not in self.groups:
            return
        buffers = self.overlap.buffers
        buf = buffers.layers[layer][group]
        rank_col = _rank_col(group)
        slots = buffers.slot_rows(group)
        self._expanded = None
        with self._side():
            if not self._zeroed:
                self._zero_rows()
            self._partials = lora_shrink_partials(
                x, buf.a, self.meta, buffers.scaling, slots,
                workspace=self.overlap.workspace, rank_col=rank_col)
            if group in self.side_expand:
                self._expanded = self.overlap.deltas[group][:self.meta.num_tokens]
                lora_expand(self._partials, buf.b, self.meta, self._expanded, buf.offsets,
                            slots, accumulate=False, rank_col=rank_col)

    def end(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> LoraDelta | None:
        if group not in self.groups:
            return None
        if self.overlap.stream is not None:
            torch.cuda.current_stream().wait_stream(self.overlap.stream)
        buffers = self.overlap.buffers
        # The split lets the add + norm read B before its wait; an expanded delta has no B to
        # read, and one program a row adds it faster (module docstring).
        split = self.overlap.split_for(group) if self._expanded is None else None
        return LoraDelta(self._partials, tuple(buffers.layers[layer][group].b),
                         self._token_rows(group), self._expanded, split)


def spread_splits(sms: int, segments: int, slices: int) -> int:
    """The K ranges of a shrink spread over its GEMM's tile programs (GemmLora.shrink_splits):
    about one unit of (segment, slice, K range) an SM, so the tile programs share it evenly."""
    return max(1, min(MAX_SHRINK_SPLITS, sms // max(segments * slices, 1)))


def _rank_col(group: str) -> int:
    """The segment table's column of the group's first slice's rank."""
    return SEGMENT_TABLE_RANKS + MODULE_COLUMNS * GROUP_FIRST_MODULE[group]
