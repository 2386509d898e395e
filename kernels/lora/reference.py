"""Multi-LoRA shrink/expand in plain PyTorch: the CPU serving path and the kernels' oracle.

One matmul per (adapter group, slice): tokens of a group share their A/B rows, so the loop
runs over the handful of adapters in the batch, never over tokens. Each slot's rows are read
from the arenas at its (rank, first row) on the slice (kernels/lora/rows.py), the rank exact.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .meta import LoraBatchMeta
from .rows import SlotRows


def _token_index(meta: LoraBatchMeta, start: int, length: int, first: int):
    """A slice when the group's tokens are contiguous (no gather copy), else an index tensor."""
    if first >= 0:
        return slice(first, first + length)
    return meta.sorted_token_ids[start:start + length].long()


def _host_rows(slots: SlotRows, meta: LoraBatchMeta) -> dict[int, tuple[list[int], list[int]]]:
    """Per slot of the step's segments: its rank and first row on each slice, read on the host
    in one transfer (only those slots: the tables hold every resident adapter's)."""
    wanted = sorted({seg[0] for seg in meta.segments})
    index = torch.tensor(wanted, dtype=torch.long, device=slots.ranks.device)
    ranks, rows = slots.ranks[:, index].t().tolist(), slots.rows[:, index].t().tolist()
    return {slot: (ranks[j], rows[j]) for j, slot in enumerate(wanted)}


def lora_shrink_ref(x: torch.Tensor, a_stacked: Sequence[torch.Tensor], meta: LoraBatchMeta,
                    scaling: torch.Tensor, slots: SlotRows) -> torch.Tensor:
    """[n_slices, T, R] float32: x[t] @ A_i[slot_t's rows].T * scaling[slot_t], zero past the
    slot's rank on the slice and for slot -1. a_stacked: per slice [rows, in]."""
    out = torch.zeros(len(a_stacked), x.shape[0], slots.max_rank, dtype=torch.float32, device=x.device)
    if not meta.segments:
        return out
    host = _host_rows(slots, meta)
    for slot, start, length, first in meta.segments:
        idx = _token_index(meta, start, length, first)
        xs = x[idx].float()
        scale = scaling[slot].float()  # 0-d tensor
        ranks, firsts = host[slot]
        for i, a in enumerate(a_stacked):
            r, row = min(ranks[i], slots.max_rank), firsts[i]
            if r > 0:
                out[i, idx, :r] = torch.matmul(xs, a[row:row + r].float().t()).mul_(scale)
    return out


def lora_expand_ref(h: torch.Tensor, b_stacked: Sequence[torch.Tensor], meta: LoraBatchMeta,
                    y: torch.Tensor, slice_offsets: Sequence[int], slots: SlotRows,
                    accumulate: bool = True) -> None:
    """y[t, off_i:off_i+out_i] += h[i, t, :r] @ B_i[slot_t's rows] in place (fp32 sum, one
    rounding); accumulate=False writes the delta instead. b_stacked: per slice [rows, out_i].
    A slice the slot leaves alone (rank 0) is not touched."""
    if not meta.segments:
        return
    host = _host_rows(slots, meta)
    for slot, start, length, first in meta.segments:
        idx = _token_index(meta, start, length, first)
        ranks, firsts = host[slot]
        for i, b in enumerate(b_stacked):
            off, n_out = slice_offsets[i], b.shape[1]
            r, row = min(ranks[i], slots.max_rank), firsts[i]
            if r <= 0:
                continue
            delta = torch.matmul(h[i, idx, :r].float(), b[row:row + r].float())
            if not accumulate:
                y[idx, off:off + n_out] = delta.to(y.dtype)
            elif isinstance(idx, slice):
                y[idx, off:off + n_out].add_(delta)  # in place; computed in fp32, rounded once
            else:
                y[idx, off:off + n_out] = (y[idx, off:off + n_out].float() + delta).to(y.dtype)
