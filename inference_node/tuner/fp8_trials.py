"""The node's sweep over FP8 projections (sweep.py's cases of a table for --quantization fp8 or
fp8-w8a8): per batch bucket, each group's decode launch of the FP8 GEMM (Tuning.fp8_tilings or
w8a8_tilings: block_n, block_k, stages, K splits), checked through the node's own call
(kernels.gemm.fp8_linear; gate/up's gated launch where base steps run it) against the float32
reference and timed as the node runs it: q/k/v and gate/up on the rows the norm before them
quantized (W8A8), o and down quantizing their own input and, where the node leaves their K
splits to the add + norm after them (Tuning.split_sums_in_norm), with that add + norm, whose
time grows with the splits it reads. No fold cases: an FP8 GEMM adds no LoRA delta itself, and
the shrink programs its launch may run have no tiling of their own."""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from kernels.tuning import DEFAULT_TUNING, Fp8Choice, Tuning, fp8_tilings_field
from kernels.tuning_table import ModelShape

from .trial import MAX_REL_ERR, Case, Trial, rel_err, tile_backed

# (block_n, block_k, stages) tried beside the default, each at these K splits (0: the rule).
GRID: tuple[tuple[int, int, int], ...] = ((64, 128, 4), (64, 256, 3), (128, 128, 4), (128, 256, 3),
                                          (32, 256, 4))
SPLITS: tuple[int, ...] = (0, 1, 2, 4)
# gate/up's gated launch takes half a tiling's columns from each half where those are 128 or
# more: 256 gives 128 of each.
GATED_GRID = GRID + ((256, 128, 4),)
NORM_EPS = 1e-5


def gated(group: str, tuning: Tuning = DEFAULT_TUNING) -> bool:
    """Whether base steps run gate/up's FP8 GEMM with SiLU(gate) * up in it (one launch)."""
    return group == "gate_up" and tuning.gate_up_silu


def leaves_sums(group: str, tuning: Tuning = DEFAULT_TUNING, tp: int = 1) -> bool:
    """Whether base steps leave the group's K splits to the add + norm after it (not a
    tensor-parallel rank's: its partial output is summed over the ranks first)."""
    return group in ("o", "down") and tuning.split_sums_in_norm and tp == 1


def launch(choice: Fp8Choice, rows: int, N: int, K: int, w8a8: bool, sms: int, group: str) -> tuple[int, ...]:
    """What the GEMM launches for `choice` at these widths: (block_n, block_k, stages, K
    splits), the rule's splits resolved, so that two choices launching alike are timed once."""
    from kernels.gemm.fp8 import launch_tiling
    from kernels.gemm.fp8_triton_kernel import MAX_BLOCK_M, launch_splits
    from kernels.gemm.shapes import row_tile
    from kernels.host import cdiv

    tiling = launch_tiling(rows, N, w8a8, choice)
    if gated(group):
        block_n = tiling.block_n // 2 if tiling.block_n >= 128 else tiling.block_n
        return block_n, tiling.block_k, tiling.num_stages, 1
    programs = cdiv(rows, min(row_tile(rows), MAX_BLOCK_M)) * cdiv(N, tiling.block_n)
    splits, _ = launch_splits(programs, K, tiling.block_k, tiling.split_k, sms, tiling.split_fill,
                              tiling.split_columns)
    return tiling.block_n, tiling.block_k, tiling.num_stages, splits


def options(shape: ModelShape, group: str, w8a8: bool, rows: int, sms: int) -> list[Fp8Choice]:
    """The choices of distinct launches at `rows` rows, the default first."""
    N, K = shape.gemms()[group]
    default = DEFAULT_TUNING.fp8_choices(w8a8)[group]
    out, seen = [], set()
    grid = GATED_GRID if gated(group) else GRID
    for choice in (default, *((*tiling, splits) for tiling in grid for splits in SPLITS)):
        made = launch(choice, rows, N, K, w8a8, sms, group)
        if made not in seen:
            seen.add(made)
            out.append(choice)
    return out


def weights(shape: ModelShape, group: str, copies: int, device: torch.device, gen: torch.Generator) -> list:
    """`copies` copies of a random FP8 weight of the group's matmul ([N, K] e4m3, a scale per
    output channel: what --quantization fp8 makes at load)."""
    from kernels.gemm import quantize_fp8

    N, K = shape.gemms()[group]
    first = quantize_fp8(torch.randn(N, K, generator=gen) * K ** -0.5)
    first = first.to(device)
    return [first] + [type(first)(first.weight.clone(), first.scale.clone(), first.block) for _ in range(copies - 1)]


def launch_bytes(N: int, K: int, batch: int, w8a8: bool, esize: int) -> int:
    """The bytes a launch must move at least: the fp8 weight, x (e4m3 with W8A8) and y."""
    return N * K + batch * (K * (1 if w8a8 else esize) + N * esize)


def trials(shape: ModelShape, device: torch.device, dtype: torch.dtype, w8a8: bool, fp8: list, case: Case,
           options: Sequence[Fp8Choice], inputs: list[torch.Tensor], tp: int = 1) -> tuple[list[Trial], int]:
    """(a trial per option, the bytes one launch must move): each option's call checked at
    every row count of `inputs` against the float32 reference, then timed at the first over the
    weight copies `fp8` (module docstring: what the node runs around it; `shape` a rank's of
    `tp`)."""
    from kernels.activation.reference import silu_mul
    from kernels.gemm import fp8_gated_silu_linear, fp8_linear
    from kernels.gemm.fp8 import Fp8Rows, dequantize_fp8, quantize_rows, summed
    from inference_node.model.launch import ElementwiseOps

    group, field = case.group, fp8_tilings_field(w8a8)
    N, K = shape.gemms()[group]
    # the residual stream and norm weight of the add + norm after o and down (N: the hidden size)
    norm_weight = torch.ones(N, dtype=dtype, device=device)
    hidden = torch.zeros(inputs[0].shape[0], N, dtype=dtype, device=device)

    def operand(x: torch.Tensor) -> torch.Tensor | Fp8Rows:
        if w8a8 and group in ("qkv", "gate_up"):  # the norm before them hands on e4m3 rows
            quantized, scale = quantize_rows(x)
            return Fp8Rows(x, tile_backed(quantized), scale.reshape(-1))
        return x

    operands = [operand(x) for x in inputs]

    def reference(x: torch.Tensor) -> torch.Tensor:
        if w8a8:
            quantized, scale = quantize_rows(x)
            x32 = quantized.float() * scale
        else:
            x32 = x.float()
        y = x32 @ dequantize_fp8(fp8[0].weight, fp8[0].scale, fp8[0].block).t()
        return silu_mul(y) if gated(group) else y

    refs = [reference(x) for x in inputs]
    trials = []
    for option in options:
        tuning = DEFAULT_TUNING.replace(**{field: {**getattr(DEFAULT_TUNING, field), group: option}})
        tilings = tuning.fp8_choices(w8a8)
        ops = ElementwiseOps(device, tuning)

        def output(x, w, leave_sums: bool, tilings=tilings, tuning=tuning) -> torch.Tensor:
            if gated(group, tuning):
                act = fp8_gated_silu_linear(x, w, w8a8=w8a8, tilings=tilings)
                if act is not None:
                    return act
                return silu_mul(fp8_linear(x, w, None, group, w8a8=w8a8, tilings=tilings))
            return fp8_linear(x, w, None, group, w8a8=w8a8, leave_sums=leave_sums, tilings=tilings)

        def check(output=output) -> list[str]:
            errors = [(len(r), rel_err(summed(output(x, fp8[0], leave_sums=False)), r))
                      for x, r in zip(operands, refs)]
            return [f"rel err {err:.1e} at {rows} rows" for rows, err in errors if not err <= MAX_REL_ERR]

        def call_for(w, output=output, ops=ops, tuning=tuning) -> Callable[[], object]:
            x = operands[0]
            if leaves_sums(group, tuning, tp):
                return lambda: ops.add_rms_norm(hidden, output(x, w, leave_sums=True), norm_weight, NORM_EPS,
                                                None, quantize=w8a8)
            return lambda: output(x, w, leave_sums=False)

        trials.append(Trial(check, lambda timer, call_for=call_for: timer(call_for, fp8)))
    esize = torch.finfo(dtype).bits // 8
    return trials, launch_bytes(N, K, case.batch, w8a8, esize)
