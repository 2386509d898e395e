"""Which kernel computes a projection x @ W: the decode GEMM (kernels/decode_gemm_triton.py)
for decode-shaped inputs on CUDA, cuBLAS for everything else (prefill, CPU, shapes its
tiles do not divide).

LORA_DECODE_GEMM picks: "triton-pdl" (the default: the Triton decode GEMM launched with
programmatic dependent launch on Hopper or newer, asking L2 for LORA_DECODE_PREFETCH columns
of its weights before it waits), "triton" (launched plainly) or "cublas" (torch.mm for every
shape). LORA_DECODE_GEMM_GROUPS names the fused projections it serves.

Why the default: on an H100 at batch 64 (Llama-3.2-1B shapes), serving_bench.py rows a, c-32
and d, cuBLAS and triton-pdl alternated twice: step p50 a 1.56/1.55 -> 1.53/1.55 ms, c-32
2.02/2.03 -> 2.01/2.01, d 1.64/1.64 -> 1.62/1.62. Launched plainly the same GEMM is slower
than cuBLASLt (decode graph 1.507 -> 1.564 ms); the early start is what pays
(docs/PERFORMANCE.md).

On Hopper the GEMM fetches its tiles with TMA (decode_gemm_tma; LORA_DECODE_TMA=0: pointer
loads): the pointer loads left its SMs issue-bound, and TMA took 0.6-2.4 us off each
(add + norm, projection) pair (bench/decode_kernels_sweep.py --parts tma).
"""
from __future__ import annotations

import os

import torch

from ._host import pdl_enabled, tma_enabled
from .decode_gemm_triton import MAX_ROWS, decode_gemm_tma, decode_gemm_triton, tma_fits
from .lora_gemm import GemmLora, decode_gemm_lora

MODES = ("cublas", "triton", "triton-pdl")
# (block_n, block_k, stages) per fused projection: the best of bench/decode_kernels_sweep.py
# --parts pdl on an H100 at batch 64 (Llama-3.2-1B shapes); other shapes take the default.
TILINGS: dict[str, tuple[int, int, int]] = {
    "qkv": (32, 256, 4), "o": (16, 256, 4), "down": (16, 256, 4), "gate_up": (32, 128, 4)}
DEFAULT_TILING = (16, 128, 4)
# The same with TMA tile loads (bench/decode_kernels_sweep.py --parts tma, H100, batch 64).
TMA_TILINGS: dict[str, tuple[int, int, int]] = {
    "qkv": (32, 256, 4), "o": (16, 256, 4), "down": (16, 128, 8), "gate_up": (32, 128, 4)}
# With LoRA folded in (kernels/lora_gemm.py), pointer or TMA loads alike: at most 96 KB of
# pipeline a program, so two share an SM and the shrink programs the fold adds (one per
# adapter and slice) do not push the tiles into another wave. Gate/up's 16384 columns: 256
# tiles of 64 with 2 stages of 128 (64 KB, three programs an SM), which with 64 shrink programs
# (32 adapters) run in one wave of 396, where 512 tiles of 32 at 4 stages (two an SM) made
# 576 programs over 264. H100, batch 64, decode graph replay over base (bench/decode_profile.py
# --modes overlap,overlap-x/tile=gate_up:64.128.2, one process, rounds 10): gu32 +0.188 ->
# +0.151 ms, c16 +0.286 -> +0.274, c32 +0.385 -> +0.369, c64 +0.636 -> +0.609; (64, 64, 4)
# alike; (64, 64, 3) (four an SM) +0.396, (64, 128, 3) (two) +0.396, (64, 64, 2) +0.510,
# (128, 64, 2) +0.531, (32, 64, 4) +0.433 at c32. Two stages lost for q/k/v and o (c32 +0.470).
FOLD_TILINGS: dict[str, tuple[int, int, int]] = {
    "qkv": (32, 128, 4), "o": (16, 128, 4), "down": (16, 128, 4), "gate_up": (64, 128, 2)}
# Columns of A the shrink programs of a whole fold (whose tiles wait for them: o in steps of
# few adapters) ask of L2 before their PDL wait (0: none). H100, batch 64, graph replay over
# base (bench/decode_profile.py, one process): c1 +0.232 -> +0.212 ms, c8 +0.299 -> +0.286
# with all of A (2048 columns); 512 columns changed nothing. Shrink-only folds do not take it:
# there it cost c32 +0.383 -> +0.393 and c64 +0.634 -> +0.660.
SHRINK_PREFETCH = 2048
SHARED_MEMORY = 200 << 10  # bytes of an SM's shared memory a launch's pipeline may fill


def env_group_set(var: str, default: tuple[str, ...]) -> frozenset[str]:
    """Comma-separated fused groups from environment variable `var` ("none": none);
    unset: `default`."""
    raw = os.environ.get(var, ",".join(default))
    return frozenset(g for g in raw.split(",") if g and g != "none")


def fold_tiling_overrides() -> dict[str, tuple[int, int, int]]:
    """LORA_FOLD_TILINGS="group:block_n,block_k,stages;...": FOLD_TILINGS entries replaced
    (for bench/decode_profile.py sweeps)."""
    out = {}
    for item in filter(None, os.environ.get("LORA_FOLD_TILINGS", "").split(";")):
        group, _, values = item.partition(":")
        block_n, block_k, stages = (int(v) for v in values.split(","))
        out[group] = (block_n, block_k, stages)
    return out


class DecodeGemm:
    """x @ W for the model's projections, W given as [in, out] (possibly a transposed view)."""

    def __init__(self, device: torch.device, mode: str | None = None) -> None:
        mode = mode or os.environ.get("LORA_DECODE_GEMM", "triton-pdl")
        if mode not in MODES:
            raise ValueError(f"LORA_DECODE_GEMM={mode!r}: expected one of {', '.join(MODES)}")
        self.mode = mode if device.type == "cuda" else "cublas"
        self.prefetch_k = int(os.environ.get("LORA_DECODE_PREFETCH", "512"))
        # With LoRA folded in whole and PDL: columns of each adapter's A the shrink programs
        # ask of L2 before their wait, as the tiles ask for their W (LORA_SHRINK_PREFETCH).
        self.shrink_prefetch = int(os.environ.get("LORA_SHRINK_PREFETCH", str(SHRINK_PREFETCH)))
        self.groups = env_group_set("LORA_DECODE_GEMM_GROUPS", ("qkv", "o", "gate_up", "down"))
        self.fold_tilings = {**FOLD_TILINGS, **fold_tiling_overrides()}
        self.tma_tilings = dict(TMA_TILINGS)  # the plain TMA GEMM's (decode_profile sweeps them)
        # With PDL: let the next kernel launch once every program has its input rows, rather
        # than after the main loops, so its launch and its own work before its wait (attention
        # reading older keys, a GEMM asking L2 for its weights) overlap this GEMM (H100 decode
        # graph, base: 1.430 -> 1.416 ms). LORA_GEMM_EARLY_TRIGGER=0 turns it off.
        self.early_trigger = os.environ.get("LORA_GEMM_EARLY_TRIGGER", "1") != "0"

    def serves(self, group: str) -> bool:
        """Whether this GEMM (rather than cuBLAS) computes the fused projection `group`."""
        return self.mode != "cublas" and group in self.groups

    @staticmethod
    def cublas(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
               group: str | None = None) -> torch.Tensor:
        return torch.mm(x, w) if bias is None else torch.addmm(bias, x, w)

    @property
    def weights_out_in(self) -> bool:
        """Whether weights are best kept [out, in] (each program's slab contiguous) rather
        than [in, out] (cuBLAS's faster layout at decode batch sizes)."""
        return self.mode != "cublas"

    @staticmethod
    def tiling(w: torch.Tensor, group: str | None,
               table: dict[str, tuple[int, int, int]] = TILINGS) -> tuple[int, int, int] | None:
        """(block_n, block_k, stages) for w [K, N], None where no tiling divides it (the
        group's own, else 64-column K steps: SmolLM2's hidden size is 576), with no more
        stages than shared memory holds (float32 tiles are twice as large). table: the
        group's tilings (TILINGS for pointer loads; DecodeGemm.tma_tilings with TMA,
        DecodeGemm.fold_tilings with LoRA folded in)."""
        block_n, block_k, stages = table.get(group, DEFAULT_TILING)
        if w.shape[0] % block_k:
            block_k = 64
        if w.shape[1] % block_n or w.shape[0] % block_k:
            return None
        per_stage = (64 + block_n) * block_k * w.element_size()
        return block_n, block_k, max(2, min(stages, SHARED_MEMORY // per_stage))

    def applies(self, x: torch.Tensor, w: torch.Tensor, group: str | None = None) -> bool:
        return (self.mode != "cublas" and x.is_cuda and 0 < x.shape[0] <= MAX_ROWS
                and x.stride(1) == 1 and self.tiling(w, group) is not None)

    def __call__(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                 group: str | None = None, lora: GemmLora | None = None) -> torch.Tensor:
        """x @ w (+ bias), plus `lora`'s delta folded into the same launch where given."""
        if lora is not None:
            return self.with_lora(x, w, bias, group, lora)
        if bias is None and self.applies(x, w, group):
            pdl = self.mode == "triton-pdl" and pdl_enabled(x)
            tma_tiling = (self.tiling(w, group, self.tma_tilings)
                          if tma_enabled(x) and tma_fits(x, w) else None)
            gemm = decode_gemm_tma if tma_tiling else decode_gemm_triton
            block_n, block_k, stages = tma_tiling or self.tiling(w, group)
            return gemm(x, w, pdl=pdl, prefetch_k=self.prefetch_k, block_n=block_n,
                        block_k=block_k, num_stages=stages,
                        early_trigger=self.early_trigger)
        return self.cublas(x, w, bias)

    def with_lora(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                  group: str | None, lora: GemmLora) -> torch.Tensor:
        """The matmul with its LoRA folded in (kernels/lora_gemm.py): this GEMM's tiling and
        launch where it serves the shape, the same kernel plainly launched where Triton runs
        otherwise (the interpreter), the reference elsewhere."""
        tiling = self.tiling(w, group, self.fold_tilings)
        if tiling is None or bias is not None:
            y = torch.mm(x, w) if bias is None else torch.addmm(bias, x, w)
            if not lora.expand:
                lora.store_shrink(x)
                return y
            return (y.float() + lora.delta(x)).to(x.dtype)
        tma = pdl = False
        if self.serves(group) and self.applies(x, w, group):
            pdl = self.mode == "triton-pdl" and pdl_enabled(x)
            tma = tma_enabled(x) and tma_fits(x, w)
        block_n, block_k, stages = tiling
        return decode_gemm_lora(x, w, lora, tma=tma, pdl=pdl, prefetch_k=self.prefetch_k,
                                block_n=block_n, block_k=block_k, num_stages=stages,
                                prefetch_a=self.shrink_prefetch if lora.expand else 0)
