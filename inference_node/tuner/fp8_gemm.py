"""The FP8 decode GEMM against the bf16 one, per projection: what an FP8 base model's decode
step gains where it reads one byte a weight instead of two (kernels/gemm/fp8.py).

For each fused projection of a model's shapes (Llama-3.1-8B's widths unless --model says) and
each batch size: GPU microseconds per launch of fp8_matmul (the Triton weight-only kernel, its
decode tiling) and of torch.mm over the same projection in bf16 (cuBLAS, weights [in, out] as
the node keeps them for it), each replayed from a CUDA graph over enough weight copies to
overflow L2 (sweep.py's timing); the bytes each moves per second against the device's copy
bandwidth. Every FP8 launch's output is checked against the reference before it is timed.

    python -m inference_node.tuner.fp8_gemm                           # 8B widths, 64 rows, per-channel
    python -m inference_node.tuner.fp8_gemm --rows 1,16,64 --block 128,128
    python -m inference_node.tuner.fp8_gemm --model DIR --tp 2
    python -m inference_node.tuner.fp8_gemm --sweep                   # and the best of a tiling grid
    python -m inference_node.tuner.fp8_gemm --w8a8 --rows 8,64,256    # W8A8 beside it
    python -m inference_node.tuner.fp8_gemm --device cpu --hidden 64  # CPU smoke (numbers meaningless)
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict, dataclass, replace
from typing import Callable, Sequence

import torch

from kernels.gemm.fp8 import DECODE_TILING, Fp8Tiling, fp8_matmul, reference_fp8_matmul
from kernels.tuning import GROUPS
from kernels.tuning_table import ModelShape

LLAMA_3_1_8B = ModelShape(hidden=4096, intermediate=14336, heads=32, kv_heads=8, head_dim=128)
# The sweep's grid: each tiling compiles once per projection (a few seconds each), so it is kept
# to the designs that could beat today's default (fp8_triton_kernel.py's docstring): swap-AB
# (the widened weight wgmma's register operand) with pointer or TMA loads, wider column tiles
# (fewer rereads of x from L2) and K tiles, 8 warps, and the integer e4m3 -> bf16 widening,
# alone and with the rest, so each one's effect shows against the others.
SWEEP_TILINGS = (
    # (block_n, block_k, split_k, num_warps, num_stages, swap_ab, tma, widen_prmt)
    (64, 128, None, 4, 4, False, False, False),    # x @ W.T, pointer loads
    (64, 128, None, 4, 4, False, False, True),     # only the widening changed
    (128, 128, None, 4, 4, True, False, False),    # swap-AB, pointer loads
    (128, 128, None, 8, 4, True, False, True),
    (32, 128, None, 4, 4, True, True, False),      # swap-AB, TMA: half the columns a program
    (64, 128, 1, 4, 4, True, True, False),         # no K split: no partials, one launch
    (128, 128, None, 4, 4, True, True, False),
    (128, 128, None, 8, 4, True, True, False),
    (128, 128, 2, 8, 4, True, True, False),
    (64, 256, None, 4, 4, True, True, False),
    (128, 256, None, 8, 3, True, True, False),
    (256, 128, None, 8, 4, True, True, False),
    (64, 128, None, 4, 4, True, True, True),       # swap-AB, TMA, integer widening
    (128, 128, None, 4, 4, True, True, True),
    (128, 128, None, 8, 4, True, True, True),
    (128, 256, None, 8, 3, True, True, True),
)
# W8A8 (--quantization fp8-w8a8): both operands e4m3 from shared memory, nothing widened; the grid
# of tile widths and depths around the node's tilings.
W8A8_TILINGS = (
    (64, 128, None, 4, 4, True, True, False),
    (128, 128, None, 4, 4, True, True, False),
    (128, 128, None, 8, 4, True, True, False),
    (64, 256, None, 4, 3, True, True, False),
    (128, 256, None, 8, 3, True, True, False),
    (256, 128, None, 8, 3, True, True, False),
    (64, 128, 1, 4, 4, True, True, False),
    (64, 128, None, 4, 4, False, True, False),
)

# Microseconds per call of each of `calls` (one per weight copy), run back to back.
Timer = Callable[[Sequence[Callable[[], object]]], float]


@dataclass(frozen=True)
class Row:
    group: str
    rows: int
    n: int
    k: int
    bf16_us: float
    fp8_us: float
    fp8_bytes: int   # what one FP8 launch must move: weights, scales, x and y
    bf16_bytes: int
    tiling: Fp8Tiling = DECODE_TILING
    w8a8_us: float | None = None      # the Triton W8A8 GEMM over quantized x (fastest tiling)
    quantize_us: float | None = None  # x quantized per row (quantize_rows_triton)
    scaled_mm_us: float | None = None  # torch._scaled_mm over the same operands (per-channel, Hopper)
    w8a8_tiling: Fp8Tiling = DECODE_TILING
    note: str = ""   # the sweep's tilings left out
    swept: tuple[tuple[Fp8Tiling, float | None], ...] = ()  # each tiling's us (None: left out)
    w8a8_node_us: float | None = None  # fp8_matmul(w8a8=True) as the node calls it: quantize + GEMM


def wall_timer(calls: Sequence[Callable[[], object]], rounds: int = 3) -> float:
    """CPU smoke: wall microseconds per call (median of `rounds`)."""
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for call in calls:
            call()
        times.append((time.perf_counter() - start) * 1e6 / len(calls))
    return statistics.median(times)


def cuda_timer(calls: Sequence[Callable[[], object]]) -> float:
    from .trial import graph_us

    return graph_us(list(calls))


def operands(n: int, k: int, copies: int, block: tuple[int, int] | None, device: torch.device,
             gen: torch.Generator) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """`copies` of a projection's weights: bf16 [K, N] (cuBLAS's layout in the node), fp8
    [N, K] and their float32 scales ([N], or per block)."""
    scale_shape = (n,) if block is None else (-(-n // block[0]), -(-k // block[1]))
    made = dict(device=device, generator=gen)
    bf16 = [(torch.randn(k, n, **made) * 0.02).to(torch.bfloat16) for _ in range(copies)]
    fp8 = [(torch.randn(n, k, **made) * 60).clamp(-448, 448).to(torch.float8_e4m3fn) for _ in range(copies)]
    scales = [torch.rand(scale_shape, **made) * 2e-3 + 1e-4 for _ in range(copies)]
    return bf16, fp8, scales


def check(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
          call: Callable[[], torch.Tensor], what: str) -> None:
    """Raises where the launch's output is not the reference's (bf16 rounding aside)."""
    y, expected = call().float(), reference_fp8_matmul(x, weight, scale, block).float()
    err = (y - expected).abs().max().item()
    bound = 2 ** -7 * max(1e-6, expected.abs().max().item())
    if not err <= bound:
        raise AssertionError(f"{what}: max error {err:.3g} against the reference (bound {bound:.3g})")


def fp8_call(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
             block: tuple[int, int] | None, tiling: Fp8Tiling | None,
             x_scale: torch.Tensor | None = None) -> Callable[[], torch.Tensor]:
    """fp8_matmul as the node calls it (tiling None), or the Triton kernel with `tiling`;
    with x_scale, x is e4m3 (W8A8) and the output bf16."""
    if tiling is None:
        return lambda: fp8_matmul(x, weight, scale, block)
    from kernels.gemm.fp8 import k_tile
    from kernels.gemm.fp8_triton_kernel import fp8_gemm_triton

    keywords = {**asdict(tiling), "block_k": k_tile(block, tiling.block_k)}
    if x_scale is not None:
        keywords.update(x_scale=x_scale, out_dtype=torch.bfloat16, widen_prmt=False)
    return lambda: fp8_gemm_triton(x, weight, scale, block, **keywords)


def check_w8a8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               block: tuple[int, int] | None, call: Callable[[], torch.Tensor], what: str) -> None:
    """Raises where a W8A8 launch's output is not reference_w8a8_matmul's (bf16 rounding aside)."""
    from kernels.gemm.fp8 import reference_w8a8_matmul

    y, expected = call().float(), reference_w8a8_matmul(x, weight, scale, block).float()
    err = (y - expected).abs().max().item()
    bound = 2 ** -7 * max(1e-6, expected.abs().max().item())
    if not err <= bound:
        raise AssertionError(f"{what}: max error {err:.3g} against the W8A8 reference (bound {bound:.3g})")


def measure_w8a8(x: torch.Tensor, fp8: Sequence[torch.Tensor], scales: Sequence[torch.Tensor],
                 block: tuple[int, int] | None, timer: Timer, tilings: Sequence[Fp8Tiling],
                 failed: list[str]) -> tuple[float, float, float, float | None, Fp8Tiling]:
    """(quantize us, the node's fp8_matmul us (quantize and GEMM), the fastest W8A8 GEMM's us,
    torch._scaled_mm's us or None, the GEMM's tiling):
    x quantized once, then the node's tiling and each of `tilings` checked and timed over the
    weight copies."""
    from kernels.gemm.fp8 import scaled_mm_rowwise, w8a8_runs
    from kernels.gemm.fp8_triton_kernel import quantize_rows_triton

    from kernels.gemm.fp8 import launch_tiling

    quantize_us = timer([lambda: quantize_rows_triton(x)] * len(fp8))
    node_us = timer([lambda w=w, s=s: fp8_matmul(x, w, s, block, w8a8=True) for w, s in zip(fp8, scales)])
    quantized, row_scale = quantize_rows_triton(x)
    node_tiling = launch_tiling(x.shape[0], fp8[0].shape[0], w8a8=True)
    best, best_us = node_tiling, float("inf")
    for tiling in (node_tiling, *[t for t in tilings if t != node_tiling]):
        try:
            check_w8a8(x, fp8[0], scales[0], block,
                       fp8_call(quantized, fp8[0], scales[0], block, tiling, row_scale), f"w8a8 {tiling}")
            us = timer([fp8_call(quantized, w, s, block, tiling, row_scale) for w, s in zip(fp8, scales)])
        except Exception as exc:  # left out, as measure's candidates
            failed.append(f"w8a8 {describe(tiling)}: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        if us < best_us:
            best, best_us = tiling, us
    scaled_us = None
    if block is None and x.is_cuda and w8a8_runs(x, fp8[0]):
        scaled_us = timer([lambda w=w, s=s: scaled_mm_rowwise(quantized, row_scale, w, s)
                           for w, s in zip(fp8, scales)])
    return quantize_us, node_us, best_us, scaled_us, best


def sweep_tilings(grid: Sequence[tuple] = SWEEP_TILINGS) -> list[Fp8Tiling]:
    keys = ("block_n", "block_k", "split_k", "num_warps", "num_stages", "swap_ab", "tma", "widen_prmt")
    tilings = [replace(DECODE_TILING, **dict(zip(keys, values))) for values in grid]
    return [t for t in tilings if t != DECODE_TILING]  # the default is timed anyway


def describe(tiling: Fp8Tiling) -> str:
    """A tiling in a table's width: (block_n, block_k, split) warps/stages and its options."""
    flags = "".join(name for name, on in ((" swap", tiling.swap_ab), (" tma", tiling.tma),
                                          (" prmt", tiling.widen_prmt)) if on)
    return (f"({tiling.block_n}, {tiling.block_k}, {tiling.split_k or 'auto'}) "
            f"w{tiling.num_warps} s{tiling.num_stages}{flags}")


def measure(shape: ModelShape, batches: Sequence[int], block: tuple[int, int] | None,
            device: torch.device, timer: Timer, copies: int | None = None,
            tilings: Sequence[Fp8Tiling] = (), w8a8_tilings: Sequence[Fp8Tiling] | None = None
            ) -> list[Row]:
    """A Row per projection and batch: bf16 and FP8 (the node's dispatch; with `tilings`, the
    fastest of them that the device can launch) microseconds per launch; with w8a8_tilings
    (() for the decode tiling alone) W8A8's too. copies: weight copies a timed graph walks
    through (None: enough to overflow L2)."""
    from .trial import copies_for

    gen = torch.Generator(device=device).manual_seed(0)
    out = []
    for group, (n, k) in shape.gemms().items():
        bf16, fp8, scales = operands(n, k, copies or copies_for(2 * n * k), block, device, gen)
        scale_bytes = scales[0].numel() * 4
        for rows in batches:
            x = torch.randn(rows, k, device=device, generator=gen).to(torch.bfloat16)
            act_bytes = 2 * rows * (k + n)
            bf16_us = timer([lambda w=w: torch.mm(x, w) for w in bf16])
            check(x, fp8[0], scales[0], block, fp8_call(x, fp8[0], scales[0], block, None), group)
            fp8_us = timer([fp8_call(x, w, s, block, None) for w, s in zip(fp8, scales)])
            best, failed, swept = DECODE_TILING, [], [(DECODE_TILING, fp8_us)]
            for tiling in tilings:
                try:
                    check(x, fp8[0], scales[0], block, fp8_call(x, fp8[0], scales[0], block, tiling),
                          f"{group} {tiling}")
                    us = timer([fp8_call(x, w, s, block, tiling) for w, s in zip(fp8, scales)])
                except Exception as exc:
                    # A candidate that does not fit (Triton's OutOfResources: more shared memory
                    # than here), does not compile, or misses the reference is reported and left
                    # out: the one run still times the others.
                    failed.append(f"{describe(tiling)}: {type(exc).__name__}: {str(exc)[:200]}")
                    swept.append((tiling, None))
                    continue
                swept.append((tiling, us))
                if us < fp8_us:
                    best, fp8_us = tiling, us
            w8a8 = (None, None, None, None, DECODE_TILING)
            if w8a8_tilings is not None:
                w8a8 = measure_w8a8(x, fp8, scales, block, timer, w8a8_tilings, failed)
            for line in failed:
                print(f"{group} rows {rows}: left out {line}")
            note = f"{len(failed)} tiling(s) left out (unfit, failed or wrong)" if failed else ""
            quantize_us, node_us, w8a8_us, scaled_mm_us, w8a8_tiling = w8a8
            out.append(Row(group, rows, n, k, bf16_us, fp8_us, n * k + scale_bytes + act_bytes,
                           2 * n * k + act_bytes, best, w8a8_us, quantize_us, scaled_mm_us,
                           w8a8_tiling, note, tuple(swept), node_us))
    return out


def print_table(rows: Sequence[Row], bandwidth: float | None, smoke: bool,
                out: Callable[[str], None] = print) -> None:
    """projection, N, K, bf16 and FP8 us, bf16/FP8, and each one's GB/s (with `bandwidth`, the
    copy's bytes/s: also its share of it); where W8A8 was timed, its quantize and GEMM us, the
    GEMM's share of the copy, torch._scaled_mm's us over the same operands, and the node's
    call (quantize + GEMM, its tilings) us."""
    unit = "CPU SMOKE: meaningless" if smoke else "us per launch, CUDA graph replays"
    tuned = any(r.tiling != DECODE_TILING or r.w8a8_us is not None for r in rows)
    share = ((lambda rate: f"{rate * 1e9 / bandwidth:7.0%}") if bandwidth else (lambda rate: f"{'-':>7}"))

    def us(value: float | None, width: int = 8) -> str:
        return f"{'-' if value is None or value == float('inf') else f'{value:.2f}':>{width}}"

    out(f"\n{'projection':10} {'rows':>4} {'N':>6} {'K':>6} {'bf16 us':>8} {'fp8 us':>8} "
        f"{'bf16/fp8':>8} {'fp8 GB/s':>8} {'of copy':>7} {'bf16 GB/s':>9} {'of copy':>7}"
        f" {'quant us':>8} {'w8a8 us':>8} {'of copy':>7} {'scaledmm':>8} {'node w8a8':>9}"
        + ("  fastest fp8 tiling | w8a8 tiling" if tuned else "") + f"   [{unit}]")
    for r in sorted(rows, key=lambda r: (r.rows, GROUPS.index(r.group))):
        fp8_rate, bf16_rate = r.fp8_bytes / r.fp8_us * 1e-3, r.bf16_bytes / r.bf16_us * 1e-3
        timed = r.w8a8_us is not None and r.w8a8_us < float("inf")
        w8a8_share = share(r.fp8_bytes / r.w8a8_us * 1e-3) if timed else f"{'-':>7}"
        tiling = f"  {describe(r.tiling)} | {describe(r.w8a8_tiling)}" if tuned else ""
        out(f"{r.group:10} {r.rows:4d} {r.n:6d} {r.k:6d} {r.bf16_us:8.2f} {r.fp8_us:8.2f} "
            f"{r.bf16_us / r.fp8_us:8.2f} {fp8_rate:8.0f} {share(fp8_rate)} {bf16_rate:9.0f} "
            f"{share(bf16_rate)} {us(r.quantize_us)} {us(r.w8a8_us)} {w8a8_share} {us(r.scaled_mm_us)}"
            f" {us(r.w8a8_node_us, 9)}"
            f"{tiling}" + (f"  {r.note}" if r.note else ""))
    if bandwidth:
        out(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (a 1 GiB device copy, read and write counted)")
    swept = [r for r in rows if len(r.swept) > 1]
    if swept:  # every tiling's time, so one run shows each design's effect
        out(f"\n{'fp8 us per tiling':42}" + "".join(f" {f'{r.group}/{r.rows}':>12}" for r in swept))
        for i, (tiling, _) in enumerate(swept[0].swept):
            cells = [r.swept[i][1] for r in swept]
            out(f"{describe(tiling):42}" + "".join(f" {'left out' if us is None else f'{us:.2f}':>12}"
                                                   for us in cells))


def parse_block(text: str | None) -> tuple[int, int] | None:
    if not text:
        return None
    try:
        bn, bk = (int(v) for v in text.split(","))
    except ValueError:
        raise SystemExit(f"--block {text!r}: expected two integers, e.g. 128,128") from None
    return bn, bk


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint folder (only config.json is read); default: "
                        "Llama-3.1-8B's widths")
    parser.add_argument("--tp", type=int, default=1, help="one tensor-parallel rank's shapes")
    parser.add_argument("--hidden", type=int, help="CPU smoke: a model of this hidden size")
    parser.add_argument("--rows", default="64", help="batch sizes, comma-separated")
    parser.add_argument("--block", help="block scales BN,BK (e.g. 128,128); default per-channel")
    parser.add_argument("--sweep", action="store_true",
                        help="also time a grid of tilings and designs (swap-AB, TMA, integer "
                        "widening) per projection, each checked against the reference first")
    parser.add_argument("--w8a8", action="store_true",
                        help="also time W8A8 (--quantization fp8-w8a8): x quantized per row, the Triton "
                        "GEMM over e4m3 operands (with --sweep, over W8A8's grid of tilings instead "
                        "of weight-only's), torch's row-wise scaled GEMM beside it")
    parser.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    args = parser.parse_args(argv)
    device = torch.device(args.device if args.device != "auto" else
                          ("cuda" if torch.cuda.is_available() else "cpu"))
    smoke = device.type == "cpu"
    from kernels.host import interpreting

    if args.w8a8 and smoke and not interpreting():
        parser.error("--w8a8 times the Triton kernels themselves: on the CPU, run it with TRITON_INTERPRET=1")
    if args.model:
        from .cli import model_shape

        shape = model_shape(args.model, args.tp)
    elif args.hidden:
        h = args.hidden
        shape = ModelShape(hidden=h, intermediate=3 * h, heads=4, kv_heads=2, head_dim=h // 4)
    else:
        shape = LLAMA_3_1_8B
    from .cli import integers

    batches = integers(args.rows, "--rows", 1)
    block = parse_block(args.block)
    if smoke:
        rows = measure(shape, batches, block, device, wall_timer, copies=1,
                       w8a8_tilings=() if args.w8a8 else None)
        bandwidth = None
    else:
        from .trial import copy_bandwidth

        w8a8_tilings = (sweep_tilings(W8A8_TILINGS) if args.sweep else ()) if args.w8a8 else None
        rows = measure(shape, batches, block, device, cuda_timer,
                       tilings=sweep_tilings() if args.sweep and not args.w8a8 else (),
                       w8a8_tilings=w8a8_tilings)
        bandwidth = copy_bandwidth(device)
    print(f"FP8 weight-only GEMM vs bf16 torch.mm, {shape.key}, "
          f"{'per-channel' if block is None else f'{block[0]}x{block[1]} block'} scales, {device}")
    print_table(rows, bandwidth, smoke)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
