"""Multi-LoRA shrink/expand in plain PyTorch: the CPU serving path and the kernels' oracle.

One matmul per (adapter group, slice): tokens of a group share their A/B matrices, so the
loop runs over the handful of adapters in the batch, never over tokens.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .meta import LoraBatchMeta


def _token_index(meta: LoraBatchMeta, start: int, length: int, first: int):
    """A slice when the group's tokens are contiguous (no gather copy), else an index tensor."""
    if first >= 0:
        return slice(first, first + length)
    return meta.sorted_token_ids[start:start + length].long()


def lora_shrink_ref(x: torch.Tensor, a_stacked: Sequence[torch.Tensor], meta: LoraBatchMeta,
                    scaling: torch.Tensor) -> torch.Tensor:
    """[n_slices, T, R] float32: x[t] @ A_i[slot_t].T * scaling[slot_t]; zero for slot -1."""
    rank = a_stacked[0].shape[1]
    out = torch.zeros(len(a_stacked), x.shape[0], rank, dtype=torch.float32, device=x.device)
    for slot, start, length, first in meta.segments:
        idx = _token_index(meta, start, length, first)
        xs = x[idx].float()
        scale = scaling[slot].float()  # 0-d tensor: no host sync on CUDA
        for i, a in enumerate(a_stacked):
            out[i, idx] = torch.matmul(xs, a[slot].float().t()).mul_(scale)
    return out


def lora_expand_ref(h: torch.Tensor, b_stacked: Sequence[torch.Tensor], meta: LoraBatchMeta,
                    y: torch.Tensor, slice_offsets: Sequence[int], accumulate: bool = True) -> None:
    """y[t, off_i:off_i+out_i] += h[i, t] @ B_i[slot_t].T in place (fp32 sum, one rounding);
    accumulate=False writes the delta instead."""
    for slot, start, length, first in meta.segments:
        idx = _token_index(meta, start, length, first)
        for i, b in enumerate(b_stacked):
            off, n_out = slice_offsets[i], b.shape[1]
            delta = torch.matmul(h[i, idx].float(), b[slot].float().t())
            if not accumulate:
                y[idx, off:off + n_out] = delta.to(y.dtype)
            elif isinstance(idx, slice):
                y[idx, off:off + n_out].add_(delta)  # in place; computed in fp32, rounded once
            else:
                y[idx, off:off + n_out] = (y[idx, off:off + n_out].float() + delta).to(y.dtype)
