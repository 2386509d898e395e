"""Host-side helpers for sizing and shaping launches.

triton.cdiv and triton.next_power_of_2 are wrapped as JIT functions, and a call from Python
goes through that wrapper: about 2 us each. An eager prefill step sizes a few hundred launches
with a dozen such calls each, on the host's critical path (prefill steps are host-bound:
docs/PERFORMANCE.md), so the wrappers use these plain versions.
"""
from __future__ import annotations

import os
from functools import lru_cache

import torch


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for integers (as triton.cdiv)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= n, 0 for n <= 0 (as triton.next_power_of_2)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


@lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device, cpu_default: int = 4) -> int:
    """Streaming multiprocessors of a CUDA device (read once per device: the property query
    costs about 8 us); cpu_default elsewhere."""
    if device.type != "cuda":
        return cpu_default
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@lru_cache(maxsize=1)
def interpreting() -> bool:
    """Whether Triton runs in its interpreter (TRITON_INTERPRET, CPU tensors): read once, as
    Triton reads it when its kernels are decorated; launches ask on every call."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def dot_f32(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a kernel's tl.dot takes float32 operands: exact fp32 products (no TF32) so fp32
    results match the reference; also on CPU/in the interpreter, whose tl.dot reads bf16 as
    raw uint16 (triton 3.9)."""
    return dtype == torch.float32 or device.type != "cuda" or interpreting()


def pdl_launch(enabled: bool) -> dict[str, bool]:
    """The launch keyword for a kernel launched with programmatic dependent launch (none
    otherwise: the interpreter takes no such keyword)."""
    return {"launch_pdl": True} if enabled else {}


def hopper(t: torch.Tensor) -> bool:
    """Whether kernels on t's device can use Hopper's launch features (programmatic dependent
    launch, TMA): compiled CUDA (not Triton's interpreter) on compute capability 9 or newer."""
    if not t.is_cuda or interpreting():
        return False
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    return _capability(index)[0] >= 9


_ARRIVAL_COUNTS: dict[tuple[torch.device, str], torch.Tensor] = {}


def arrival_counts(device: torch.device, owner: str, size: int) -> torch.Tensor | None:
    """A zeroed int32 buffer of `size` counts for one kernel's "the last program to arrive
    finishes the row (or tile)" (owner: the kernel's name), made once per device and never
    freed or regrown: captured CUDA graphs hold its address, and every launch leaves it zero
    again. Launches sharing it run one after another on one stream. None during a graph
    capture before it exists (it would be the graph's memory): the caller takes its other path."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    counts = _ARRIVAL_COUNTS.get((device, owner))
    if counts is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        counts = _ARRIVAL_COUNTS[(device, owner)] = torch.zeros(size, dtype=torch.int32, device=device)
    return counts
