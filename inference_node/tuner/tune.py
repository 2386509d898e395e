"""A tuning table made on this device: the sweep (sweep.py) over the cases asked for, its
winners filed as buckets, with the key's metadata (dtype, torch and Triton versions) and the
time it took. What the node runs at its first start (store.table_at_start) and what
`inference-node tune` runs ahead of time."""
from __future__ import annotations

import importlib.metadata
import logging
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from kernels.tuning import DEFAULT_TUNING, EXPERT_GROUPS, GROUPS, fp8_tilings_field
from kernels import tuning_table
from kernels.tuning_table import ModelShape, TableKey, TuningTable, device_name, load_table

from . import attention_trials
from .store import Found, table_at_start

from .sweep import (ADAPTERS, BATCHES, MIN_GAIN, Budget, Measured, Sweep, TuningUnavailable, buckets_for, cases,
                    run, tiling_field)
from .trial import Timer, cpu_timer, cuda_timer

log = logging.getLogger(__name__)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def versions() -> dict[str, str]:
    """The torch and Triton a table tuned here is valid for ("none": Triton not installed)."""
    try:
        triton = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton = "none"
    return {"torch": torch.__version__, "triton": triton}


def key_for(device: torch.device, shape: ModelShape, dtype: torch.dtype, quantization: str = "none") -> TableKey:
    """The key of the table this node needs on `device` for (shard) `shape` in `dtype`, its
    projections' weights `quantization` (kernels.tuning_table.QUANTIZATIONS)."""
    return TableKey(device_name(device), shape, dtype_name(dtype), **versions(), quantization=quantization)


def why_not(device: torch.device) -> str | None:
    """Why the sweep cannot run on `device` (None: it can). Only on CUDA: elsewhere the kernels
    are the PyTorch references, which take no launch choices."""
    from kernels.dispatch import triton_installed

    if device.type != "cuda":
        return f"{device.type}: launch choices are tuned on CUDA devices only"
    if not triton_installed():
        return "Triton is not installed: the node runs the PyTorch references"
    return None


def base_field(device: torch.device) -> str:
    """The Tuning table the node reads the base decode GEMM's tilings from on `device`: the
    TMA launch's on Hopper (with the defaults' gemm_tma), the pointer loads' elsewhere."""
    from kernels.host import hopper

    tma = device.type == "cuda" and DEFAULT_TUNING.gemm_tma and hopper(torch.empty(1, device=device))
    return tiling_field(tma)


def tune_table(shape: ModelShape, device: torch.device, dtype: torch.dtype, *, budget_s: float,
               batches: Sequence[int] = BATCHES, adapters: Sequence[int] = ADAPTERS,
               groups: Sequence[str] = GROUPS + EXPERT_GROUPS + (attention_trials.GROUP,), tp: int = 1,
               existing: TuningTable | None = None, min_gain: float = MIN_GAIN, timer: Timer | None = None,
               clock: Callable[[], float] = time.monotonic, max_candidates: int | None = None,
               produced_by: str = "", quantization: str = "none"
               ) -> tuple[TuningTable, list[Measured | attention_trials.AttentionMeasured]]:
    """(the table, what was measured) of `shape`'s decode GEMMs on `device` in `dtype`: the
    base GEMM at each batch (adapters 0) and its folds at each count of distinct adapters,
    within `budget_s` seconds; then, with the group "attention", decode attention's launch
    per step size (attention_trials.py), filed node-wide. The fold is swept in the LoRA step plan the node runs: the
    node choices of `existing` (kept, as are its buckets this sweep does not measure) and,
    with tp > 1, a rank's (parallel/shard.py: o never leaves its delta for the norm after
    it). Over FP8 projections (quantization fp8 or fp8-w8a8) the FP8 GEMM's launches per group
    and batch instead (fp8_trials.py; no fold tilings, no experts: an FP8 GEMM's shrink programs
    have no tiling of their own, and no expert is served over FP8). Off
    CUDA (tests) the candidates run through the reference, or Triton's interpreter, timed by
    the wall clock: the numbers mean nothing there."""
    from inference_node.parallel.shard import tensor_parallel_tuning

    if device.type == "cuda":
        reason = why_not(device)
        if reason is not None:
            raise TuningUnavailable(reason)
    field = base_field(device)
    if quantization != "none":
        field = fp8_tilings_field(quantization == "fp8-w8a8")
        adapters = [a for a in adapters if a == 0]
        groups = [g for g in groups if g in GROUPS or g == attention_trials.GROUP]  # attention is not FP8
    plan = existing.tunings(DEFAULT_TUNING).base if existing is not None else DEFAULT_TUNING
    if tp > 1:
        plan = tensor_parallel_tuning(plan)
    todo, notes = cases(shape, batches, adapters, groups, plan, device)
    for note in notes:
        log.debug("%s", note)
    name = device_name(device)
    weights = "" if quantization == "none" else f" {quantization}"
    budget = Budget(budget_s, f"{name} {shape.key} {dtype_name(dtype)}{weights}", clock=clock)
    sweep_timer = timer or (cuda_timer if device.type == "cuda" else cpu_timer)
    sweep = Sweep(shape, device, dtype, field, sweep_timer, list(batches), max_candidates, quantization, tp)
    results, skipped = run(sweep, todo, budget)
    del sweep  # its operand copies: freed before the node sizes its memory
    attention, attention_skipped = [], []
    if attention_trials.GROUP in groups:
        attention, attention_skipped = attention_trials.sweep(shape, device, dtype, sweep_timer, budget,
                                                              max_candidates)
    if skipped:
        log.debug("unmeasured: %s", ", ".join(case.describe() for case in skipped))
    buckets, kept = buckets_for(results, field, min_gain, existing)
    measured = {(r.group, r.batch, r.adapters) for r in results} | {(attention_trials.GROUP, r.batch, 0)
                                                                    for r in attention}
    unmeasured = {c.key for c in skipped} | {(attention_trials.GROUP, b, 0) for b in attention_skipped}
    node = dict(existing.node) if existing else {}
    if attention:  # node-wide: an entry per batch measured (Tuning.attention_decode_launches)
        old = {int(r): v for r, v in node.get("attention_decode_launches", {}).items()}
        new = {int(r): v for r, v in attention_trials.launches_for(attention).items()}
        entries = {**{r: v for r, v in old.items() if r not in {m.batch for m in attention}}, **new}
        node["attention_decode_launches"] = {str(r): tuple(v) for r, v in sorted(entries.items())}
        if all(tuple(v) == attention_trials.RULE for v in entries.values()):
            del node["attention_decode_launches"]
    spent = budget.spent()
    produced_by = f"{produced_by} ({field}, min gain {min_gain})".strip()
    if existing is not None:
        unmeasured |= {u for u in existing.unmeasured if u not in measured}
        spent += existing.tuning_s or 0.0
        if kept and existing.buckets:
            produced_by += f"; {' and '.join(kept)} buckets kept from: {existing.produced_by}"
    table = TuningTable(name, shape, dtype_name(dtype), node, tuple(buckets), produced_by, versions(), spent,
                        tuple(sorted(unmeasured)),
                        quantization=quantization)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the node sizes its KV cache by the memory left after this
    return table, [*results, *attention]


def node_tuner(device: torch.device, shape: ModelShape, dtype: torch.dtype,
               tp: int, quantization: str = "none") -> Callable[[float], TuningTable]:
    """What a node starting without a table runs (store.table_at_start): the default cases
    within the budget it is given."""
    def tune(budget_s: float) -> TuningTable:
        table, _ = tune_table(shape, device, dtype, budget_s=budget_s, tp=tp, quantization=quantization,
                              produced_by=f"inference-node serve at its first start (--tune-budget {budget_s:g}"
                                          + (f", a rank of --tensor-parallel-size {tp}" if tp > 1 else "") + ")")
        return table
    return tune


def default_cache() -> Path:
    """Where a node keeps the tables it tunes unless told (--tuning-cache-dir): under the
    cache directory, beside the embedded model."""
    from inference_node.model.embedded import cache_root

    return cache_root() / "tuning"


def node_table(setting: str, device: torch.device, shape: ModelShape, dtype: torch.dtype, *,
               budget_s: float, tp: int = 1, cache: Path | None = None, quantization: str = "none") -> Found:
    """The table a node with `--tuning-table setting` and `--tune-budget budget_s` runs with
    on `device` for its (shard) `shape` in `dtype` over projections' weights `quantization`
    (the node's FP8 kind: fp8_kind): none ("off"), the file given (its shape
    checked: TuningTableError), or with "auto" the seed, the cached table or one tuned now
    (store.table_at_start; `cache`: the node's, under its cache directory). The benchmarks
    take their table this way too (budget 0: never tune)."""
    if setting == "off":
        return Found(None, "off")
    if setting != "auto":
        return Found(load_table(setting, shape), "given")
    cache = cache or default_cache()
    reason = why_not(device)
    return table_at_start(key_for(device, shape, dtype, quantization), tuning_table.CONFIG_DIR, cache, budget_s,
                          None if reason else node_tuner(device, shape, dtype, tp, quantization), reason or "")
