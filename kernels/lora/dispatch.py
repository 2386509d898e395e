"""Multi-LoRA shrink and expand: the Triton kernels (triton_kernel.py) where Triton runs, the
PyTorch reference (reference.py) elsewhere. A and B are the arenas of rank rows of each slice
(per slice [rows, in] and [rows, out]); `slots` says where each slot's rows lie."""
from __future__ import annotations

from typing import Sequence

import torch

from ..dispatch import triton_kernel
from .meta import MAX_SPLIT_K, LoraBatchMeta
from .reference import lora_expand_ref, lora_shrink_ref
from .rows import SlotRows

TRITON = "kernels.lora.triton_kernel"


def lora_shrink(x: torch.Tensor, a_stacked: Sequence[torch.Tensor], meta: LoraBatchMeta,
                scaling: torch.Tensor, slots: SlotRows) -> torch.Tensor:
    """[n_slices, T, R] float32 rank-space activations, scaled; zero rows for slot -1 and
    zero columns past each slot's rank (R = slots.max_rank)."""
    kernel = triton_kernel(x, TRITON, "lora_shrink_triton")
    if kernel is not None:
        return kernel(x, a_stacked, meta, scaling, slots)
    return lora_shrink_ref(x, a_stacked, meta, scaling, slots)


def lora_shrink_partials(x: torch.Tensor, a_stacked: Sequence[torch.Tensor], meta: LoraBatchMeta,
                         scaling: torch.Tensor, slots: SlotRows, *,
                         workspace: torch.Tensor | None = None,
                         rank_col: int | None = None) -> torch.Tensor:
    """[splits, n_slices, T, R] float32 partial sums whose sum over splits is lora_shrink's
    result: what a kernels.lora.LoraDelta carries to the op that expands it. Columns past a
    slot's rank are zero; on the Triton path rows of slot -1 are left unwritten (a caller
    zeroes its workspace once per step: no shrink ever writes those rows); `workspace` and
    `rank_col` as for add_lora."""
    kernel = triton_kernel(x, TRITON, "lora_shrink_partials")
    if kernel is not None:
        return kernel(x, a_stacked, meta, scaling, slots, zero=False, workspace=workspace,
                      rank_col=rank_col)
    return lora_shrink_ref(x, a_stacked, meta, scaling, slots)[None]


def lora_expand(h: torch.Tensor, b_stacked: Sequence[torch.Tensor], meta: LoraBatchMeta,
                y: torch.Tensor, slice_offsets: Sequence[int], slots: SlotRows, *,
                accumulate: bool = True, rank_col: int | None = None) -> None:
    """Adds h[i] @ B_i[slot's rows] into y's column slice i, in place. h: [n_slices, T, R], or
    lora_shrink_partials' [splits, n_slices, T, R]; accumulate and rank_col as for add_lora."""
    kernel = triton_kernel(y, TRITON, "lora_expand_triton")
    if kernel is not None:
        kernel(h, b_stacked, meta, y, slice_offsets, slots, accumulate=accumulate,
               rank_col=rank_col)
        return
    lora_expand_ref(h.sum(0) if h.dim() == 4 else h, b_stacked, meta, y, slice_offsets, slots,
                    accumulate=accumulate)


def add_lora(x: torch.Tensor, y: torch.Tensor, a_stacked: Sequence[torch.Tensor],
             b_stacked: Sequence[torch.Tensor], meta: LoraBatchMeta, scaling: torch.Tensor,
             slice_offsets: Sequence[int], slots: SlotRows, *,
             accumulate: bool = True, workspace: torch.Tensor | None = None,
             rank_col: int | None = None) -> None:
    """y += LoRA delta of every token's adapter (all slices of a fused projection), in place.
    accumulate=False writes the delta into y's adapter rows instead (y is a delta buffer whose
    other rows the caller keeps at zero); `workspace` is a static float32 buffer for the
    kernels' intermediate sums (lora_workspace_numel); `rank_col`, with meta.segment_table,
    lets the Triton kernels read each segment's slot, rows and this projection's ranks and
    arena rows from one table row (LoraBatchMeta.segment_table)."""
    if meta.num_active_tokens == 0:
        return
    kernel = triton_kernel(y, TRITON, "add_lora_triton")
    if kernel is not None:
        kernel(x, y, a_stacked, b_stacked, meta, scaling, slice_offsets, slots,
               accumulate=accumulate, workspace=workspace, rank_col=rank_col)
        return
    h = lora_shrink_ref(x, a_stacked, meta, scaling, slots)
    lora_expand_ref(h, b_stacked, meta, y, slice_offsets, slots, accumulate=accumulate)


def lora_workspace_numel(max_tokens: int, max_slices: int, rank: int) -> int:
    """Floats of intermediate sums one add_lora call can need (a static workspace's size)."""
    return MAX_SPLIT_K * max_slices * max_tokens * rank
