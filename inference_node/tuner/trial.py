"""What a sweep measures and how: a case, a trial (its check against the reference and its
timing), the timers and the copy bandwidth the floors divide by. Below sweep.py and the expert
trials (expert_trials.py), which both build trials."""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from kernels.tuning import EXPERT_GROUPS

MAX_REL_ERR = 2e-2               # bf16 products, fp32 accumulation
L2_OVERFLOW = 256 << 20          # bytes of distinct copies a timed graph walks through

# A timer: GPU (or wall) microseconds per call of the launches `calls_for(copy)` builds, one
# per copy of the operands.
Timer = Callable[[Callable[[Any], Callable[[], object]], Sequence[Any]], float]


@dataclass(frozen=True)
class Case:
    """One thing the sweep measures: a group's decode GEMM at `batch` rows, plain
    (adapters 0) or with the LoRA of `adapters` distinct adapters folded in, whole (expand)
    or only its shrink (the op after it expands), that shrink spread over `splits` K ranges
    of the tile programs (0: programs of its own)."""

    group: str
    batch: int
    adapters: int = 0
    expand: bool = True
    splits: int = 0

    @property
    def key(self) -> tuple[str, int, int]:
        return self.group, self.batch, self.adapters

    def describe(self) -> str:
        if not self.adapters:
            return f"{self.group} batch {self.batch}"
        if self.group in EXPERT_GROUPS:
            return f"{self.group} LoRA launches batch {self.batch}, {self.adapters} adapters"
        how = ("expand" if self.expand else f"shrink spread over {self.splits} K ranges"
               if self.splits else "shrink only")
        return f"{self.group} fold batch {self.batch}, {self.adapters} adapters ({how})"


@dataclass(frozen=True)
class Trial:
    check: Callable[[], list[str]]       # what disagrees with the reference ([]: nothing)
    time: Callable[[Timer], float]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


# -- timing --------------------------------------------------------------------------------------

def graph_us(calls: list[Callable[[], object]], rounds: int = 10) -> float:
    """GPU microseconds per call: the calls captured back to back in one CUDA graph, replayed
    (median of `rounds`)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:  # warm-up: compiles outside the capture
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(times)


def cuda_timer(calls_for: Callable[[Any], Callable[[], object]], copies: Sequence[Any]) -> float:
    """GPU microseconds per launch: one launch per operand copy back to back in a CUDA graph."""
    return graph_us([calls_for(c) for c in copies])


def cpu_timer(calls_for: Callable[[Any], Callable[[], object]], copies: Sequence[Any]) -> float:
    """CPU SMOKE: wall microseconds per call (median of 3); meaningless as a tuning."""
    call = calls_for(copies[0])
    call()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        call()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes/s of a device-to-device copy (read and write counted): the practical ceiling of
    the memory-bound launches, against which each floor is computed. Timed eagerly, not from
    a CUDA graph: a copy captured in a graph becomes a memcpy node that the copy engine runs
    (2.76 TB/s on an H200, against 4.25 for the copy kernel an eager copy_ launches)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return 2 * nbytes / statistics.median(times)


def tile_backed(x: torch.Tensor) -> torch.Tensor:
    """x copied into storage of its whole row tile, as the node's ops allocate a decode GEMM's
    input (kernels.gemm.shapes.empty_rows): its launches are timed reading the tile as the
    node's do, not zero-filling rows past the batch."""
    from kernels.gemm.shapes import empty_rows

    out = empty_rows(*x.shape, dtype=x.dtype, device=x.device)
    out.copy_(x)
    return out


def copies_for(nbytes: int) -> int:
    """Operand copies a timed graph walks through so that no launch finds its bytes in L2."""
    return max(2, math.ceil(L2_OVERFLOW / max(nbytes, 1)))
