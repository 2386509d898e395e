"""LoRA beside the base matmuls: decode steps run each fused projection's LoRA shrink on a
side CUDA stream while the base matmul runs, and the fused op after the matmul expands it.
(Or, for the groups in FOLD_GROUPS, inside the matmul itself: kernels/lora_gemm.py; and for
those in SHRINK_FOLD_GROUPS, the shrink inside the matmul and the expand in the op after it.)

In a decode step the LoRA kernels are short and many. The shrink (x @ A) needs only the
matmul's input, so it runs on a second stream from the moment that input exists, sharing the
GPU with the matmul; the step waits only for what is left of it when the matmul ends. The
expand (h @ B) needs nothing the next op does not already read row by row, so the next fused
op does it (kernels/lora_delta.py): RoPE with the KV-cache write for q/k/v, the residual add
and norm for o and down, SiLU for gate/up. No expand launches, no float32 delta buffers.

Except in steps with few distinct adapters (at most SIDE_EXPAND_SEGMENTS): there the expand
also runs on the side stream, right after the shrink, into a float32 delta buffer, and the
next op adds that delta, a read of 4 bytes a column instead of the adapter's B for every row.
With few segments the expand kernel reads each B tile once for all of a segment's rows,
where the fused ops read B once per row, which was most of their cost. With many adapters
the expand kernel walks many small segments and the side stream holds SMs the matmul wants,
so those steps keep the expand in the next op. Measured (H100, batch 64, decode_profile.py
--modes overlap-sidex0,overlap-sidexN, graph replay over base): c1 +0.299 -> +0.223 ms, c2
+0.304 -> +0.249, c4 +0.315 -> +0.243, c8 +0.342 -> +0.327; in another run, c32 +0.494 ->
+0.707 when side-expanded too. One group has a higher bound of its own
(SIDE_EXPAND_GROUP_SEGMENTS): down, whose matmul is long enough to hide its expand up to 32
adapters.

The shrink writes its split partial sums into one static workspace (sized for the largest
graph batch) that every group reuses: a group's shrink is queued on the side stream after
the main stream's op that read the previous group's sums. The workspace is zeroed once per
step: rows without an adapter are never written, and must read as zero.

Inside a CUDA graph the fork and join become graph edges, so a replay runs both branches
with no host involvement. On a CPU (CI) there is no side stream: the same code runs in
order, and the fused ops expand the sums with the PyTorch reference.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from contextlib import nullcontext

import torch

from kernels.lora import lora_expand, lora_shrink_partials, lora_workspace_numel
from kernels.lora_delta import ColumnSplit, LoraDelta
from kernels.lora_gemm import GemmLora
from kernels.lora_meta import SEGMENT_TABLE_RANKS, LoraBatchMeta

from ..model.llama import FUSED_MODULES, GROUP_FIRST_MODULE
from .slots import SlotBuffers

GROUP_INDEX = {g: i for i, g in enumerate(FUSED_MODULES)}
# Groups whose LoRA their decode matmul adds in the same launch (kernels/lora_gemm.py): the
# shrink as more programs of the GEMM, each row's B read beside the weight stream, no side
# stream and no expand in the add + norm after it. H100, batch 64 (decode_profile.py, graph
# replay over base, modes overlap and overlap-fold-o): c1 +0.219 -> +0.211 ms, c8 +0.294 ->
# +0.294, c32 +0.442 -> +0.425, c64 +0.693 -> +0.675. Folding q/k/v too lost at 32 and 64
# adapters (+0.447, +0.780), gate/up lost everywhere (c32 +0.503): their shrink programs
# (one per adapter and slice) and the tail after the matmul cost more than the op after it
# saves.
FOLD_GROUPS: tuple[str, ...] = ("o",)
# Steps with at most this many distinct adapters expand on the side stream (module docstring).
SIDE_EXPAND_SEGMENTS = 8
# Per group, a higher such bound: down's matmul is long enough (it reads 4x o's weights) that
# its shrink and expand both fit beside it up to 32 adapters, and the add + norm after it then
# reads the delta instead of expanding it per row. H100, batch 64 (decode_profile.py, graph
# replay over base): c32 +0.480 -> +0.444 ms; o with it +0.455, gate/up +0.619; c64 loses
# (+0.695 -> +0.728), hence the bound.
SIDE_EXPAND_GROUP_SEGMENTS: dict[str, int] = {"down": 32}


def env_groups(var: str, default: tuple[str, ...],
               allowed: tuple[str, ...] = tuple(FUSED_MODULES)) -> frozenset[str]:
    """A set of fused groups from environment variable `var`: comma-separated names of
    `allowed`, "all" for every one of them, "none" for none; unset: `default`."""
    raw = os.environ.get(var, ",".join(default))
    names = allowed if raw == "all" else [g for g in raw.split(",") if g and g != "none"]
    unknown = set(names) - set(allowed)
    if unknown:
        raise ValueError(f"{var} names groups {sorted(unknown)} it cannot take: expected some "
                         f"of {', '.join(allowed)} or all")
    return frozenset(names)


def gemm_fold_groups() -> frozenset[str]:
    """LORA_GEMM_FOLD: the fused groups whose LoRA the decode graphs fold into the group's
    matmul (kernels/lora_gemm.py); default FOLD_GROUPS."""
    return env_groups("LORA_GEMM_FOLD", FOLD_GROUPS)


# Groups whose shrink their decode matmul computes in the same launch (more programs of the
# GEMM, no side stream) while the op after it expands, in steps that do not expand them on
# the side stream. No graph edge from a side stream then holds that op back: launched early
# (PDL) it reads its rows' B while the GEMM streams its weights (kernels/_host.py:
# early_b_enabled). H100, batch 64 (decode_profile.py, graph replay over base, one process):
# c32 +0.484 (side stream) -> +0.451 (q/k/v) -> +0.395 ms (q/k/v and gate/up), c64 +0.703 ->
# +0.685 -> +0.641; gate/up alone +0.429 / +0.661. o is in FOLD_GROUPS too: it folds whole in
# steps of at most SIDE_EXPAND_SEGMENTS adapters and only its shrink in the rest, the split
# add + norm after it (NORM_SPLIT_GROUPS) reading B before its wait: c16 +0.299 -> +0.285,
# c32 +0.395 -> +0.387 (32 adapters on o alone +0.063 -> +0.055), while c1 and c8 lost 0.02
# without the whole fold (+0.234 -> +0.251, +0.302 -> +0.325).
SHRINK_FOLD_GROUPS: tuple[str, ...] = ("qkv", "gate_up", "o")


def gemm_shrink_fold_groups() -> frozenset[str]:
    """LORA_GEMM_SHRINK_FOLD: the fused groups whose shrink the decode graphs fold into the
    group's matmul while the op after it expands (GemmLora.expand False); default
    SHRINK_FOLD_GROUPS. Every op after a matmul (RoPE + KV write, SiLU, the add + norm) reads
    no sums for rows without an adapter, which a shrink-only fold leaves unwritten."""
    return env_groups("LORA_GEMM_SHRINK_FOLD", SHRINK_FOLD_GROUPS)


# The LoRA add + norm after these groups' matmuls spreads each row over programs of
# NORM_SPLIT_COLUMNS columns (kernels/norm_triton.py: the row's last program to finish
# normalises it). For o with its shrink in its GEMM, each program reads its B columns before
# its wait (a whole row's B is too much for one program to hold), H100, batch 64, graph
# replay over base, one process: 32 adapters on o alone +0.064 (one program a row) -> +0.055
# (512) / +0.055 (1024) / +0.065 (256); c32 +0.397 -> +0.385 / +0.389 / +0.397. Down's
# add + norm, adding a delta expanded on the side stream, lost with it (c32 +0.398 ->
# +0.404; 32 adapters on down alone +0.077 -> +0.093).
NORM_SPLIT_COLUMNS = 512
NORM_SPLIT_GROUPS: tuple[str, ...] = ("o",)


def norm_split_columns() -> int:
    """LORA_NORM_SPLIT: columns per program of the LoRA add + norm after the groups of
    LORA_NORM_SPLIT_GROUPS in graph steps; 0 keeps one program a row; default
    NORM_SPLIT_COLUMNS."""
    return int(os.environ.get("LORA_NORM_SPLIT", str(NORM_SPLIT_COLUMNS)))


def norm_split_groups() -> frozenset[str]:
    """LORA_NORM_SPLIT_GROUPS: the groups (o, down: those an add + norm follows) whose add +
    norm takes the column split where LORA_NORM_SPLIT sets one; default NORM_SPLIT_GROUPS."""
    return env_groups("LORA_NORM_SPLIT_GROUPS", NORM_SPLIT_GROUPS, ("o", "down"))


class LoraOverlap:
    """The static buffers and the side stream that decode-graph appliers share."""

    def __init__(self, buffers: SlotBuffers, max_tokens: int,
                 side_expand_segments: int = SIDE_EXPAND_SEGMENTS,
                 norm_split: int | None = None,
                 side_expand_group_segments: Mapping[str, int] | None = None,
                 fold_groups: frozenset[str] | None = None,
                 shrink_fold_groups: frozenset[str] | None = None,
                 split_groups: frozenset[str] | None = None) -> None:
        """side_expand_segments: steps with at most this many distinct adapters (segments) run
        the expands on the side stream too (0: never). norm_split: columns per program of
        the add + norm that expands o's and down's deltas (0: one program a row; None:
        LORA_NORM_SPLIT). side_expand_group_segments: per group, steps with at most this many
        segments expand that group on the side stream even above side_expand_segments (None:
        SIDE_EXPAND_GROUP_SEGMENTS). fold_groups: the groups whose LoRA their matmul adds in
        the same launch in steps with a segment table (None: LORA_GEMM_FOLD). split_groups:
        of o and down, those whose add + norm takes the column split (None:
        LORA_NORM_SPLIT_GROUPS)."""
        self.buffers = buffers
        self.max_tokens = max_tokens
        self.side_expand_segments = side_expand_segments
        self.side_expand_group_segments = dict(SIDE_EXPAND_GROUP_SEGMENTS
                                               if side_expand_group_segments is None
                                               else side_expand_group_segments)
        device = buffers.device
        slices = max(len(m) for m in FUSED_MODULES.values())
        self.workspace = torch.empty(lora_workspace_numel(max_tokens, slices, buffers.max_rank),
                                     dtype=torch.float32, device=device)
        # A delta buffer per group, which its layers reuse: an expand writes the rows whose
        # adapter targets the group, the same ones in every layer, and the other rows stay as
        # zeroed at the step's start (a buffer shared between groups would keep one group's
        # delta in rows whose adapter leaves the other alone).
        self.deltas = ({g: torch.empty(max_tokens, sum(b.shape[1] for b in buffers.layers[0][g].b),
                                       dtype=torch.float32, device=device)
                        for g in FUSED_MODULES}
                       if max([side_expand_segments, *self.side_expand_group_segments.values()]) > 0
                       and buffers.layers else {})
        # Folded groups: their shrink's rows (one group at a time: a folded matmul writes them
        # after the kernel before it has finished) and the counters of each launch site and
        # grid size (by the step's segment bucket).
        self.fold_groups = gemm_fold_groups() if fold_groups is None else frozenset(fold_groups)
        self.shrink_fold_groups = (gemm_shrink_fold_groups() if shrink_fold_groups is None
                                   else frozenset(shrink_fold_groups))
        rank = buffers.max_rank
        if rank < 16 or rank & (rank - 1):  # the kernel's tensor-core tiles need these ranks
            self.fold_groups = self.shrink_fold_groups = frozenset()
        ranks = slices * buffers.max_rank
        any_fold = bool(self.fold_groups or self.shrink_fold_groups)
        self.fold_xa = (torch.empty(max_tokens, ranks, dtype=torch.float32, device=device)
                        if self.fold_groups else None)
        # The shrink-only folds' rows, read by the op after the matmul: a buffer of their own,
        # so no full fold's launch overwrites them before that op has read them.
        self.shrink_fold_xa = (torch.empty(max_tokens, ranks, dtype=torch.float32, device=device)
                               if self.shrink_fold_groups else None)
        self.fold_sync = (torch.zeros(max_tokens + 1, len(buffers.layers), len(FUSED_MODULES), 2,
                                      dtype=torch.int64, device=device)
                          if any_fold else None)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # The add + norm's per-row arrival counts and partial sums over the hidden width (o's
        # output), shared by every o and down of a step: those launches run one after
        # another on the main stream.
        norm_split = norm_split_columns() if norm_split is None else norm_split
        self.column_split = (ColumnSplit.allocate(norm_split, max_tokens,
                                                  buffers.layers[0]["o"].b[0].shape[1], device)
                             if norm_split > 0 and buffers.layers else None)
        self.split_groups = norm_split_groups() if split_groups is None else frozenset(split_groups)

    def split_for(self, group: str) -> ColumnSplit | None:
        """The column split of the add + norm after `group`'s matmul, if it takes one."""
        return self.column_split if group in self.split_groups else None

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
        # The groups whose matmul adds their LoRA itself (rows grouped by adapter only). A
        # group in both fold sets folds whole only in steps of few adapters (those whose other
        # groups expand on the side stream), and only its shrink in the rest.
        few = meta.num_segments <= overlap.side_expand_segments
        self.folded = (self.groups & (overlap.fold_groups if few else
                                      overlap.fold_groups - overlap.shrink_fold_groups)
                       if meta.segment_table is not None and meta.num_segments > 0 else frozenset())
        self._partials: torch.Tensor | None = None
        self._expanded: torch.Tensor | None = None
        # The groups whose expand runs on the side stream in this step.
        self.side_expand = frozenset(
            g for g in self.groups - self.folded
            if 0 < meta.num_segments <= max(overlap.side_expand_segments,
                                            overlap.side_expand_group_segments.get(g, 0)))
        # The groups whose matmul shrinks for the op after it to expand (not those expanded
        # on the side stream in this step).
        self.shrink_folded = (self.groups & overlap.shrink_fold_groups) - self.side_expand \
            - self.folded if meta.segment_table is not None and meta.num_segments > 0 else frozenset()
        if not self.groups - self.folded - self.shrink_folded:
            return  # every group's matmul adds its own LoRA: no side work this step
        with self._side():
            # Rows without an adapter are in no segment: no shrink of this step writes them,
            # so zeroed here they stay zero for every group's sums (kernels/lora_delta.py).
            overlap.workspace.zero_()
            for group in self.side_expand:  # the same for the expanded deltas' rows
                overlap.deltas[group][:tokens].zero_()

    def _side(self):
        """The side stream, after all work queued so far on the current one."""
        stream = self.overlap.stream
        if stream is None:
            return nullcontext()
        stream.wait_stream(torch.cuda.current_stream())
        return torch.cuda.stream(stream)

    def fold(self, layer: int, group: str) -> GemmLora | None:
        expand = group in self.folded
        if not expand and group not in self.shrink_folded:
            return None
        overlap = self.overlap
        buf = overlap.buffers.layers[layer][group]
        segments = self.meta.num_segments
        return GemmLora(buf.a_all, buf.b_all, overlap.buffers.scaling, tuple(buf.offsets),
                        self.meta.segment_table, segments, self.meta.token_slots,
                        overlap.fold_xa if expand else overlap.shrink_fold_xa,
                        overlap.fold_sync[segments, layer, GROUP_INDEX[group]], expand,
                        None if expand else overlap.split_for(group))

    def begin(self, layer: int, group: str, x: torch.Tensor) -> None:
        if group not in self.groups:
            return
        buffers = self.overlap.buffers
        buf = buffers.layers[layer][group]
        rank_col = SEGMENT_TABLE_RANKS + GROUP_FIRST_MODULE[group]
        self._expanded = None
        with self._side():
            self._partials = lora_shrink_partials(
                x, buf.a, self.meta, buffers.scaling, buffers.slice_ranks[group],
                workspace=self.overlap.workspace, rank_col=rank_col)
            if group in self.side_expand:
                self._expanded = self.overlap.deltas[group][:self.meta.num_tokens]
                lora_expand(self._partials, buf.b, self.meta, self._expanded, buf.offsets,
                            buffers.slice_ranks[group], accumulate=False, rank_col=rank_col)

    def end(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> LoraDelta | None:
        if group not in self.groups:
            return None
        if self.overlap.stream is not None:
            torch.cuda.current_stream().wait_stream(self.overlap.stream)
        buffers = self.overlap.buffers
        return LoraDelta(self._partials, tuple(buffers.layers[layer][group].b),
                         self.meta.token_slots, self._expanded, self.overlap.split_for(group))
