"""A projection's FP8 weight as the model holds it (Fp8Weight), how the loader builds one
(quantized at load, or a checkpoint's slice with its scales), fuses several into one group's
matrix and shards it, and the one call the model's projections make with it (fp8_linear).

Fusing and sharding never requantize: they move fp8 bytes and scales. Per-channel scales
concatenate and slice with their rows exactly. A block scale covers block_n rows x block_k
columns; where a fused part's rows, or a shard's first row or column, do not fall on a block
edge, that part's scales are spread to one per row (block (1, block_k)) or one per column
(block (block_n, 1)) first: the same values over the same elements, so the product is the
same, bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from ..tuning import Fp8Choice
from .fold import GemmLora
from .fp8 import Fp8Rows, SplitSums, fp8_gated_silu, fp8_matmul, plain_rows

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0       # the largest finite float8_e4m3fn
MIN_AMAX = 1e-12      # an all-zero row's amax: its scale stays finite and nonzero


@dataclass(frozen=True)
class Fp8Weight:
    """weight [N, K] float8_e4m3fn (out x in, as checkpoints store it and fp8_matmul takes
    it); scale float32 [N] (block None) or [ceil(N / block[0]), ceil(K / block[1])]."""

    weight: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int] | None = None

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def to(self, device: torch.device) -> "Fp8Weight":
        return Fp8Weight(self.weight.to(device), self.scale.to(device), self.block)

    def per_row(self) -> "Fp8Weight":
        """The same weight with block scales spread to one per (row, K block)."""
        if self.block is None or self.block[0] == 1:
            return self
        return Fp8Weight(self.weight, _spread_rows(self.scale, self.block, self.out_features),
                         (1, self.block[1]))


def fp8_linear(x: torch.Tensor | Fp8Rows, w: Fp8Weight, bias: torch.Tensor | None = None,
               group: str | None = None, w8a8: bool = False, leave_sums: bool = False,
               tilings: Mapping[str, Fp8Choice] | None = None, pdl: bool = False,
               trigger: bool = False, lora: GemmLora | None = None) -> "torch.Tensor | SplitSums":
    """x [M, K] @ w's dequantized [K, N] (+ bias) in x's dtype: the FP8 counterpart of
    dispatch.cublas, with its signature; w8a8: x quantized per row first, or x's e4m3 copy
    where it comes with one; leave_sums (without a bias): maybe SplitSums (fp8_matmul);
    tilings: the decode launch per group (Tuning.fp8_choices), `group`'s taken; pdl: launched
    with programmatic dependent launch, trigger: the kernel after it launched early; lora: a
    shrink-only fold whose shrink the GEMM's launch computes (fp8_matmul)."""
    rows = x if isinstance(x, Fp8Rows) else None
    y = fp8_matmul(plain_rows(x), w.weight, w.scale, w.block, w8a8=w8a8, rows=rows,
                   leave_sums=leave_sums and bias is None, choice=(tilings or {}).get(group), pdl=pdl,
                   trigger=trigger, lora=lora)
    return y if bias is None else y + bias


def fp8_gated_silu_linear(x: torch.Tensor | Fp8Rows, w: Fp8Weight, w8a8: bool = False,
                          tilings: Mapping[str, Fp8Choice] | None = None, pdl: bool = False,
                          trigger: bool = False) -> torch.Tensor | None:
    """SiLU(x @ gate) * (x @ up) for gate/up's FP8 weight in one GEMM launch where the Triton
    FP8 GEMM runs x, else None (fp8_gated_silu); tilings, pdl, trigger: as fp8_linear's, gate_up's
    taken."""
    rows = x if isinstance(x, Fp8Rows) else None
    return fp8_gated_silu(plain_rows(x), w.weight, w.scale, w.block, w8a8=w8a8, rows=rows,
                          choice=(tilings or {}).get("gate_up"), pdl=pdl, trigger=trigger)


def quantize_fp8(w: torch.Tensor, block: tuple[int, int] | None = None) -> Fp8Weight:
    """w [N, K] as float8_e4m3fn with float32 scales (amax / 448, amax kept away from 0): one
    per output channel where block is None, else one per [block_n, block_k] tile."""
    w = w.float()
    n, k = w.shape
    if block is None:
        scale = w.abs().amax(dim=1).clamp(min=MIN_AMAX) / FP8_MAX
        spread = scale.unsqueeze(1)
    else:
        bn, bk = block
        rows, cols = -(-n // bn), -(-k // bk)
        padded = torch.nn.functional.pad(w.abs(), (0, cols * bk - k, 0, rows * bn - n))
        scale = padded.reshape(rows, bn, cols, bk).amax(dim=(1, 3)).clamp(min=MIN_AMAX) / FP8_MAX
        spread = scale.repeat_interleave(bn, dim=0).repeat_interleave(bk, dim=1)[:n, :k]
    quantized = (w / spread).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return Fp8Weight(quantized, scale.contiguous(), block)


def stored_scale(scale: torch.Tensor, out_features: int, block: tuple[int, int] | None) -> torch.Tensor:
    """A checkpoint's scale tensor as Fp8Weight holds it: per-channel [N, 1] and per-tensor
    ([], [1]) scales as [N] float32; block scales as they are (float32)."""
    scale = scale.float()
    if block is not None:
        return scale
    if scale.numel() == 1:
        return scale.reshape(1).expand(out_features).contiguous()
    return scale.reshape(out_features)


def slice_rows(weight_rows: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
               rows: int, lo: int, hi: int) -> Fp8Weight:
    """Rows [lo, hi) of a [rows, K] FP8 matrix whose scales are `scale` (as Fp8Weight holds
    them), given those rows' fp8 bytes (read alone off the checkpoint)."""
    if block is None:
        return Fp8Weight(weight_rows, scale[lo:hi].contiguous(), None)
    if lo % block[0]:
        scale, block = _spread_rows(scale, block, rows), (1, block[1])
    bn = block[0]
    return Fp8Weight(weight_rows, scale[lo // bn:-(-hi // bn)].contiguous(), block)


def slice_columns(weight_cols: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
                  cols: int, lo: int, hi: int) -> Fp8Weight:
    """Columns [lo, hi) of an [N, cols] FP8 matrix (as slice_rows): a per-channel scale
    whole, block scales those of the columns' blocks."""
    if block is None:
        return Fp8Weight(weight_cols, scale, None)
    if lo % block[1]:
        scale, block = _spread_columns(scale, block, cols), (block[0], 1)
    bk = block[1]
    return Fp8Weight(weight_cols, scale[:, lo // bk:-(-hi // bk)].contiguous(), block)


def _spread_rows(scale: torch.Tensor, block: tuple[int, int], rows: int) -> torch.Tensor:
    return scale.repeat_interleave(block[0], dim=0)[:rows].contiguous()


def _spread_columns(scale: torch.Tensor, block: tuple[int, int], cols: int) -> torch.Tensor:
    return scale.repeat_interleave(block[1], dim=1)[:, :cols].contiguous()


def fuse(parts: list[Fp8Weight]) -> Fp8Weight:
    """The parts' rows stacked (a fused group's matrix), their scales stacked with them: block
    scales as they are where every part but the last ends on a block edge, else spread to
    one per row first."""
    if len(parts) == 1:
        return parts[0]
    blocks = {p.block for p in parts}
    block = parts[0].block
    if len(blocks) > 1 or (block is not None and any(p.out_features % block[0] for p in parts[:-1])):
        parts = [p.per_row() for p in parts]  # (a shard's slice_rows may have spread some already)
        block = parts[0].block
    return Fp8Weight(torch.cat([p.weight for p in parts]), torch.cat([p.scale for p in parts]), block)
