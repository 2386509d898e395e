"""Residual add (+ a LoRA delta) + RMSNorm: the fused Triton kernel (triton_kernel.py) where
Triton runs, the PyTorch reference (reference.py) elsewhere."""
from __future__ import annotations

import torch

from ..dispatch import triton_kernel
from ..gemm.fp8 import Fp8Rows, SplitSums, summed
from ..lora.delta import LoraDelta
from ..tuning import DEFAULT_TUNING, Tuning
from .reference import add_rms_norm


def add_rms_norm_lora(hidden: torch.Tensor, out: torch.Tensor | SplitSums, weight: torch.Tensor,
                      eps: float, delta: LoraDelta | None, tuning: Tuning = DEFAULT_TUNING, *,
                      unit_offset: bool = False, out_norm: torch.Tensor | None = None,
                      quantize: bool = False) -> tuple[torch.Tensor, torch.Tensor | Fp8Rows]:
    """(hidden + out + the expanded delta, that normalised), see reference.add_rms_norm for
    unit_offset and out_norm. quantize: where the Triton kernel runs, the normalised rows come
    with their e4m3 copy (Fp8Rows, for a W8A8 GEMM next); elsewhere that GEMM quantizes. out
    may be a K-split GEMM's partials (SplitSums): the kernel sums them, elsewhere their launch."""
    kernel = triton_kernel(hidden, "kernels.norm.triton_kernel", "add_rms_norm_triton")
    if kernel is not None:
        return kernel(hidden, out, weight, eps, delta, tuning=tuning, unit_offset=unit_offset,
                      out_norm=out_norm, quantize=quantize)
    return add_rms_norm(hidden, summed(out), weight, eps, delta.dense() if delta is not None else None,
                        unit_offset, out_norm)
