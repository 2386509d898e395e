"""The decode all-reduce fused with the add + norm after it (`--all-reduce fused`).

A decode step of an 8B model sums [64, 4096] bf16 rows 65 times; through NCCL each takes
17-25 us inside a CUDA graph, and the add + norm after it is a launch of its own. Here both are
one launch of kernels/allreduce over a peer-mapped buffer per rank (PyTorch's symmetric
memory, its CUDA backend: CUDA IPC, no NVLink multicast). Messages of up to `max_bytes` and
`max_rows` rows take it; larger ones (prompt steps) the group's all-reduce and the add + norm
kernel, as with --all-reduce nccl.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from kernels.allreduce import PeerBuffers, PeerLayout

from .symmetric import open_symmetric_buffer

MAX_BYTES = 1 << 20  # a slot: 128 rows of 4096 bf16; the one-shot read of every peer's rows fades past this
MAX_ROWS = 256       # programs a call (one a row, every one resident while it waits for its peers)


@dataclass
class FusedAllReduce:
    """This rank's buffer, its peers' addresses and its epochs; called as the kernel."""

    group_name: str
    dtype: torch.dtype
    device: torch.device
    max_bytes: int = MAX_BYTES
    max_rows: int = MAX_ROWS
    peers: PeerBuffers = field(init=False)
    handle: object = field(init=False)  # the rendezvous' handle (a benchmark checks it has no multicast address)
    kernel: Callable[..., tuple[torch.Tensor, torch.Tensor]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        from kernels.allreduce.triton_kernel import all_reduce_add_rms_norm_triton  # CUDA only: Triton

        self.kernel = all_reduce_add_rms_norm_triton
        rank, world = dist.get_rank(), dist.get_world_size()
        layout = PeerLayout(world, self.max_rows, self.max_bytes)
        buffer, self.handle, _ = open_symmetric_buffer(layout.nbytes, torch.uint8, self.device, self.group_name)
        # Where each rank's buffer starts in its allocation (PyTorch's pool may place it past the
        # allocation's start, which buffer_ptrs give): the same on every rank, checked.
        start = buffer.data_ptr() - self.handle.buffer_ptrs[rank]
        starts: list = [None] * world
        dist.all_gather_object(starts, start)
        if start < 0 or len(set(starts)) != 1:
            raise RuntimeError(f"--all-reduce fused: the ranks' buffers lie at offsets {starts} in their "
                               "symmetric allocations, not at one offset >= 0")
        addresses = [base + start for base in self.handle.buffer_ptrs]
        buffer[:layout.flags_bytes].zero_()  # epoch 0: no peer has arrived
        epochs = torch.zeros(layout.max_rows, dtype=torch.int32, device=self.device)
        self.peers = PeerBuffers(layout, rank, buffer, PeerBuffers.offsets_of(addresses, rank, self.device), epochs)
        torch.cuda.synchronize(self.device)
        dist.barrier()  # every rank's flags zeroed before any rank's first call sets a peer's

    def fits(self, x: torch.Tensor) -> bool:
        return (x.dtype == self.dtype and x.dim() == 2 and x.stride(1) == 1
                and self.peers.layout.fits(x.shape[0], x.shape[1], x.element_size()))

    def __call__(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 bias: torch.Tensor | None = None, unit_offset: bool = False,
                 out_norm: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + the sum of every rank's x (+ bias), that normalised): see
        kernels/allreduce/reference.py."""
        return self.kernel(x, residual, weight, eps, self.peers, bias=bias, unit_offset=unit_offset,
                           out_norm=out_norm)
