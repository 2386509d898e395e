"""Sweeps the decode GEMM's tilings per fused group and decode batch bucket on this GPU for one
model shape, checks every candidate against the PyTorch reference, prints the best against
the default per group and bucket, and writes the tuning table the node reads
(kernels/tuning_table.py; format: kernels/configs/README.md).

Each candidate runs through the node's own dispatch (kernels.gemm.DecodeGemm, built with a
Tuning holding that tiling: TMA tile loads and PDL where the node would use them), replayed
from a CUDA graph over as many copies of the weight as it takes to overflow L2, as in a real
step where every layer reads its own. A bucket's entry holds the groups whose best tiling
beats the default by more than --min-gain; a bucket where none does gets no entry.

    python -m bench.tune_kernels --model llama-1b-random                # Llama-3.2-1B's shapes
    python -m bench.tune_kernels --model llama-8b-random                # Llama-3.1-8B's
    python -m bench.tune_kernels --model llama-70b-random --tp 4        # one TP=4 shard of Llama-3.1-70B
    python -m bench.tune_kernels --model llama-8b-random --out /tmp/t   # elsewhere than kernels/configs

--model takes the benchmarks' model names (bench.common.bench_model) or a checkpoint folder;
only its shapes are read (no weights are made). With --tp N the sweep runs one rank's shard
at the shapes that rank's kernels multiply, the table filed under them: the key a node with
--tensor-parallel-size N looks its table up by (inference_node/node.py).

The sweep stops starting new (group, batch) pairs after --budget-s seconds (the table then
holds what was measured; the pairs skipped are printed), so one shape fits a 10-minute call.
Batches above the decode GEMM's rows (kernels.gemm MAX_ROWS) run cuBLAS and are not swept.
Fold tilings (LoRA folded into the GEMM) are not swept here.

Without CUDA (or with --smoke) it runs a CPU SMOKE: a tiny shape, two batches, three
candidates, timed on the CPU through the PyTorch reference (or Triton's interpreter with
TRITON_INTERPRET=1). Its numbers mean nothing; it checks that the sweep, the reference check
and the table's writing and reading work, and writes a table for device "cpu" into a
temporary folder unless --out says where.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from bench.common import RANDOM_MODELS, bench_model_config
from kernels.gemm.shapes import MAX_ROWS, tiling as fitted_tiling
from kernels.tuning import DEFAULT_TUNING, GROUPS, Tiling, Tuning
from kernels.tuning_table import (Bucket, ModelShape, TuningTable, device_name, load_table,
                                  table_name)

BATCHES = (64, 32, 16, 8, 1)  # swept in this order: the budget may cut the last
BLOCK_N = (16, 32, 64, 128)
BLOCK_K_STAGES = ((128, 4), (128, 8), (256, 3), (256, 4), (512, 2))
MAX_REL_ERR = 2e-2  # bf16 products, fp32 accumulation


@dataclass(frozen=True)
class Measured:
    group: str
    batch: int
    default: Tiling
    default_us: float
    best: Tiling
    best_us: float
    rejected: tuple[str, ...] = ()   # candidates that failed to run or to match the reference


def model_shape(model: str, tp: int = 1) -> ModelShape:
    """The shapes one rank's decode GEMMs run at for `model` (bench_model's name or a
    checkpoint folder) split over `tp` ranks: the node's shard (parallel/shard.py: heads, KV
    heads and MLP width divided, hidden size whole), which is also its table's key."""
    from inference_node.parallel.shard import Shard, ShardingError

    try:
        return ModelShape.of(Shard(0, tp).local_config(bench_model_config(model)))
    except ShardingError as exc:
        raise SystemExit(f"--tp {tp}: {exc}") from None
    except (OSError, ValueError, KeyError) as exc:  # no such folder, a bad config.json
        raise SystemExit(f"--model {model}: {exc}") from None


def tiling_field(tma: bool) -> str:
    """The Tuning table the node reads the decode GEMM's tiling from on this device."""
    return "gemm_tma_tilings" if tma else "gemm_tilings"


def candidates(w: torch.Tensor, group: str, field: str,
               block_n: tuple[int, ...] = BLOCK_N,
               block_k_stages: tuple[tuple[int, int], ...] = BLOCK_K_STAGES) -> list[Tiling]:
    """The distinct tilings the node would launch for w [K, N] (kernels.gemm.shapes.tiling:
    stages cut to what shared memory holds, block_k 64 where the tile does not divide K),
    the default first; none where no tiling divides w (the node runs cuBLAS there)."""
    default = fitted_tiling(w, group, getattr(DEFAULT_TUNING, field))
    if default is None:
        return []
    options = [default]
    for n in block_n:
        for k, s in block_k_stages:
            fitted = fitted_tiling(w, group, {group: (n, k, s)})
            if fitted is not None and fitted not in options:
                options.append(fitted)
    return options


def table_for(results: list[Measured], field: str, device: str, shape: ModelShape,
              min_gain: float, produced_by: str) -> TuningTable:
    """A table with a bucket at each batch measured, holding the groups whose best tiling
    beats the default by more than min_gain (a fraction of the default's time); a bucket
    where none does holds no choices (so no smaller bucket's entry applies to it)."""
    by_batch: dict[int, dict[str, Tiling]] = {r.batch: {} for r in results}
    for r in results:
        if r.best != r.default and r.best_us * (1 + min_gain) < r.default_us:
            by_batch[r.batch][r.group] = r.best
    default_table = getattr(DEFAULT_TUNING, field)
    buckets = tuple(Bucket(batch, 0, {field: {**default_table, **groups}} if groups else {})
                    for batch, groups in sorted(by_batch.items()))
    return TuningTable(device, shape, {}, buckets, produced_by)


# -- timing ------------------------------------------------------------------------------------

def cuda_timer(calls_for: Callable[[torch.Tensor], Callable[[], object]],
               weights: list[torch.Tensor]) -> float:
    """GPU microseconds per launch: one launch per weight copy back to back in a CUDA graph."""
    from bench.decode_kernels_sweep import graph_us

    return graph_us([calls_for(w) for w in weights], rounds=10)


def cpu_timer(calls_for: Callable[[torch.Tensor], Callable[[], object]],
              weights: list[torch.Tensor]) -> float:
    """CPU SMOKE: wall microseconds per call (median of 3); meaningless as a tuning."""
    call = calls_for(weights[0])
    call()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        call()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def gemm_call(x: torch.Tensor, w: torch.Tensor, group: str, tuning: Tuning,
              smoke: bool) -> Callable[[], torch.Tensor]:
    """The node's decode GEMM for x @ w with `tuning`; in the CPU smoke the Triton kernel in
    the interpreter where it runs, else the reference (torch.mm)."""
    from kernels.gemm import DecodeGemm

    if not smoke:
        gemm = DecodeGemm(x.device, tuning)
        assert gemm.applies(x, w, group), f"the decode GEMM does not take {group} at batch {len(x)}"
        return lambda: gemm(x, w, group=group)
    from kernels.dispatch import use_triton

    if use_triton(x):
        from kernels.gemm.triton_kernel import decode_gemm_triton

        block_n, block_k, stages = fitted_tiling(w, group, tuning.gemm_tilings)
        return lambda: decode_gemm_triton(x, w, block_n=block_n, block_k=block_k, num_stages=stages)
    return lambda: torch.mm(x, w)


def sweep(shape: ModelShape, batches: list[int], groups: list[str], device: torch.device,
          dtype: torch.dtype, field: str, smoke: bool, budget_s: float,
          max_candidates: int | None = None) -> tuple[list[Measured], list[tuple[str, int]]]:
    """(what was measured, the (group, batch) pairs the budget left unmeasured). Batches in
    the order given (the ones that matter most first), every group at each."""
    from bench.decode_kernels_sweep import copies_for

    timer = cpu_timer if smoke else cuda_timer
    started = time.monotonic()
    results: list[Measured] = []
    skipped: list[tuple[str, int]] = []
    gen = torch.Generator(device="cpu").manual_seed(0)
    weights: dict[str, list[torch.Tensor]] = {}
    options: dict[str, list[Tiling]] = {}
    for group in groups:
        N, K = shape.gemms()[group]
        copies = 1 if smoke else copies_for(N * K * torch.finfo(dtype).bits // 8)
        # [out, in] contiguous, multiplied through its transposed view: the node's layout for
        # the groups the decode GEMM serves (and what TMA needs).
        first = (torch.randn(N, K, generator=gen) * K ** -0.5).to(device, dtype)
        weights[group] = [first.t()] + [first.clone().t() for _ in range(copies - 1)]
        options[group] = candidates(weights[group][0], group, field)[:max_candidates]
        if not options[group]:
            print(f"{group}: no tiling divides its [{K}, {N}] weight: the node runs cuBLAS; not swept")
    for batch in batches:
        for group in groups:
            if not options[group]:
                continue
            if time.monotonic() - started > budget_s:
                skipped.append((group, batch))
                continue
            w = weights[group]
            x = torch.randn(batch, w[0].shape[0], generator=gen).to(device, dtype)
            ref = x.float() @ w[0].float()
            timings: dict[Tiling, float] = {}
            rejected = []
            for option in options[group]:
                tuning = DEFAULT_TUNING.replace(**{field: {**getattr(DEFAULT_TUNING, field), group: option}})
                try:
                    out = gemm_call(x, w[0], group, tuning, smoke)()
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                    if not err <= MAX_REL_ERR:
                        rejected.append(f"{option}: rel err {err:.1e}")
                        continue
                    timings[option] = timer(lambda wc, t=tuning: gemm_call(x, wc, group, t, smoke), w)
                except Exception as exc:  # a tiling the compiler or the device refuses
                    rejected.append(f"{option}: {type(exc).__name__}: {str(exc)[:120]}")
            default = options[group][0]
            if default not in timings:
                raise SystemExit(f"{group} at batch {batch}: the default tiling {default} failed: {rejected}")
            best = min(timings, key=timings.get)
            results.append(Measured(group, batch, default, timings[default], best, timings[best],
                                    tuple(rejected)))
            print(f"  {group} batch {batch}: {len(timings)} tilings timed, "
                  f"{time.monotonic() - started:.0f} s in", flush=True)
    return sorted(results, key=lambda r: (GROUPS.index(r.group), r.batch)), skipped


def print_results(results: list[Measured], smoke: bool) -> None:
    unit = "us (CPU SMOKE: meaningless)" if smoke else "us per launch (CUDA graph)"
    print(f"\n{'group':8} {'batch':>5}  {'default tiling':>16} {'us':>8}  {'best tiling':>16} "
          f"{'us':>8} {'default/best':>12}   [{unit}]")
    for r in results:
        print(f"{r.group:8} {r.batch:5d}  {str(r.default):>16} {r.default_us:8.2f}  {str(r.best):>16} "
              f"{r.best_us:8.2f} {r.default_us / r.best_us:12.3f}")
        for why in r.rejected:
            print(f"{'':16}rejected {why}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None,
                    help=f"model whose shapes to tune: {', '.join(RANDOM_MODELS)}, embedded or a "
                         f"checkpoint folder (default: llama-1b-random on CUDA, tiny in the CPU smoke)")
    ap.add_argument("--tp", type=int, default=1, help="tune one tensor-parallel shard of this many")
    ap.add_argument("--batches", default=None,
                    help=f"comma-separated decode batch buckets (default: {','.join(map(str, BATCHES))}; "
                         f"the CPU smoke: 1,4)")
    ap.add_argument("--groups", default=",".join(GROUPS), help="fused groups to sweep")
    ap.add_argument("--min-gain", type=float, default=0.02,
                    help="a tiling goes into the table where it is this much faster than the default")
    ap.add_argument("--budget-s", type=float, default=480.0,
                    help="start no new (group, batch) pair after this many seconds")
    ap.add_argument("--out", default=None,
                    help="the table's folder (its file named by device and shape) or a .json path "
                         "(default: kernels/configs on CUDA, a temporary folder in the CPU smoke)")
    ap.add_argument("--smoke", action="store_true",
                    help="the CPU smoke (the default without CUDA): tiny, numbers meaningless")
    args = ap.parse_args(argv)

    smoke = args.smoke or not torch.cuda.is_available()
    if smoke:
        torch.set_num_threads(1)  # steadier wall times on a shared CPU
    device = torch.device("cpu" if smoke else "cuda")
    dtype = torch.float32 if smoke else torch.bfloat16
    model = args.model or ("tiny" if smoke else "llama-1b-random")
    shape = model_shape(model, args.tp)
    batches = [int(b) for b in (args.batches or ("1,4" if smoke else ",".join(map(str, BATCHES)))).split(",")]
    too_large = [b for b in batches if b > MAX_ROWS]
    if too_large:
        print(f"batches {too_large}: above the decode GEMM's {MAX_ROWS} rows (cuBLAS runs them): not swept")
        batches = [b for b in batches if b <= MAX_ROWS]
    groups = [g for g in args.groups.split(",") if g]
    unknown = set(groups) - set(GROUPS)
    if unknown:
        raise SystemExit(f"--groups: unknown {sorted(unknown)}; expected some of {', '.join(GROUPS)}")
    from kernels.host import hopper

    tma = not smoke and DEFAULT_TUNING.gemm_tma and hopper(torch.empty(1, device=device))
    field = tiling_field(tma)
    name = device_name(device)
    print(("CPU SMOKE (no tuning: checks the sweep and the table's writing and reading)\n" if smoke else "")
          + f"device {name}; shape {shape.key} ({model}, tp {args.tp}); {field}; "
          f"batches {batches}; groups {groups}")
    results, skipped = sweep(shape, batches, groups, device, dtype, field, smoke, args.budget_s,
                             max_candidates=3 if smoke else None)
    print_results(results, smoke)
    if skipped:
        print(f"\nbudget of {args.budget_s:.0f} s spent: not measured {skipped}")

    command = "python -m bench.tune_kernels " + " ".join(argv if argv is not None else sys.argv[1:])
    table = table_for(results, field, name, shape, args.min_gain,
                      f"{command.strip()} ({'CPU SMOKE' if smoke else field}, min gain {args.min_gain})")
    out = Path(args.out) if args.out else (Path(tempfile.mkdtemp(prefix="tune-kernels-")) if smoke
                                           else Path(__file__).resolve().parents[1] / "kernels" / "configs")
    path = out if out.suffix == ".json" else out / table_name(name, shape)
    path.parent.mkdir(parents=True, exist_ok=True)
    table.write(path)
    # Read back as the node reads it, and each bucket's tiling as a step of that batch gets it.
    again = (load_table("auto", name, shape, path.parent) if path.name == table_name(name, shape)
             else load_table(str(path), name, shape))
    steps = again.tunings(DEFAULT_TUNING)
    print(f"\nwrote {path}: {len(again.buckets)} bucket(s); a step of each batch runs:")
    for batch in batches:
        chosen = getattr(steps.for_step(batch), field)
        print(f"  batch {batch:3d}: " + ", ".join(f"{g}={'.'.join(map(str, chosen[g]))}" for g in groups))
    return 0


if __name__ == "__main__":
    sys.exit(main())
