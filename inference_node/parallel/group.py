"""The collectives of one tensor-parallel group, as the model calls them.

torch.distributed carries them: NCCL between GPUs (one per rank), gloo on CPU (CI runs
TP=2 on a tiny model that way). The ranks rendezvous through a file, so no port is chosen.
With `--all-reduce symm` the decode-sized sums go through symmetric memory instead
(symmetric.py); larger ones stay on NCCL. With `--all-reduce fused` the decode-sized sums that
an add + norm follows (after o and down) are one kernel with it (fused.py).
"""
from __future__ import annotations

import datetime
import logging
import threading
from dataclasses import dataclass
from typing import Callable, Literal

import torch
import torch.distributed as dist

from .fused import FusedAllReduce
from .shard import Shard
from .symmetric import SymmetricAllReduce

AllReduce = Literal["nccl", "symm", "fused"]
# The model's add + norm: (residual, out, weight, eps, delta, *, unit_offset, out_norm) ->
# (new residual, normed), as model/launch.py's ElementwiseOps.add_rms_norm.
AddNorm = Callable[..., tuple[torch.Tensor, torch.Tensor]]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TensorParallel:
    shard: Shard
    symmetric: SymmetricAllReduce | None = None  # --all-reduce symm: decode-sized sums
    fused: FusedAllReduce | None = None          # --all-reduce fused: decode-sized sums with their add + norm

    @property
    def rank(self) -> int:
        return self.shard.rank

    @property
    def size(self) -> int:
        return self.shard.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums x over the ranks (a row-parallel projection's partial outputs): in place
        through NCCL, or into a new tensor through symmetric memory. Callers use the result."""
        if self.symmetric is not None and self.symmetric.fits(x):
            return self.symmetric(x)
        dist.all_reduce(x)
        return x

    def all_reduce_add_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                            add_norm: AddNorm, bias: torch.Tensor | None = None, *, unit_offset: bool = False,
                            out_norm: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + x summed over the ranks (+ bias, whole on every rank), that normalised
        by weight): one fused kernel for decode-sized x under --all-reduce fused; otherwise
        all_reduce, the bias, then the model's own add + norm `add_norm`, op for op."""
        if self.fused is not None and self.fused.fits(x):
            return self.fused(x, residual, weight, eps, bias, unit_offset, out_norm)
        out = self.all_reduce(x)
        if bias is not None:
            out = out + bias
        return add_norm(residual, out, weight, eps, None, unit_offset=unit_offset, out_norm=out_norm)

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x side by side along the last dimension (the vocabulary's logits)."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        dist.broadcast(x, src)
        return x

    def min_int(self, value: int) -> int:
        """The smallest of every rank's value (each rank's KV block count: all use the least)."""
        t = torch.tensor([value], dtype=torch.long, device=_collective_device())
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())


def _collective_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_tensor_parallel(shard: Shard, device: torch.device, rendezvous_file: str,
                         timeout_s: float = 600.0, all_reduce: AllReduce = "nccl",
                         dtype: torch.dtype = torch.bfloat16) -> TensorParallel:
    """Joins the group (blocking until every rank has). The timeout bounds one collective:
    a rank that dies mid-step fails the others' next collective instead of hanging them.
    all_reduce "symm" or "fused" (CUDA only) also opens a symmetric buffer for `dtype` on every rank."""
    if all_reduce != "nccl" and device.type != "cuda":
        raise ValueError(f"--all-reduce {all_reduce} needs CUDA GPUs (symmetric memory); on CPU use nccl (gloo)")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{rendezvous_file}", rank=shard.rank,
                            world_size=shard.size, timeout=datetime.timedelta(seconds=timeout_s),
                            device_id=device if device.type == "cuda" else None)
    group = dist.group.WORLD.group_name
    return TensorParallel(shard, SymmetricAllReduce(group, dtype, device) if all_reduce == "symm" else None,
                          FusedAllReduce(group, dtype, device) if all_reduce == "fused" else None)


def leave_tensor_parallel(timeout_s: float = 60.0) -> bool:
    """Destroys this process's group, waiting at most timeout_s; False if it did not end.

    Every rank calls it as it stops, its steps finished and its CUDA graphs released (graphs
    that captured collectives may hold the communicators: with them alive, the teardown
    hung on every rank of a TP 2 and a TP 4 node on H200s). A rank that did not end its group
    logs it and goes on: the process is stopping, and a hang there would outlive the node."""
    if not dist.is_initialized():
        return True
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        torch.cuda.synchronize()
    done = threading.Thread(target=dist.destroy_process_group, name="leave-tensor-parallel", daemon=True)
    done.start()
    done.join(timeout_s)
    if done.is_alive():
        log.error("the tensor-parallel process group did not end within %.0fs; going on without", timeout_s)
        return False
    return True
