"""Each rank's peer-mapped buffer of the fused all-reduce, and the table that finds the peers'.

One buffer per rank, the same size on every rank, mapped into every peer (PyTorch's symmetric
memory, CUDA IPC): a flag region, then two slots of rows. Row t of a call is written by program t
into slot (epoch & 1) of its own rank's buffer; each peer's program t reads it there after
rank r's flag for row t (flags[t, r] in the reader's buffer) shows that epoch. Consecutive calls
alternate slots, so a rank that runs ahead into the next call writes the slot its peers are not
reading; it cannot run two calls ahead, as the next call's flags wait for every peer. The flags
live in the buffer itself (not PyTorch's signal pads) so their number does not depend on the
pad size a PyTorch version allots.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FLAG_BYTES = 4             # one int32 per (row, rank)
ALIGN = 256                # the row slots start on this boundary
EPOCH_MASK = (1 << 30) - 1  # epochs count modulo 2**30: differences of two stay in int32


@dataclass(frozen=True)
class PeerLayout:
    """Sizes of one rank's buffer: `max_rows` rows a call, `slot_bytes` bytes of rows a slot."""

    world: int
    max_rows: int
    slot_bytes: int

    @property
    def flags_bytes(self) -> int:
        return -(-self.max_rows * self.world * FLAG_BYTES // ALIGN) * ALIGN

    @property
    def nbytes(self) -> int:
        return self.flags_bytes + 2 * self.slot_bytes

    def fits(self, rows: int, hidden: int, itemsize: int) -> bool:
        return 0 < rows <= self.max_rows and rows * hidden * itemsize <= self.slot_bytes


@dataclass(frozen=True)
class PeerBuffers:
    """What a rank's launches read: its own buffer (uint8 [layout.nbytes]), where every rank's
    buffer lies from it (int64 byte offsets [world] on the device, 0 for its own: the kernel
    reaches a peer's rows as its own pointer plus the offset, so the compiler keeps their
    alignment and loads 16 bytes at a time) and this rank's epoch per row ([max_rows] int32,
    advanced by the kernel: a call's row t takes the next epoch of row t, so replays of CUDA
    graphs need no host)."""

    layout: PeerLayout
    rank: int
    buffer: torch.Tensor
    offsets: torch.Tensor
    epochs: torch.Tensor

    def __post_init__(self) -> None:
        assert self.buffer.dtype == torch.uint8 and self.buffer.numel() >= self.layout.nbytes
        assert self.buffer.data_ptr() % 64 == 0  # CUDA allocations: 512 bytes; a CPU tensor's: 64
        assert self.offsets.shape == (self.layout.world,) and self.offsets.dtype == torch.int64
        assert self.epochs.shape == (self.layout.max_rows,) and self.epochs.dtype == torch.int32
        assert 0 <= self.rank < self.layout.world

    @staticmethod
    def offsets_of(addresses: list[int], rank: int, device: torch.device) -> torch.Tensor:
        """The byte offsets from rank's buffer to every rank's (`addresses`: each buffer's
        start as this process addresses it). Multiples of 64 bytes: the kernel tells the compiler
        a peer's rows are 16-element aligned."""
        offsets = [a - addresses[rank] for a in addresses]
        assert all(o % 64 == 0 for o in offsets), offsets
        return torch.tensor(offsets, dtype=torch.int64, device=device)
