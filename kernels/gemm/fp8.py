"""x @ W.T for a projection whose weight W [N, K] is stored as float8_e4m3fn with float32 scales:
one per output row (per-channel; a per-tensor scale is broadcast to [N] by the loader), or
one per [block_n, block_k] tile of W (Hugging Face's fine-grained FP8). The scales multiply
the fp8 values (dequant W = fp8 * scale), as the checkpoints' `weight_scale` /
`weight_scale_inv` tensors mean them.

`fp8_matmul` is the one entry point the model calls; the reference below is what CPU nodes
run and what the GPU kernel is checked against. No host synchronisation on any path: the
decode graphs capture it.

Which computation runs (fp8_matmul):
- CUDA with e4m3 conversions (compute capability 8.9 or newer), and Triton's interpreter: the
  weight-only Triton GEMM (fp8_triton_kernel.py) at every batch size, with a decode tiling up
  to DECODE_ROWS rows (split-K over the SMs) and a prefill tiling above (split-K too where
  its tiles leave SMs idle). It reads the weight's one byte an element (the point at decode,
  where the step is its weight stream) and is the reference's math: exact fp8 -> 16-bit
  widening, float32 accumulation, scales on the accumulator.
- With w8a8 (the node's --quantization fp8-w8a8): x quantized to e4m3 per row (scale amax /
  448: by the kernel that wrote x where it hands on Fp8Rows, else by quantize_rows_triton) and
  both operands multiplied on the fp8 tensor cores by the same Triton GEMM, at every batch
  size. Not the reference's math: each activation keeps 3 mantissa
  bits, so outputs move by about 2^-4 relative per term; the caller opts into it. Its
  reference is reference_w8a8_matmul (the quantized x times the dequantized W in float32).
  On Hopper the fp8 MMAs chain their sums in less than float32 (Triton's default there, the
  "fast accumulation" vLLM's CUTLASS FP8 GEMMs also run): H200, 8B widths, 64 rows, bf16 out,
  mean error 1.8e-3 of the mean against 1.4e-3 with the sums moved into float32 once a K tile
  (max 4.7e-3 against 2.8e-3 of the largest; down unsplit, 14,336 columns a chain: 1.1e-2),
  where promoting once a K tile cost 1.5% of the decode step (3.96 -> 4.02 ms): the default stays.
  The tuner checks each launch it may pick against the reference (tuner/trial.py's bound).
  Under tensor parallelism a row-parallel projection (o, down) quantizes the rank's shard of
  each row with its own scale: finer than one node's, so its tokens may differ from TP 1's.
  On Hopper at decode the fp8 MMAs run at twice bf16's rate and nothing is widened, which
  the weight-only GEMM's time is made of (tuner/fp8_gemm.py times both).
- Elsewhere (CPU, older GPUs, block shapes whose columns no 16-wide K tile divides, a weight
  whose rows are not contiguous): the reference.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from functools import lru_cache

import torch

from ..dispatch import triton_kernel
from ..tuning import Fp8Choice
from .fold import GemmLora, shrink_fits
from .shapes import MAX_ROWS

TRITON = "kernels.gemm.fp8_triton_kernel"
DECODE_ROWS = MAX_ROWS  # rows up to which a matmul is a decode step's (its weight stream)
E4M3_MAX = 448.0  # float8_e4m3fn's largest finite value
MAX_BLOCK_M = 64  # rows a decode program's tile holds by default; more rows get more programs


@dataclass(frozen=True)
class Fp8Rows:
    """Activations x [M, K] with their e4m3 copy, one float32 scale a row (x ~ fp8 * scale,
    quantize_rows's math, bit for bit), written by the kernel that made x (the residual add +
    RMSNorm, kernels/norm). The W8A8 GEMM then takes the copy and launches no quantizer of its
    own; a LoRA shrink reads x."""

    x: torch.Tensor
    fp8: torch.Tensor
    scale: torch.Tensor  # [M]


def plain_rows(x: "torch.Tensor | Fp8Rows") -> torch.Tensor:
    """x's 16-bit rows, whether or not they come with their e4m3 copy."""
    return x.x if isinstance(x, Fp8Rows) else x


@dataclass(frozen=True)
class SplitSums:
    """A K-split GEMM's output left as its float32 partials [SPLIT_K, M, N], for the kernel
    that reads the output next to sum (the residual add + RMSNorm after o and down,
    kernels/norm): in split order, rounded once to `dtype`, bit for bit what the GEMM's sum
    launch writes, which then does not run. total() is that launch, for any other reader."""

    parts: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.parts.shape[1:]

    def total(self) -> torch.Tensor:
        launch = triton_kernel(self.parts, TRITON, "split_k_total")
        if launch is not None:
            return launch(self.parts, self.dtype)
        total = self.parts[0].clone()  # where Triton does not run: the same sums, split order
        for part in self.parts[1:]:
            total += part
        return total.to(self.dtype)


def summed(y: "torch.Tensor | SplitSums") -> torch.Tensor:
    """A projection's output as a tensor, whether or not its splits are still to sum."""
    return y.total() if isinstance(y, SplitSums) else y


@dataclass(frozen=True)
class Fp8Tiling:
    """The Triton FP8 GEMM's launch (fp8_gemm_triton's keywords). block_m None: every row of a
    decode batch in one tile; split_k None: enough K splits to give split_fill x every SM a
    program and leave at most split_columns of K a split (0: any);
    swap_ab: tiles computed as W @ x.T; tma: tiles fetched by TMA where it runs; widen_prmt:
    e4m3 -> bf16 by integer ops and one packed multiply (fp8_triton_kernel.py)."""

    block_m: int | None = None
    block_n: int = 64
    block_k: int = 128
    split_k: int | None = None
    num_warps: int = 4
    num_stages: int = 4
    swap_ab: bool = False
    tma: bool = False
    widen_prmt: bool = False
    split_fill: float = 1.0
    split_columns: int = 0


# Decode: 64-column tiles, K split to fill the SMs, each tile computed as W @ x.T from TMA
# loads: the widened weight goes straight to the MMA as its register operand rather than back
# through shared memory. On an H200 at 8B widths and 64 rows, 16-29% faster than the pointer
# loads of x @ W.T (tuner/fp8_gemm.py --sweep; wider tiles, 8 warps or more stages no faster).
# Prefill: the usual compute tile.
DECODE_TILING = Fp8Tiling(swap_ab=True, tma=True)
# W8A8 at decode (e4m3 x, nothing widened; H200, 8B widths, 64 rows, tuner/fp8_gemm.py --w8a8
# --sweep): gate/up's 28,672 columns fastest in 128-column tiles (35 us, 83% of copy
# bandwidth), the narrower q/k/v, o and down in 64 columns by 256-wide K steps (12.4, 10.4,
# 22.6 us). Their K splits: a split saves less than the partials' sum costs once the SMs are
# mostly busy (a graph of each GEMM and the kernel summing it, split 1/2/4: q/k/v 7.8/9.2/-,
# o 11.0/10.6/11.7, down -/27.0/25.2 us), and a program streaming more than 4096 columns of K
# runs slower than two. Launched plainly: under programmatic dependent launch the base step
# gained and a step of 32 adapters lost (docs/PERFORMANCE.md).
W8A8_WIDE_TILING = Fp8Tiling(block_n=128, swap_ab=True, tma=True)
W8A8_NARROW_TILING = Fp8Tiling(block_k=256, num_stages=3, swap_ab=True, tma=True, split_fill=0.7,
                               split_columns=4096)
W8A8_WIDE_N = 8192  # output columns from which W8A8_WIDE_TILING runs
# Past DECODE_ROWS (batches of 128 and 256, prefill chunks): 128 x 128 tiles, K split where the
# tiles leave the SMs short (at 256 rows o and down have 64 tiles for 132 SMs, and down's
# 14,336 columns of K are otherwise one program's stream). H200, 8B widths, us a launch at 128 /
# 256 rows (split sums included), 64-wide K steps never split -> these tilings:
# W8A8 (128-wide K steps) qkv 15.9 / 15.8 -> 13.1 / 13.3, o 15.1 / 16.2 -> 10.1 / 12.9,
# gate_up 50.0 / 72.0 -> 39.1 / 63.9, down 70.8 / 70.7 -> 28.4 / 40.3; weight-only (splits to
# fill every SM) qkv 62.6 / 61.1 -> 28.8 / 47.4, o 62.0 / 62.3 -> 20.6 / 29.6, down 213.9 /
# 209.3 -> 46.7 / 78.4 (bf16 cuBLAS: 15.8 / 22.0, 13.0 / 14.8, 38.6 / 54.0: weight-only widens
# every weight, compute-bound at these rows). At 512 rows weight-only's o and down still split
# in 2 (o 61.2 -> 49.0 us); from 2,048 rows neither mode splits (times unchanged).
PREFILL_TILING = Fp8Tiling(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4)
PDL_PREFETCH_K = 512  # weight columns each program asks L2 for before a PDL launch's wait
W8A8_PREFILL_TILING = Fp8Tiling(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3,
                                split_fill=0.7)


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor,
                   block: tuple[int, int] | None) -> torch.Tensor:
    """The float32 [N, K] matrix `weight` [N, K] (fp8) and `scale` stand for: scale [N] per
    row when block is None, else scale [ceil(N/bn), ceil(K/bk)] per tile (edge tiles
    partial)."""
    w = weight.float()
    if block is None:
        return w * scale.float().unsqueeze(1)
    n, k = w.shape
    bn, bk = block
    per_element = scale.float().repeat_interleave(bn, dim=0).repeat_interleave(bk, dim=1)
    return w * per_element[:n, :k]


def reference_fp8_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                         block: tuple[int, int] | None) -> torch.Tensor:
    """x [M, K] @ dequant(weight [N, K]).T in float32, returned in x's dtype."""
    return (x.float() @ dequantize_fp8(weight, scale, block).t()).to(x.dtype)


def fp8_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               block: tuple[int, int] | None, w8a8: bool = False,
               rows: Fp8Rows | None = None, leave_sums: bool = False,
               choice: Fp8Choice | None = None, pdl: bool = False,
               trigger: bool = False, lora: GemmLora | None = None) -> "torch.Tensor | SplitSums":
    """x [M, K] (bf16/fp16/fp32) @ dequant(weight [N, K] float8_e4m3fn).T -> [M, N] in x's
    dtype, float32 accumulation. scale: float32 [N] when block is None, else
    [ceil(N/block[0]), ceil(K/block[1])]. w8a8: x quantized to e4m3 per row first (the
    module docstring: an approximation of x), or taken from rows (x's, already quantized);
    off, every path computes the reference's math. leave_sums: where the Triton GEMM splits K
    and would sum in a launch of its own, SplitSums for the caller's next kernel to sum.
    choice: the decode launch (Tuning.fp8_tilings / w8a8_tilings' entry; None: by the shape).
    pdl: at decode rows, the GEMM (and the row quantizer before it) launched with programmatic
    dependent launch where the device has it, asking L2 for its first PDL_PREFETCH_K weight
    columns while the kernel ahead ends (decode_pdl; Tuning.fp8_pdl says in which steps).
    trigger: at decode rows, a PDL launch after the GEMM may start once its K loops are done
    (fp8_gemm_triton; Tuning.fp8_trigger). lora (a shrink-only fold, GemmLora.expand False):
    the adapters' shrink of x's 16-bit rows stored in lora.xa for the op after the GEMM to
    expand, by programs of the GEMM's own launch where it runs (fp8_gemm_triton), else
    beside it."""
    tiling = launch_tiling(x.shape[0], weight.shape[0], w8a8, choice)
    block_k = k_tile(block, tiling.block_k)
    kernel = _triton_gemm(x) if block_k and weight.stride(1) == 1 else None
    if lora is not None and lora.expand:
        raise ValueError("an FP8 GEMM adds no whole LoRA delta: fold only its shrink "
                         "(GemmLora.expand False; Tuning.for_fp8_projections)")
    if lora is not None and (kernel is None or not shrink_fits(lora, x)):
        lora.store_shrink(x)  # the fold's reference: what the kernel's shrink programs store
        lora = None
    if kernel is None:
        if w8a8:
            return reference_w8a8_matmul(x, weight, scale, block, rows)
        return reference_fp8_matmul(x, weight, scale, block)
    if x.stride(1) != 1:
        x = x.contiguous()
    keywords = {**asdict(tiling), "block_k": block_k, **decode_launch(pdl, trigger, x.shape[0])}
    pdl = keywords.get("pdl", False)
    if w8a8:
        if rows is not None:
            quantized, row_scale = rows.fp8, rows.scale
        else:
            quantized, row_scale = triton_kernel(x, TRITON, "quantize_rows_triton")(x, pdl=pdl)
        return kernel(quantized, weight, scale, block, x_scale=row_scale, out_dtype=x.dtype,
                      leave_sums=leave_sums, lora=lora, x16=x, **{**keywords, "widen_prmt": False})
    return kernel(x, weight, scale, block, leave_sums=leave_sums, lora=lora, **keywords)


def fp8_gated_silu(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                   block: tuple[int, int] | None, w8a8: bool = False,
                   rows: Fp8Rows | None = None, choice: Fp8Choice | None = None,
                   pdl: bool = False, trigger: bool = False) -> torch.Tensor | None:
    """SiLU(x @ gate.T) * (x @ up.T) for gate/up's stacked weight [2 I, K] in one launch of the
    Triton GEMM (no SiLU launch, half the output written), bit for bit what fp8_matmul then
    the SiLU kernel give; None where that GEMM does not run x (the caller runs the two). A
    program takes half its plain tiling's columns from each half where those are 128 or more
    (as many weight bytes as in the plain launch), else a whole tile from each. choice: as
    fp8_matmul's (its K splits unused: SiLU needs a column's whole sum); pdl, trigger: as
    fp8_matmul's."""
    tiling = launch_tiling(x.shape[0], weight.shape[0], w8a8, choice)
    block_k = k_tile(block, tiling.block_k)
    kernel = _triton_gemm(x) if block_k and weight.stride(1) == 1 and weight.shape[0] % 2 == 0 else None
    if kernel is None:
        return None
    if x.stride(1) != 1:
        x = x.contiguous()
    block_n = tiling.block_n // 2 if tiling.block_n >= 128 else tiling.block_n
    keywords = {**asdict(tiling), "block_k": block_k, "block_n": block_n, "split_k": 1,
                **decode_launch(pdl, trigger, x.shape[0])}
    pdl = keywords.get("pdl", False)
    if not w8a8:
        return kernel(x, weight, scale, block, gated=True, **keywords)
    quantized, row_scale = (rows.fp8, rows.scale) if rows is not None else \
        triton_kernel(x, TRITON, "quantize_rows_triton")(x, pdl=pdl)
    return kernel(quantized, weight, scale, block, x_scale=row_scale, out_dtype=x.dtype, gated=True,
                  **{**keywords, "widen_prmt": False})


def decode_pdl(pdl: bool, rows: int) -> bool:
    """Whether a launch asked for PDL takes it: at decode rows only. H200, 8B, base step
    replays: 64 rows W8A8 3.736 -> 3.656 ms, weight-only 4.805 -> 4.717; at 256 rows (the
    prefill tiling's 8-warp programs waiting on the SMs) W8A8 7.382 -> 7.701, slower."""
    return pdl and rows <= DECODE_ROWS


def decode_launch(pdl: bool, trigger: bool, rows: int) -> dict[str, object]:
    """fp8_gemm_triton's keywords for how a launch of `rows` rows meets the kernels beside it:
    programmatic dependent launch (decode_pdl) and the kernel after it launched before it ends
    (trigger), both at decode rows only (past them, programs waiting early hold SMs the
    tiles need)."""
    keywords: dict[str, object] = {"pdl": True, "prefetch_k": PDL_PREFETCH_K} if decode_pdl(pdl, rows) else {}
    if trigger and rows <= DECODE_ROWS:
        keywords["trigger"] = True
    return keywords


def launch_tiling(rows: int, n: int, w8a8: bool, choice: Fp8Choice | None = None) -> Fp8Tiling:
    """The Triton GEMM's tiling for `rows` rows of a weight of `n` output columns: at decode,
    `choice` (block_n, block_k, stages, K splits; 0 splits: the mode's rule) over the mode's
    tiling where given, else the mode's tiling for `n` columns."""
    if rows > DECODE_ROWS:
        return W8A8_PREFILL_TILING if w8a8 else PREFILL_TILING
    if choice is None:
        if w8a8:
            return W8A8_WIDE_TILING if n >= W8A8_WIDE_N else W8A8_NARROW_TILING
        return DECODE_TILING
    # A choice keeps its mode's K-split rule: W8A8's (NARROW's) at any width.
    tiling = W8A8_NARROW_TILING if w8a8 else DECODE_TILING
    block_n, block_k, stages, splits = choice
    return replace(tiling, block_n=block_n, block_k=block_k, num_stages=stages, split_k=splits or None)


def reference_w8a8_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                          block: tuple[int, int] | None, rows: Fp8Rows | None = None) -> torch.Tensor:
    """fp8_matmul's w8a8 math in float32: x quantized per row (quantize_rows, or rows's copy
    where given), dequantized, times dequant(W).T, in x's dtype."""
    quantized, row_scale = quantize_rows(x) if rows is None else (rows.fp8, rows.scale.reshape(-1, 1))
    return ((quantized.float() * row_scale) @ dequantize_fp8(weight, scale, block).t()).to(x.dtype)


def k_tile(block: tuple[int, int] | None, block_k: int) -> int | None:
    """The Triton GEMM's K tile for scale blocks `block` (at most block_k): a power of two
    dividing the block's columns, so no K tile straddles two scales; None where that is below
    16 (the tensor cores' smallest): the reference runs those."""
    if block is None:
        return block_k
    while block_k >= 16 and block[1] % block_k:
        block_k //= 2
    return block_k if block_k >= 16 else None


@lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def capability(device: torch.device) -> tuple[int, int]:
    """A CUDA device's compute capability (read once per device)."""
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def _triton_gemm(x: torch.Tensor):
    """The Triton FP8 GEMM where it runs x; None on GPUs without e4m3 conversions (before
    Ada, compute capability 8.9), which Triton does not compile."""
    if x.is_cuda and capability(x.device) < (8, 9):
        return None
    return triton_kernel(x, TRITON, "fp8_gemm_triton")


def w8a8_runs(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether scaled_mm_rowwise (the tuner's yardstick, not the node's path) takes x and weight:
    Hopper (torch's row-wise scaled GEMM is sm_90's), K and N multiples of 16, weight
    contiguous (its transpose the column-major operand)."""
    return (x.is_cuda and capability(x.device) == (9, 0) and weight.is_contiguous()
            and x.shape[1] % 16 == 0 and weight.shape[0] % 16 == 0)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x in e4m3 [M, K], float32 scales [M, 1]) with x ~ e4m3 * scale: each row scaled so its
    largest magnitude is e4m3's largest (an all-zero row keeps a tiny scale, not 0 / 0)."""
    amax = x.abs().amax(dim=1, keepdim=True).float().clamp_min(1e-12)
    # a tensor divisor: CUDA torch divides by a Python number as a multiply by its reciprocal,
    # an ulp off the correctly rounded quotient the CPU (and the Triton kernel) compute
    scale = amax / torch.full_like(amax, E4M3_MAX)
    quantized = (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return quantized, scale


def scaled_mm_rowwise(quantized: torch.Tensor, row_scale: torch.Tensor, weight: torch.Tensor,
                      scale: torch.Tensor) -> torch.Tensor:
    """torch._scaled_mm over e4m3 x [M, K] and weight [N, K] with row-wise scales (row_scale
    [M, 1], scale [N] per channel), weight passed column-major, bf16 out: the cuBLAS/CUTLASS
    yardstick tuner/fp8_gemm.py times the Triton W8A8 GEMM against."""
    return torch._scaled_mm(quantized, weight.t(), scale_a=row_scale.reshape(-1, 1).float(),
                            scale_b=scale.float().reshape(1, -1).contiguous(),
                            out_dtype=torch.bfloat16)
