"""Which kernel computes a projection x @ W: the Triton decode GEMM (triton_kernel.py) for
decode-shaped inputs on CUDA in the groups the tuning names (Tuning.gemm_groups), cuBLAS for
everything else (prefill, CPU, shapes its tiles do not divide); with a fused group's LoRA
folded in, the fold kernel (fold_triton_kernel.py) or its reference. An FP8 projection
(fp8_weight.Fp8Weight) is the model's to send to fp8_matmul whatever the step's choices (with
W8A8 or not): the decode GEMM and the fold kernel read 16-bit weights only, so its LoRA
runs beside it (beside_lora) as beside cuBLAS, or only its shrink in fp8_matmul's launch
(a shrink-only fold: fp8_triton_kernel.py).

Why the Triton GEMM: launched with programmatic dependent launch (Hopper) it starts while the
kernel ahead of it ends and asks L2 for its first weights (Tuning.gemm_prefetch_k) before it
waits for its input, which cuBLAS cannot. Launched plainly the same GEMM is slower than
cuBLASLt: the early start is what pays. On Hopper it fetches its tiles with TMA
(Tuning.gemm_tma): with pointer loads its SMs were issue-bound. Measurements:
docs/PERFORMANCE.md.
"""
from __future__ import annotations

import torch

from ..dispatch import triton_kernel
from ..tuning import DEFAULT_TUNING, Tuning
from .fold import GemmLora, gemm_lora_fits, reference_gemm_lora
from .fp8 import SplitSums
from .fp8_weight import Fp8Weight
from .rope_out import RopeOut
from .shapes import MAX_ROWS, gated_block_n, rope_block_n, tiling, tma_fits

TRITON = "kernels.gemm.triton_kernel"
FOLD_TRITON = "kernels.gemm.fold_triton_kernel"


def cublas(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
           group: str | None = None, leave_sums: bool = False) -> torch.Tensor:
    """x @ w (+ bias) by torch (cuBLAS on CUDA), summed whatever leave_sums says."""
    return torch.mm(x, w) if bias is None else torch.addmm(bias, x, w)


def decode_gemm_lora(x: torch.Tensor, w: torch.Tensor, lora: GemmLora, *, tma: bool = False,
                     pdl: bool = False, prefetch_k: int = 0, block_n: int = 16,
                     block_k: int = 128, num_warps: int = 4, num_stages: int = 4,
                     prefetch_a: int = 0) -> torch.Tensor:
    """x [M, K] @ w [K, N] (w a transposed view of [N, K] for tma) plus the LoRA delta, in
    x's dtype. Triton where it runs and the fold fits, else the reference. prefetch_a (with
    pdl): columns of A the shrink programs ask of L2 before their wait."""
    K, N = x.shape[1], w.shape[1]
    kernel = (triton_kernel(x, FOLD_TRITON, "decode_gemm_lora_triton")
              if gemm_lora_fits(lora, N, block_n) and K % block_k == 0 else None)
    if kernel is None:
        return reference_gemm_lora(x, w, lora)
    return kernel(x, w, lora, tma=tma, pdl=pdl, prefetch_k=prefetch_k, block_n=block_n,
                  block_k=block_k, num_warps=num_warps, num_stages=num_stages,
                  prefetch_a=prefetch_a)


def beside_lora(y: torch.Tensor, x: torch.Tensor, lora: GemmLora) -> torch.Tensor:
    """A matmul's output y = x @ W with the fold's LoRA done as the fold kernel's reference
    does it: the delta added (expand), or only the shrink's rows stored for the next op."""
    if not lora.expand:
        lora.store_shrink(x)
        return y
    return (y.float() + lora.delta(x)).to(x.dtype)


class DecodeGemm:
    """x @ W for the model's projections, W given as [in, out] (possibly a transposed view)."""

    def __init__(self, device: torch.device, tuning: Tuning = DEFAULT_TUNING) -> None:
        self.cuda = device.type == "cuda"
        self.tuning = tuning

    def serves(self, group: str) -> bool:
        """Whether this GEMM (rather than cuBLAS) computes the fused projection `group`'s
        decode-shaped matmuls; its weights are then best kept [out, in] (each program's slab
        contiguous) rather than [in, out] (cuBLAS's faster layout at decode batch sizes)."""
        return self.cuda and group in self.tuning.gemm_groups

    def applies(self, x: torch.Tensor, w: torch.Tensor | Fp8Weight, group: str | None = None) -> bool:
        return (self.cuda and not isinstance(w, Fp8Weight) and x.is_cuda and 0 < x.shape[0] <= MAX_ROWS
                and x.stride(1) == 1 and tiling(w, group, self.tuning.gemm_tilings) is not None)

    def __call__(self, x: torch.Tensor, w: torch.Tensor | Fp8Weight, bias: torch.Tensor | None = None,
                 group: str | None = None, lora: GemmLora | None = None, leave_sums: bool = False
                 ) -> torch.Tensor | SplitSums:
        """x @ w (+ bias), plus `lora`'s delta folded into the same launch where given.
        leave_sums: the caller's next kernel may take the K splits of the group's launch
        (Tuning.gemm_split_k) unsummed (SplitSums)."""
        if lora is not None:
            return self.with_lora(x, w, bias, group, lora)
        if bias is None and self.applies(x, w, group):
            split_k = self.tuning.gemm_split_k.get(group, 1) if leave_sums else 1
            y = self._launch(x, w, group, split_k=split_k)
            if y is None and split_k > 1:
                y = self._launch(x, w, group)
            if y is not None:
                return y
        return cublas(x, w, bias)

    def gated_silu(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
        """SiLU(x @ gate) * (x @ up) for gate/up's w [K, 2 I] in one decode GEMM launch (no
        SiLU launch, half the output written), bit for bit what the GEMM then the SiLU kernel
        give; None where the decode GEMM does not serve x (the caller runs the two). Each
        program takes half its tiling's columns from each half, so it reads as many weight
        bytes as in the plain launch, and the launch has as many programs."""
        if not (self.tuning.gate_up_silu and self.serves("gate_up") and self.applies(x, w, "gate_up")):
            return None
        return self._launch(x, w, "gate_up", gated=True)

    def qkv_rope(self, x: torch.Tensor, w: torch.Tensor, rope: RopeOut) -> torch.Tensor | None:
        """q/k/v's projection with kernels/rope's work in the same launch: the rotated queries
        in rope.q (returned), the rotated keys and the values in their cache slots, bit for
        bit what the GEMM then the RoPE kernel write; None where the decode GEMM does not serve
        x (the caller runs the two). Each program takes half its tiling's columns from each
        half of one head, so it reads as many weight bytes as in the plain launch."""
        if not (self.tuning.qkv_rope and self.serves("qkv") and self.applies(x, w, "qkv")):
            return None
        return self._launch(x, w, "qkv", rope=rope)

    def _launch(self, x: torch.Tensor, w: torch.Tensor, group: str | None, gated: bool = False,
                rope: RopeOut | None = None, split_k: int = 1) -> torch.Tensor | SplitSums | None:
        """The Triton decode GEMM with the group's tiling (TMA's on Hopper); None where Triton
        does not run x, or (gated) half the tiling's columns do not divide each half of w, or
        (rope) no tile of half a head's columns fits, or split_k splits of the tiling's K steps
        do not divide K."""
        tuning, rows = self.tuning, x.shape[0]
        tma_tiling = (tiling(w, group, tuning.gemm_tma_tilings, rows)
                      if tuning.gemm_tma_on(x) and tma_fits(x, w) else None)
        gemm = triton_kernel(x, TRITON, "decode_gemm_tma" if tma_tiling else "decode_gemm_triton")
        if gemm is None:
            return None
        block_n, block_k, stages = tma_tiling or tiling(w, group, tuning.gemm_tilings, rows)
        if gated:
            block_n = gated_block_n(block_n)
            if (w.shape[1] // 2) % block_n:
                return None
        if rope is not None:
            block_n = rope_block_n(block_n, rope.head_dim)
            if block_n < 16 or not rope.fits(x, w, block_n):
                return None
        if x.shape[1] % (block_k * split_k):
            return None
        return gemm(x, w, pdl=tuning.pdl_on(x), prefetch_k=tuning.gemm_prefetch_k, block_n=block_n,
                    block_k=block_k, num_stages=stages, early_trigger=tuning.gemm_early_trigger,
                    gated=gated, rope=rope, split_k=split_k)

    def with_lora(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                  group: str | None, lora: GemmLora) -> torch.Tensor:
        """The matmul with its LoRA folded in (fold.py): this GEMM's tiling and launch where it
        serves the shape, the same kernel plainly launched where Triton runs otherwise (the
        interpreter), the reference elsewhere."""
        tuning = self.tuning
        fold_tiling = tiling(w, group, tuning.fold_tilings, x.shape[0])
        if fold_tiling is None or bias is not None:
            return beside_lora(cublas(x, w, bias), x, lora)
        tma = pdl = False
        if self.serves(group) and self.applies(x, w, group):
            pdl = tuning.pdl_on(x)
            tma = tuning.gemm_tma_on(x) and tma_fits(x, w)
        block_n, block_k, stages = fold_tiling
        return decode_gemm_lora(x, w, lora, tma=tma, pdl=pdl, prefetch_k=tuning.gemm_prefetch_k,
                                block_n=block_n, block_k=block_k, num_stages=stages,
                                prefetch_a=tuning.fold_prefetch_a if lora.expand else 0)
