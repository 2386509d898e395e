"""The launch choices one forward pass runs with: a Tuning (kernels/tuning.py) and the decode
GEMM and elementwise ops built on it. The runner builds one per step bucket of the node's
tuning table and hands the step's to the forward, so the model holds weights only."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.activation import silu_mul, silu_mul_lora
from kernels.gemm import DecodeGemm
from kernels.gemm.fp8 import Fp8Rows, SplitSums, summed
from kernels.lora import LoraDelta
from kernels.norm import add_rms_norm, add_rms_norm_lora, rms_norm
from kernels.tuning import Tuning


class ElementwiseOps:
    """The small per-layer ops between the matmuls. Eager, they are a few dozen kernel
    launches per layer; on CUDA the residual add + norm and SiLU * up are the Triton kernels
    of kernels/norm and kernels/activation (which also expand a LoRA delta left for them,
    kernels/lora/delta.py) on the base path too, where they beat torch.compile's fusions,
    and the first norm is compiled (torch.compile, dynamic shapes); CUDA graphs then replay
    them. On a CPU the base path runs the PyTorch references. (RoPE and the KV-cache write
    are one kernel of their own, kernels/rope, or in steps without LoRA on q/k/v the epilogue
    of q/k/v's decode GEMM: Tuning.qkv_rope.)"""

    def __init__(self, device: torch.device, tuning: Tuning) -> None:
        self.tuning = tuning
        self.triton = device.type == "cuda"
        self._rms_norm = (torch.compile(rms_norm, dynamic=True, fullgraph=True) if self.triton
                          else rms_norm)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 unit_offset: bool = False) -> torch.Tensor:
        return self._rms_norm(x, weight, eps, unit_offset)

    def add_rms_norm(self, hidden: torch.Tensor, out: torch.Tensor | SplitSums, weight: torch.Tensor,
                     eps: float, delta: LoraDelta | None, *, unit_offset: bool = False,
                     out_norm: torch.Tensor | None = None, quantize: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor | Fp8Rows]:
        """(hidden + out (+ its LoRA delta, and normalised by out_norm where given), that
        normalised); unit_offset: Gemma's (1 + w) norms. quantize: on CUDA the normalised rows
        come with their e4m3 copy for the W8A8 GEMM next (Fp8Rows), made in the same launch.
        out: a projection's output, or an FP8 GEMM's K splits still to sum (SplitSums)."""
        if delta is not None or self.triton:
            return add_rms_norm_lora(hidden, out, weight, eps, delta, self.tuning,
                                     unit_offset=unit_offset, out_norm=out_norm,
                                     quantize=quantize and self.triton)
        return add_rms_norm(hidden, summed(out), weight, eps, None, unit_offset, out_norm)

    def silu_mul(self, gate_up: torch.Tensor, delta: LoraDelta | None,
                 activation: str = "silu") -> torch.Tensor:
        if delta is not None or self.triton:
            return silu_mul_lora(gate_up, delta, self.tuning, activation=activation)
        return silu_mul(gate_up, None, activation)


@dataclass(frozen=True)
class LaunchChoices:
    """Every launch choice of one step bucket. Built once per Tuning: its ops hold a compiled
    norm, which a step must not rebuild."""

    tuning: Tuning
    gemm: DecodeGemm
    ops: ElementwiseOps

    @classmethod
    def of(cls, device: torch.device, tuning: Tuning) -> "LaunchChoices":
        return cls(tuning, DecodeGemm(device, tuning), ElementwiseOps(device, tuning))
