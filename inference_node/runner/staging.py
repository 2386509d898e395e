"""The graphs' step inputs staged on the host.

Decode graphs and piecewise graphs replay kernels that read fixed device buffers: a step's
int64 inputs, its int32 inputs and its block tables. The host writes them into pinned
buffers through numpy views (a few slice assignments; a torch.tensor per list cost most of a
fill), then three non-blocking copies move them to the device. Each graph class keeps two
such sets and alternates (`HostTurns`), so the host fills one while the device may still
read the other; `copied` tells when it is free again.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class HostInputs:
    """One step's packed inputs on the host, with numpy views."""

    t64: torch.Tensor
    t32: torch.Tensor
    table: torch.Tensor
    np64: np.ndarray
    np32: np.ndarray
    np_table: np.ndarray
    copied: torch.cuda.Event | None   # recorded after the copies that read these buffers

    @classmethod
    def allocate(cls, n64: int, n32: int, table: int, pinned: bool) -> "HostInputs":
        t64 = torch.zeros(n64, dtype=torch.int64, pin_memory=pinned)
        t32 = torch.zeros(n32, dtype=torch.int32, pin_memory=pinned)
        tab = torch.zeros(table, dtype=torch.int32, pin_memory=pinned)
        return cls(t64, t32, tab, t64.numpy(), t32.numpy(), tab.numpy(),
                   torch.cuda.Event() if pinned else None)

    def upload(self, tables: list[list[int]], dev64: torch.Tensor, dev32: torch.Tensor,
               block_tables: torch.Tensor) -> int:
        """Packs the rows' block tables [n, width] at the front of the table buffer (entries
        past a row's own blocks are never read) and copies everything to the device buffers,
        non-blocking from pinned memory; returns width."""
        n, width = len(tables), max(len(t) for t in tables)
        flat: list[int] = []
        for t in tables:
            flat += t
            flat += [0] * (width - len(t))
        self.np_table[:n * width] = flat
        self.copy_packed(n, width, dev64, dev32, block_tables)
        return width

    def copy_packed(self, n: int, width: int, dev64: torch.Tensor, dev32: torch.Tensor,
                    block_tables: torch.Tensor) -> None:
        """Copies the packed buffers (n rows of block tables, `width` each) to the device."""
        dev64.copy_(self.t64, non_blocking=True)
        dev32.copy_(self.t32, non_blocking=True)
        block_tables[:n, :width].copy_(self.table[:n * width].view(n, width), non_blocking=True)
        if self.copied is not None:
            self.copied.record()

    def load(self, int64: np.ndarray, int32: np.ndarray, table: np.ndarray) -> None:
        """Takes packed inputs another rank staged (a tensor-parallel rank replaying rank 0's step)."""
        self.np64[:] = int64
        self.np32[:] = int32
        self.np_table[:len(table)] = table


class HostTurns:
    """Two sets of pinned host buffers, used in turn: the host writes step n+1's inputs while
    step n (and possibly its input copy) is still queued on the GPU."""

    def __init__(self, n64: int, n32: int, table: int, pinned: bool) -> None:
        self._sets = [HostInputs.allocate(n64, n32, table, pinned) for _ in range(2)]
        self._turn = 0

    def next(self) -> HostInputs:
        host = self._sets[self._turn]
        self._turn ^= 1
        if host.copied is not None:
            host.copied.synchronize()  # the copy of two steps ago: long done
        return host
