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
    python -m bench.tune_kernels --model llama-8b-random --fields fold  # LoRA-folded tilings

--model takes the benchmarks' model names (bench.common.bench_model) or a checkpoint folder;
only its shapes are read (no weights are made). With --tp N the sweep runs one rank's shard
at the shapes that rank's kernels multiply, the table filed under them: the key a node with
--tensor-parallel-size N looks its table up by (inference_node/node.py).

The sweep stops starting new (group, batch) pairs after --budget-s seconds (the table then
holds what was measured; the pairs skipped are printed), so one shape fits a 10-minute call.
Batches above the decode GEMM's rows (kernels.gemm MAX_ROWS) run cuBLAS and are not swept.

With --fields fold (or base,fold) it sweeps the tilings of the decode GEMM with LoRA folded in
(Tuning.fold_tilings; kernels/gemm/fold.py), which steps with adapters run: per group, batch
and adapter-count bucket (--adapters: that many distinct rank-16 adapters, the rows grouped by
adapter as a decode graph orders them), in the mode the node's tuning runs that group in at
that count (inference_node/runner/lora/overlap.py step_lora_plan, under the node choices of the
table already at the output path: with the defaults o folds whole, expand=True, in steps of up
to 8 adapters, and q/k/v, gate/up and o only shrink, expand=False, in steps of more; a group of
the table's fold_shrink_spread shrinks in its tile programs, in as many K ranges as the node
cuts it into; with --tp N a rank's plan, where o always folds whole: its delta must be in its
partial output before the all-reduce; groups the step does not fold are not swept). Each
candidate is checked against the reference x @ W + the LoRA delta (with expand=False: the delta
of the shrink's stored rows) and timed in a CUDA graph over copies of the weight and of the
adapters' A and B, each copy with its own launch counters as each layer has. Its winners go into the
buckets (batch, adapters), each holding the base choices a step of that batch gets, and
fold_tilings. Each field's sweep has its own --budget-s.

The printed table gives each group's default and best tiling per bucket and, on the GPU,
the best launch against its floor: the bytes it must move (its weight, x and y, and a fold's
adapters' A and, where it expands, B) at the copy bandwidth measured in the same run.

Where the table's file exists for the same device and shape, its buckets not swept this time
are kept (and its "node" choices): `--fields fold` adds the fold buckets to a table of base
tilings already there, and `--fields fold --batches 64 --adapters 32` re-tunes one bucket.

Without CUDA (or with --smoke) it runs a CPU SMOKE: a tiny shape, two batches (with
--fields fold, 1 and 16 adapters), three candidates, timed on the CPU through the PyTorch reference (or Triton's interpreter with
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
from typing import Any, Callable, Sequence

import torch

from bench.common import RANDOM_MODELS, bench_model_config, copy_bandwidth
from kernels.gemm import GemmLora, fold_counters
from kernels.gemm.shapes import MAX_ROWS, gated_block_n, row_tile, tiling as fitted_tiling
from kernels.tuning import DEFAULT_TUNING, GROUPS, Tiling, Tuning
from kernels.tuning_table import (Bucket, ModelShape, TuningTable, TuningTableError, device_name,
                                  load_table, table_name)

BATCHES = (64, 32, 16, 8, 1)  # swept in this order: the budget may cut the last
BLOCK_N = (16, 32, 64, 128)
BLOCK_K_STAGES = ((128, 4), (128, 8), (256, 3), (256, 4), (512, 2))
MAX_REL_ERR = 2e-2  # bf16 products, fp32 accumulation
FIELDS = ("base", "fold")  # the decode GEMM's tilings; those with LoRA folded in
ADAPTERS = (32, 16, 8, 1)  # distinct adapters of a fold bucket, swept in this order
RANK = 16


@dataclass(frozen=True)
class Measured:
    group: str
    batch: int
    default: Tiling
    default_us: float
    best: Tiling
    best_us: float
    rejected: tuple[str, ...] = ()   # candidates that failed to run or to match the reference
    adapters: int = 0                # distinct adapters in the step: 0 the base GEMM, else a fold
    expand: bool = True              # a fold's mode (GemmLora.expand)
    splits: int = 0                  # a shrink-only fold's K ranges (GemmLora.shrink_splits)
    nbytes: int = 0                  # what one launch must move: its floor's bytes (launch_bytes)


def launch_bytes(N: int, K: int, batch: int, esize: int, adapters: int = 0, rank: int = RANK,
                 slices: int = 1, expand: bool = True) -> int:
    """The bytes a decode GEMM launch must read or write at least: its weight, x and y, and
    with LoRA folded in each adapter's A (every slice's) and, where it expands, its B."""
    lora = adapters * rank * (slices * K + (N if expand else 0))
    return (N * K + batch * (K + N) + lora) * esize


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
               block_k_stages: tuple[tuple[int, int], ...] = BLOCK_K_STAGES,
               slice_offsets: tuple[int, ...] = ()) -> list[Tiling]:
    """The distinct tilings the node would launch for w [K, N] (kernels.gemm.shapes.tiling:
    stages cut to what shared memory holds, block_k 64 where the tile does not divide K),
    the default first; none where no tiling divides w (the node runs cuBLAS there). For a
    fold, slice_offsets: the first column of each slice, which a tile may not straddle
    (kernels.gemm.gemm_lora_fits; where the default does not fit, the node runs it as the
    reference, and the sweep times that)."""
    default = fitted_tiling(w, group, getattr(DEFAULT_TUNING, field))
    if default is None:
        return []
    options = [default]
    for n in block_n:
        for k, s in block_k_stages:
            fitted = fitted_tiling(w, group, {group: (n, k, s)})
            if (fitted is not None and fitted not in options
                    and all(off % fitted[0] == 0 for off in slice_offsets)):
                options.append(fitted)
    return options


def slice_widths(shape: ModelShape, group: str) -> list[int]:
    """The output columns of each projection a fused group's matmul computes side by side."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    return {"qkv": [q, kv, kv], "o": [shape.hidden], "gate_up": [shape.intermediate] * 2,
            "down": [shape.hidden]}[group]


def winners(results: list[Measured], min_gain: float) -> dict[tuple[int, int], dict[str, Tiling]]:
    """Per (batch, adapters) measured, the groups whose best tiling beats the default by more
    than min_gain (a fraction of the default's time)."""
    found: dict[tuple[int, int], dict[str, Tiling]] = {(r.batch, r.adapters): {} for r in results}
    for r in results:
        if r.best != r.default and r.best_us * (1 + min_gain) < r.default_us:
            found[r.batch, r.adapters][r.group] = r.best
    return found


def table_for(results: list[Measured], field: str, device: str, shape: ModelShape,
              min_gain: float, produced_by: str, existing: TuningTable | None = None) -> TuningTable:
    """A table with a bucket at each (batch, adapters) measured, holding the groups whose
    best tiling beats the default by more than min_gain; a bucket where none does holds no
    choices of its own (so no smaller bucket's entry applies to it). A fold bucket (adapters
    above 0) also holds the base choices a step of its batch gets (a bucket stands alone over
    the node's tuning, and the groups a step does not fold run the base GEMM). Buckets of
    `existing` that this sweep did not measure are kept, as are its node choices."""
    base = winners([r for r in results if r.adapters == 0], min_gain)
    folds = winners([r for r in results if r.adapters > 0], min_gain)
    default_table = getattr(DEFAULT_TUNING, field)
    base_choices = {batch: ({field: {**default_table, **groups}} if groups else {})
                    for (batch, _), groups in base.items()}
    kept = []
    if existing is not None:
        old_base = {b.batch: dict(b.choices) for b in existing.buckets
                    if b.adapters == 0 and b.batch not in base_choices}
        old_folds = {(b.batch, b.adapters): {g: t for g, t in b.choices.get("fold_tilings", {}).items()
                                             if DEFAULT_TUNING.fold_tilings.get(g) != t}
                     for b in existing.buckets if b.adapters > 0 and (b.batch, b.adapters) not in folds}
        if old_base:
            base_choices = {**old_base, **base_choices}
            kept.append("base")
        if old_folds:
            folds = {**old_folds, **folds}
            kept.append("fold")

    def base_for(batch: int) -> dict[str, Any]:  # the nearest base bucket's, as for_step picks
        below = [b for b in base_choices if b <= batch]
        return dict(base_choices[max(below)]) if below else {}

    buckets = [Bucket(batch, 0, choices) for batch, choices in sorted(base_choices.items())]
    buckets += [Bucket(batch, adapters, {**base_for(batch), **(
                    {"fold_tilings": {**DEFAULT_TUNING.fold_tilings, **groups}} if groups else {})})
                for (batch, adapters), groups in sorted(folds.items())]
    if kept and existing.buckets:
        produced_by += f"; {' and '.join(kept)} buckets kept from: {existing.produced_by}"
    return TuningTable(device, shape, dict(existing.node) if existing else {},
                       tuple(sorted(buckets, key=lambda b: (b.batch, b.adapters))), produced_by)


# -- timing ------------------------------------------------------------------------------------

def cuda_timer(calls_for: Callable[[Any], Callable[[], object]], copies: Sequence[Any]) -> float:
    """GPU microseconds per launch: one launch per weight copy back to back in a CUDA graph."""
    from bench.decode_kernels_sweep import graph_us

    return graph_us([calls_for(c) for c in copies], rounds=10)


def cpu_timer(calls_for: Callable[[Any], Callable[[], object]], copies: Sequence[Any]) -> float:
    """CPU SMOKE: wall microseconds per call (median of 3); meaningless as a tuning."""
    call = calls_for(copies[0])
    call()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        call()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def gated(group: str, tuning: Tuning) -> bool:
    """Whether the node's base steps run `group`'s decode GEMM with SiLU(gate) * up in it
    (DecodeGemm.gated_silu): gate/up's tilings are then swept in that launch."""
    return group == "gate_up" and tuning.gate_up_silu


def gemm_call(x: torch.Tensor, w: torch.Tensor, group: str, tuning: Tuning,
              smoke: bool) -> Callable[[], torch.Tensor]:
    """The node's decode GEMM for x @ w with `tuning` (for gate/up, with SiLU * up in it where
    the node runs it so); in the CPU smoke the Triton kernel in the interpreter where it
    runs, else the reference (torch.mm)."""
    from kernels.activation.reference import silu_mul
    from kernels.gemm import DecodeGemm

    if not smoke:
        gemm = DecodeGemm(x.device, tuning)
        assert gemm.applies(x, w, group), f"the decode GEMM does not take {group} at batch {len(x)}"
        if gated(group, tuning):
            assert gemm.gated_silu(x, w) is not None, f"no gated launch of gate/up at batch {len(x)}"
            return lambda: gemm.gated_silu(x, w)
        return lambda: gemm(x, w, group=group)
    from kernels.dispatch import use_triton

    if use_triton(x):
        from kernels.gemm.triton_kernel import decode_gemm_triton

        block_n, block_k, stages = fitted_tiling(w, group, tuning.gemm_tilings)
        if gated(group, tuning):
            return lambda: decode_gemm_triton(x, w, block_n=gated_block_n(block_n), block_k=block_k,
                                              num_stages=stages, gated=True)
        return lambda: decode_gemm_triton(x, w, block_n=block_n, block_k=block_k, num_stages=stages)
    if gated(group, tuning):
        return lambda: silu_mul(torch.mm(x, w))
    return lambda: torch.mm(x, w)


def gemm_reference(x: torch.Tensor, w: torch.Tensor, group: str) -> torch.Tensor:
    """What gemm_call's launch computes, in float32."""
    from kernels.activation.reference import silu_mul

    y = x.float() @ w.float()
    return silu_mul(y) if gated(group, DEFAULT_TUNING) else y


def weight_copies(N: int, K: int, copies: int, device: torch.device, dtype: torch.dtype,
                  gen: torch.Generator) -> list[torch.Tensor]:
    """`copies` copies of a random W [K, N] (outputs about as large as the inputs): [out, in]
    contiguous, multiplied through its transposed view, the node's layout for the groups the
    decode GEMM serves (and what TMA needs)."""
    first = (torch.randn(N, K, generator=gen) * K ** -0.5).to(device, dtype)
    return [first.t()] + [first.clone().t() for _ in range(copies - 1)]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def bucket_top(batch: int, batches: list[int]) -> int:
    """The most rows a step that takes `batch`'s bucket may have: one below the next bucket
    swept, else the decode GEMM's MAX_ROWS. A tiling chosen at `batch` must also run there:
    its kernels compile for row tiles of the next power of 2 (16 at least), which can take
    more shared memory than `batch`'s did."""
    return min([b - 1 for b in batches if b > batch] + [MAX_ROWS])


def same_row_tile(a: int, b: int) -> bool:
    return row_tile(a) == row_tile(b)


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
        weights[group] = weight_copies(N, K, copies, device, dtype, gen)
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
            top = bucket_top(batch, batches)
            inputs = [torch.randn(rows, w[0].shape[0], generator=gen).to(device, dtype)
                      for rows in ([batch] if same_row_tile(batch, top) else [batch, top])]
            x = inputs[0]
            timings: dict[Tiling, float] = {}
            rejected = []
            for option in options[group]:
                tuning = DEFAULT_TUNING.replace(**{field: {**getattr(DEFAULT_TUNING, field), group: option}})
                try:
                    errors = [(len(xi), rel_err(gemm_call(xi, w[0], group, tuning, smoke)(),
                                                gemm_reference(xi, w[0], group))) for xi in inputs]
                    bad = [f"rel err {err:.1e} at {rows} rows" for rows, err in errors if not err <= MAX_REL_ERR]
                    if bad:
                        rejected.append(f"{option}: {', '.join(bad)}")
                        continue
                    timings[option] = timer(lambda wc, t=tuning: gemm_call(x, wc, group, t, smoke), w)
                except Exception as exc:  # a tiling the compiler or the device refuses
                    rejected.append(f"{option}: {type(exc).__name__}: {str(exc)[:120]}")
            default = options[group][0]
            if default not in timings:
                raise SystemExit(f"{group} at batch {batch}: the default tiling {default} failed: {rejected}")
            best = min(timings, key=timings.get)
            results.append(Measured(group, batch, default, timings[default], best, timings[best],
                                    tuple(rejected), nbytes=launch_bytes(N, K, batch, w[0].element_size())))
            print(f"  {group} batch {batch}: {len(timings)} tilings timed, "
                  f"{time.monotonic() - started:.0f} s in", flush=True)
    return sorted(results, key=lambda r: (GROUPS.index(r.group), r.batch)), skipped


# -- the fold (LoRA folded into the decode GEMM) ---------------------------------------------

def fold_copies(K: int, widths: list[int], batch: int, adapters: int, rank: int, expand: bool,
                copies: int, device: torch.device, dtype: torch.dtype,
                gen: torch.Generator, splits: int = 0) -> list[GemmLora]:
    """One GemmLora per weight copy, as the LoRA step plan builds a layer's
    (inference_node/runner/lora/overlap.py): `adapters` distinct adapters of rank `rank` on every
    slice, the batch's rows grouped by adapter in contiguous runs (as a decode graph orders
    them, DecodeGraphs._fill_lora) with a segment table of `adapters` rows (the step's
    segment bucket), deltas about as large as the base output. Adapter s holds rank rows
    s*rank .. s*rank + rank - 1 of every slice's arena (adapters/slots.py). Each copy has its
    own A, B and launch counters (as each layer has); the shrink's rows are one buffer they
    share, with room for `splits` partial sums a row (a spread shrink, GemmLora.shrink_splits)."""
    from inference_node.model.llama import LORA_MODULES
    from kernels.lora import SEGMENT_TABLE_RANKS, LoraBatchMeta

    slots = sorted(row % adapters for row in range(batch))
    meta = LoraBatchMeta.build(slots, device).with_segment_table(
        [[rank, s * rank] * len(LORA_MODULES) for s in range(adapters)], adapters)
    n, slices = sum(widths), len(widths)
    offsets = tuple(sum(widths[:i]) for i in range(slices))
    xa = torch.empty(batch, max(1, splits) * slices * rank, dtype=torch.float32, device=device)
    scaling = torch.ones(adapters, dtype=torch.float32, device=device)
    out = []
    for _ in range(copies):
        a_all = (torch.randn(slices, adapters * rank, K, generator=gen) * K ** -0.5).to(device, dtype)
        b_all = (torch.randn(adapters * rank, n, generator=gen) * rank ** -0.5).to(device, dtype)
        out.append(GemmLora(a_all, b_all, scaling, offsets, meta.segment_table, adapters,
                            SEGMENT_TABLE_RANKS, rank, meta.token_slots,
                            meta.token_table[:, :2 * slices], xa,
                            fold_counters(device=device), expand, shrink_splits=splits))
    return out


def folded_output(y: torch.Tensor, lora: GemmLora) -> torch.Tensor:
    """[T, N] float32: what the step gets from a fold's launch: its output, plus (with
    expand=False) the delta the op after it expands from the shrink's stored rows."""
    if lora.expand:
        return y.float()
    from kernels.lora import gather_rows

    rows, r, width = y.shape[0], lora.rank, lora.slices * lora.rank
    xa = lora.xa[:rows, :lora.splits * width].view(rows, lora.splits, width).sum(1)
    runs = lora.token_rows[:rows]
    delta = torch.cat([torch.einsum("tr,tro->to", xa[:, i * r:(i + 1) * r],
                                    gather_rows(b, runs[:, 2 * i + 1], runs[:, 2 * i], r))
                       for i, b in enumerate(lora.b_slices())], dim=1)
    return y.float() + delta


def fold_modes(groups: list[str], adapters: int, tuning: Tuning = DEFAULT_TUNING) -> dict[str, bool]:
    """The groups a decode step of `adapters` distinct adapters folds under `tuning`, and
    how (GemmLora.expand): the node's plan (overlap.step_lora_plan)."""
    from inference_node.runner.lora.overlap import tuning_lora_plan

    plan = tuning_lora_plan(tuning, adapters)
    return {g: g in plan.folded for g in groups if g in plan.folded | plan.shrink_folded}


def fold_splits(group: str, expand: bool, adapters: int, slices: int, tuning: Tuning,
                device: torch.device) -> int:
    """The K ranges the node cuts a group's shrink-only fold into (its tile programs shrink:
    Tuning.fold_shrink_spread), 0 where it has shrink programs."""
    from inference_node.runner.lora.overlap import spread_splits
    from kernels.host import num_sms

    if expand or group not in tuning.fold_shrink_spread:
        return 0
    return spread_splits(num_sms(device), adapters, slices)


def sweep_fold(shape: ModelShape, batches: list[int], adapter_counts: list[int], groups: list[str],
               device: torch.device, dtype: torch.dtype, smoke: bool, budget_s: float,
               rank: int = RANK, max_candidates: int | None = None, tuning: Tuning = DEFAULT_TUNING,
               ) -> tuple[list[Measured], list[tuple[str, int, int]]]:
    """The fold's sweep: (what was measured, the (group, batch, adapters) the budget left
    unmeasured). Batches in the order given, each adapter count (at most the batch) at each,
    every group a step of `tuning` folds."""
    from bench.decode_kernels_sweep import copies_for
    from kernels.gemm import DecodeGemm

    timer = cpu_timer if smoke else cuda_timer
    started = time.monotonic()
    results: list[Measured] = []
    skipped: list[tuple[str, int, int]] = []
    gen = torch.Generator(device="cpu").manual_seed(0)
    esize = torch.finfo(dtype).bits // 8
    weights: dict[str, list[torch.Tensor]] = {}
    options: dict[str, list[Tiling]] = {}
    copies: dict[str, int] = {}
    for group in groups:
        N, K = shape.gemms()[group]
        widths = slice_widths(shape, group)
        lora_bytes = max(adapter_counts) * rank * (len(widths) * K + N) * esize
        copies[group] = 1 if smoke else copies_for(N * K * esize + lora_bytes)
        offsets = tuple(sum(widths[:i]) for i in range(len(widths)))
        first = torch.empty(N, K, dtype=dtype, device="meta").t()
        options[group] = candidates(first, group, "fold_tilings",
                                    slice_offsets=offsets)[:max_candidates]
        if not options[group]:
            print(f"{group}: no tiling divides its [{K}, {N}] weight: the node runs cuBLAS; not swept")
    for batch in batches:
        for adapters in adapter_counts:
            if adapters > batch:
                continue
            modes = fold_modes(groups, adapters, tuning)
            unfolded = [g for g in groups if g not in modes]
            if unfolded:
                print(f"  batch {batch}, {adapters} adapters: the step does not fold "
                      f"{','.join(unfolded)}: not swept")
            for group, expand in modes.items():
                if not options[group]:
                    continue
                if time.monotonic() - started > budget_s:
                    skipped.append((group, batch, adapters))
                    continue
                N, K = shape.gemms()[group]
                if group not in weights:
                    weights[group] = weight_copies(N, K, copies[group], device, dtype, gen)
                w = weights[group]
                splits = fold_splits(group, expand, adapters, len(slice_widths(shape, group)),
                                     tuning, device)
                loras = fold_copies(K, slice_widths(shape, group), batch, adapters, rank, expand,
                                    copies[group], device, dtype, gen, splits)
                x = torch.randn(batch, K, generator=gen).to(device, dtype)
                checks = [(x, loras[0])]
                top = bucket_top(batch, batches)
                if not same_row_tile(batch, top):  # the bucket's largest step, checked untimed
                    checks.append((torch.randn(top, K, generator=gen).to(device, dtype),
                                   fold_copies(K, slice_widths(shape, group), top, adapters, rank,
                                               expand, 1, device, dtype, gen, splits)[0]))
                refs = [xi.float() @ w[0].float() + li.delta(xi) for xi, li in checks]
                timings: dict[Tiling, float] = {}
                rejected = []
                for option in options[group]:
                    gemm = DecodeGemm(device, DEFAULT_TUNING.replace(
                        fold_tilings={**DEFAULT_TUNING.fold_tilings, group: option}))
                    for lora in loras + [li for _, li in checks[1:]]:
                        lora.sync.zero_()
                    try:
                        bad = []
                        for (xi, li), ref in zip(checks, refs):
                            li.xa.fill_(float("nan"))  # rows no shrink stores would spread
                            err = rel_err(folded_output(gemm(xi, w[0], group=group, lora=li), li), ref)
                            if not err <= MAX_REL_ERR:
                                bad.append(f"rel err {err:.1e} at {len(xi)} rows")
                        if bad:
                            rejected.append(f"{option}: {', '.join(bad)}")
                            continue
                        timings[option] = timer(
                            lambda c, g=gemm: (lambda: g(x, c[0], group=group, lora=c[1])),
                            list(zip(w, loras)))
                    except Exception as exc:  # a tiling the compiler or the device refuses
                        rejected.append(f"{option}: {type(exc).__name__}: {str(exc)[:120]}")
                default = options[group][0]
                if default not in timings:
                    raise SystemExit(f"{group} fold at batch {batch}, {adapters} adapters: the "
                                     f"default tiling {default} failed: {rejected}")
                best = min(timings, key=timings.get)
                results.append(Measured(group, batch, default, timings[default], best,
                                        timings[best], tuple(rejected), adapters, expand,
                                        splits, launch_bytes(N, K, batch, esize, adapters, rank,
                                                             len(slice_widths(shape, group)), expand)))
                how = ("expand" if expand else f"shrink spread over {splits} K ranges" if splits
                       else "shrink only")
                print(f"  {group} fold batch {batch}, {adapters} adapters "
                      f"({how}): {len(timings)} tilings timed, "
                      f"{time.monotonic() - started:.0f} s in", flush=True)
                del loras
    return sorted(results, key=lambda r: (GROUPS.index(r.group), r.batch, r.adapters)), skipped


def print_results(results: list[Measured], smoke: bool, bandwidth: float | None = None) -> None:
    """The table of the sweep; with `bandwidth` (bytes/s of a device copy) each best launch
    against its floor: its bytes (launch_bytes) at that bandwidth."""
    unit = "us (CPU SMOKE: meaningless)" if smoke else "us per launch (CUDA graph)"
    fold = any(r.adapters for r in results)
    what = f" {'adapters':>8} {'fold':>6}" if fold else ""
    print(f"\n{'group':8} {'batch':>5}{what}  {'default tiling':>16} {'us':>8}  {'best tiling':>16} "
          f"{'us':>8} {'default/best':>12} {'floor us':>8} {'best/floor':>10}   [{unit}]")
    for r in results:
        kind = "whole" if r.expand else "spread" if r.splits else "shrink"
        mode = (f" {r.adapters:8d} {kind if r.adapters else '-':>6}"
                if fold else "")
        floor = r.nbytes / bandwidth * 1e6 if bandwidth and r.nbytes else None
        vs_floor = f"{floor:8.2f} {r.best_us / floor:10.2f}" if floor else f"{'-':>8} {'-':>10}"
        print(f"{r.group:8} {r.batch:5d}{mode}  {str(r.default):>16} {r.default_us:8.2f}  {str(r.best):>16} "
              f"{r.best_us:8.2f} {r.default_us / r.best_us:12.3f} {vs_floor}")
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
    ap.add_argument("--fields", default="base",
                    help="what to sweep, comma-separated: base (gemm_tilings or gemm_tma_tilings), "
                         "fold (fold_tilings, per adapter bucket); --fold: base,fold")
    ap.add_argument("--fold", action="store_true", help="also sweep the fold: --fields base,fold")
    ap.add_argument("--adapters", default=None,
                    help=f"the fold's adapter-count buckets, distinct rank-{RANK} adapters, comma-"
                         f"separated (default: {','.join(map(str, ADAPTERS))}; the CPU smoke: 4,1)")
    ap.add_argument("--min-gain", type=float, default=0.02,
                    help="a tiling goes into the table where it is this much faster than the default")
    ap.add_argument("--budget-s", type=float, default=480.0,
                    help="start no new (group, batch) pair after this many seconds (each field's sweep)")
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
    fields = {f for f in args.fields.split(",") if f} | ({"base", "fold"} if args.fold else set())
    if not fields or fields - set(FIELDS):
        raise SystemExit(f"--fields: {args.fields!r}; expected some of {', '.join(FIELDS)}")
    adapter_counts = [int(a) for a in (args.adapters or ("4,1" if smoke else ",".join(map(str, ADAPTERS)))).split(",")]
    if min(adapter_counts) < 1:
        raise SystemExit(f"--adapters: {args.adapters}: expected positive counts")
    from kernels.host import hopper

    tma = not smoke and DEFAULT_TUNING.gemm_tma and hopper(torch.empty(1, device=device))
    field = tiling_field(tma)
    name = device_name(device)
    out = Path(args.out) if args.out else (Path(tempfile.mkdtemp(prefix="tune-kernels-")) if smoke
                                           else Path(__file__).resolve().parents[1] / "kernels" / "configs")
    path = out if out.suffix == ".json" else out / table_name(name, shape)
    existing = None
    if path.is_file():
        try:
            existing = TuningTable.read(path)
        except TuningTableError as exc:
            raise SystemExit(f"{exc}: fix or remove it, or write elsewhere with --out") from None
        if (existing.device, existing.shape) != (name, shape):
            print(f"{path} is for {existing.device}, {existing.shape.key}: replaced, nothing kept")
            existing = None
    # The fold is swept in the modes the node's steps run it: the LoRA step plan of the table's
    # node choices (kept), and a rank's, whose decode graphs never leave o's or down's delta
    # unexpanded (parallel/shard.py).
    from inference_node.parallel.shard import tensor_parallel_tuning
    plan_tuning = existing.tunings(DEFAULT_TUNING).base if existing else DEFAULT_TUNING
    if args.tp > 1:
        plan_tuning = tensor_parallel_tuning(plan_tuning)
    print(("CPU SMOKE (no tuning: checks the sweep and the table's writing and reading)\n" if smoke else "")
          + f"device {name}; shape {shape.key} ({model}, tp {args.tp}); "
          + " and ".join(([field] if "base" in fields else [])
                         + ([f"fold_tilings at {adapter_counts} adapters"] if "fold" in fields else []))
          + f"; batches {batches}; groups {groups}")
    results: list[Measured] = []
    if "base" in fields:
        results, skipped = sweep(shape, batches, groups, device, dtype, field, smoke, args.budget_s,
                                 max_candidates=3 if smoke else None)
        if skipped:
            print(f"budget of {args.budget_s:.0f} s spent: not measured {skipped}")
    if "fold" in fields:
        folded, fold_skipped = sweep_fold(shape, batches, adapter_counts, groups, device, dtype, smoke,
                                          args.budget_s, max_candidates=3 if smoke else None,
                                          tuning=plan_tuning)
        results += folded
        if fold_skipped:
            print(f"budget of {args.budget_s:.0f} s spent: fold not measured (group, batch, "
                  f"adapters) {fold_skipped}")
    bandwidth = None if smoke else copy_bandwidth(device, 1 << 30)
    if bandwidth:
        print(f"\ncopy bandwidth {bandwidth / 1e12:.2f} TB/s (a 1 GiB device copy, read and write counted)")
    print_results(results, smoke, bandwidth)

    command = "python -m bench.tune_kernels " + " ".join(argv if argv is not None else sys.argv[1:])
    swept = "+".join(([field] if "base" in fields else []) + (["fold_tilings"] if "fold" in fields else []))
    table = table_for(results, field, name, shape, args.min_gain,
                      f"{command.strip()} ({'CPU SMOKE' if smoke else swept}, min gain {args.min_gain})",
                      existing)
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
    folds = sorted({(r.batch, r.adapters) for r in results if r.adapters})
    if folds:
        print("and with adapters, the fold's tilings (fold_tilings) and its base GEMM's:")
    for batch, adapters in folds:
        tuning = steps.for_step(batch, adapters)
        fold, base = tuning.fold_tilings, getattr(tuning, field)
        print(f"  batch {batch:3d}, {adapters:3d} adapters: "
              + ", ".join(f"{g}={'.'.join(map(str, fold[g]))}" for g in fold_modes(groups, adapters, plan_tuning))
              + "; base " + ", ".join(f"{g}={'.'.join(map(str, base[g]))}" for g in groups))
    return 0


if __name__ == "__main__":
    sys.exit(main())
