"""Where each adapter's LoRA weights lie: arenas of rank rows shared by every adapter.

A projection slice (q, k, v, o, gate, up or down) keeps its adapters' weights in two arenas of
rank rows: A as [rows, in] (row k of an adapter: its A's row k) and B as [rows, out] (row k:
its B's column k). An adapter of rank r holds r consecutive rows of each slice it targets, so
mixed ranks cost their own size, not the largest rank's. A kernel finds a slot's rows from
its (rank, first row) on the slice: where it used to add `slot x slot stride` it adds `first
row x row stride`, and it reads no row past the rank (those belong to other adapters).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SlotRows:
    """Each adapter slot's run of rank rows on each slice of one fused projection."""

    ranks: torch.Tensor   # [n_slices, S] int32: the slot's rank on the slice (0: not targeted)
    rows: torch.Tensor    # [n_slices, S] int32: the first arena row of its run there
    max_rank: int         # the largest rank a slot may have: the kernels' rank tile

    @classmethod
    def shared(cls, ranks: torch.Tensor, rows: torch.Tensor, n_slices: int,
               max_rank: int) -> "SlotRows":
        """The same [S] ranks and rows on every slice (stride-0 views)."""
        return cls(ranks.expand(n_slices, -1), rows.expand(n_slices, -1), max_rank)

    def host(self, slice_id: int, slot: int) -> tuple[int, int]:
        """(rank, first row) of a slot on a slice, read on the host (the references)."""
        return int(self.ranks[slice_id, slot]), int(self.rows[slice_id, slot])


def gather_rows(arena: torch.Tensor, first: torch.Tensor, rank: torch.Tensor,
                max_rank: int) -> torch.Tensor:
    """[T, max_rank, width] float32: for each row t, arena rows first[t] .. first[t] + rank[t]
    - 1 and zeros past rank[t] (a rank of 0: all zeros). Vectorised, no host sync: the
    references that run inside CUDA graphs use it."""
    offs = torch.arange(max_rank, device=arena.device)
    live = offs[None, :] < rank.long()[:, None]                       # [T, R]
    index = (first.long()[:, None] + offs[None, :]).clamp(0, max(arena.shape[0] - 1, 0))
    rows = arena[index].float()                                       # [T, R, width]
    return torch.where(live[:, :, None], rows, 0.0)
