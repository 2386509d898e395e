"""Integer helpers for sizing launches on the host.

triton.cdiv and triton.next_power_of_2 are wrapped as JIT functions, and a call from Python
goes through that wrapper: about 2 us each. An eager prefill step sizes a few hundred launches
with a dozen such calls each, on the host's critical path (prefill steps are host-bound:
bench/prefill_profile.py), so the wrappers use these plain versions.
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


def interpreting() -> bool:
    """Whether Triton runs in its interpreter (TRITON_INTERPRET, CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def dot_f32(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a kernel's tl.dot takes float32 operands: exact fp32 products (no TF32) so fp32
    results match the reference; also on CPU/in the interpreter, whose tl.dot reads bf16 as
    raw uint16 (triton 3.9)."""
    return dtype == torch.float32 or device.type != "cuda" or interpreting()


def pdl_enabled(t: torch.Tensor) -> bool:
    """Whether the decode step's Triton kernels on t's device are launched with programmatic
    dependent launch: each lets the next one launch at its start (gdc_launch_dependents) and
    waits for the one before (gdc_wait) before reading its output, so a launch's latency, and
    the decode GEMM's first weight loads, overlap the kernel ahead. CUDA on Hopper or newer,
    not Triton's interpreter, LORA_PDL not 0."""
    return _hopper_feature(t, "LORA_PDL")


def pdl_launch(enabled: bool) -> dict[str, bool]:
    """The launch keyword for a kernel launched with programmatic dependent launch (none
    otherwise: the interpreter takes no such keyword)."""
    return {"launch_pdl": True} if enabled else {}


def early_kv_enabled(t: torch.Tensor) -> bool:
    """Whether paged attention, PDL-launched, reads its first tile's older keys (written by
    earlier steps) before waiting for the kernel ahead: where PDL is on, LORA_ATTN_EARLY_KV
    not 0."""
    return pdl_enabled(t) and _hopper_feature(t, "LORA_ATTN_EARLY_KV")


def early_b_enabled(t: torch.Tensor) -> bool:
    """Whether the ops that expand a LoRA delta after a projection (RoPE + KV write, SiLU),
    PDL-launched, read their rows' B before waiting for the kernel ahead: B and the rows'
    slots are not written by it. Where PDL is on, LORA_EXPAND_EARLY_B not 0."""
    return pdl_enabled(t) and _hopper_feature(t, "LORA_EXPAND_EARLY_B")


def tma_enabled(t: torch.Tensor) -> bool:
    """Whether the decode GEMM fetches its tiles with the tensor memory accelerator: CUDA on
    Hopper or newer, not Triton's interpreter, LORA_DECODE_TMA not 0."""
    return _hopper_feature(t, "LORA_DECODE_TMA")


def _hopper_feature(t: torch.Tensor, switch: str) -> bool:
    """A Hopper-only launch feature for kernels on t's device: compiled CUDA (not Triton's
    interpreter) on compute capability 9 or newer, unless the env var `switch` is 0."""
    if not t.is_cuda or os.environ.get(switch, "1") == "0" or interpreting():
        return False
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    return _capability(index)[0] >= 9
