"""The sweep: the decode GEMM's tilings per fused group and decode batch bucket, plain (the
base GEMM) and with LoRA folded in (per bucket of distinct adapters), and a mixture of
experts' grouped GEMMs per batch bucket (expert_trials.py: experts.gate_up, experts.down; it
has no dense MLP to sweep), each candidate run
through the node's own dispatch, checked against the PyTorch reference and timed; the
winners become a TuningTable (kernels/tuning_table.py).

Timing: on CUDA each candidate is replayed from a CUDA graph over as many copies of the
weight (and of the adapters' A and B) as it takes to overflow L2, as in a real step where
every layer reads its own; in the CPU smoke (tests) through the reference, or Triton's
interpreter with TRITON_INTERPRET=1, where the numbers mean nothing. The timer and the clock
are passed in, so the budget's logic is tested with fakes.

The work is a list of cases (group, batch, adapters), the most used first: every batch's base
GEMM (64 rows first), then each batch's folds, the most adapters first (`cases`). The budget
is checked before every candidate: a case cut short keeps the best of the candidates it timed (the
default is always first), and the cases never started are the table's `unmeasured`.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import torch

from kernels.gemm import GemmLora, fold_counters
from kernels.gemm.fp8 import summed
from kernels.gemm.shapes import MAX_ROWS, gated_block_n, row_tile, tiling as fitted_tiling
from kernels.tuning import DEFAULT_TUNING, EXPERT_GROUPS, GROUPS, Tiling, Tuning
from kernels.tuning_table import Bucket, ModelShape, TuningTable

from . import expert_trials, fp8_trials
from .trial import MAX_REL_ERR, Case, Timer, Trial, copies_for, rel_err, tile_backed

log = logging.getLogger(__name__)

BATCHES = (64, 32, 16, 8, 1)     # decode batch buckets, the most used first
ADAPTERS = (0, 32, 16, 8, 1)     # 0: the base GEMM; N: the fold in steps of N distinct adapters
BLOCK_N = (16, 32, 64, 128)
BLOCK_K_STAGES = ((128, 4), (128, 8), (256, 3), (256, 4), (512, 2))
MIN_GAIN = 0.02                  # a tiling goes into the table where it is this much faster
RANK = 16                        # the fold's adapters: rank 16 on every slice

class TuningError(RuntimeError):
    """The sweep cannot produce a table (a default launch failed its check, or the device
    refused it): the node runs the defaults."""


class TuningUnavailable(TuningError):
    """Tuning cannot run here at all (no CUDA device, no Triton)."""


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
    timed: int = 0                   # candidates timed (fewer than offered: the budget cut it)
    unfit: tuple[str, ...] = ()      # candidates this GPU cannot launch (too much shared memory)
    plain: Tiling | None = None      # where `best` splits K: the fastest launch that does not
    plain_us: float = 0.0            # (what the batch's adapter buckets take)


class Budget:
    """The seconds a sweep may spend, checked before every candidate; and its progress line
    in the log ("tuning kernels for <what>: 12/40 candidates, 35 s left"), one every `every_s`
    seconds and one at the last candidate."""

    def __init__(self, seconds: float, what: str, total: int = 0,
                 clock: Callable[[], float] = time.monotonic, every_s: float = 10.0) -> None:
        self.seconds, self.what, self.total, self.clock = seconds, what, total, clock
        self.started = clock()
        self.done = 0
        self.every_s = every_s
        self._said = self.started

    def spent(self) -> float:
        return self.clock() - self.started

    def left(self) -> float:
        return max(0.0, self.seconds - self.spent())

    def out(self) -> bool:
        return self.spent() >= self.seconds

    def step(self) -> None:
        """One candidate timed (or refused)."""
        self.done += 1
        now = self.clock()
        if self.done == self.total or now - self._said >= self.every_s:
            self._said = now
            log.info("tuning kernels for %s: %d/%d candidates, %.0f s left", self.what, self.done,
                     self.total, self.left())


# -- what is swept ----------------------------------------------------------------------------

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


SPLIT_GROUPS = ("o", "down")     # an add + norm follows them, and sums their K splits
SPLIT_BLOCK_K_STAGES = ((128, 4), (128, 6), (256, 3))
MAX_SPLIT_K = 4
# The most rows of the buckets whose LoRA steps take their batch's K-split launches too.
# Splits are timed on the GEMM alone; in a LoRA step the side stream's shrinks and expands
# share the SMs with them. H200 replays (tuner.profile, o and down split as the base
# bucket's), LoRA steps unsplit -> split: 8B at 8 rows (8 adapters) 5.067 -> 4.908 ms, 16 rows
# 5.280 -> 5.054, 32 rows 5.625 -> 5.642; 1B at 8 rows 1.324 -> 1.244, 16 rows 1.465 ->
# 1.227, 32 rows 1.530 -> 1.433, 64 rows 1.511 -> 1.580. The 32-row bucket also serves the
# 24-row graphs (StepTunings.for_step): there, 8 / 32 adapters, 8B 5.603 -> 5.339 / 5.731 ->
# 5.696, 1B 1.506 -> 1.387 / 1.551 -> 1.424. The 64-row bucket's steps take each group's
# fastest launch without K splits.
LORA_SPLIT_ROWS = 32


def split_candidates(w: torch.Tensor, group: str, field: str) -> list[tuple[int, int, int, int]]:
    """K-split launches of o's or down's decode GEMM (Tuning.gemm_split_k), as (block_n,
    block_k, stages, splits): tiles wider than the default's, each cut into as many K splits
    as keep the default's program count (at most MAX_SPLIT_K), so each program reads fewer
    rows of x per weight byte it streams. None for other groups or where nothing divides."""
    default = fitted_tiling(w, group, getattr(DEFAULT_TUNING, field))
    if group not in SPLIT_GROUPS or default is None:
        return []
    K, out = w.shape[0], []
    for n in BLOCK_N:
        splits = n // default[0]
        if splits < 2 or splits > MAX_SPLIT_K:
            continue
        for k, s in SPLIT_BLOCK_K_STAGES:
            fitted = fitted_tiling(w, group, {group: (n, k, s)})
            if fitted is not None and K % (fitted[1] * splits) == 0 and (*fitted, splits) not in out:
                out.append((*fitted, splits))
    return out


def slice_widths(shape: ModelShape, group: str) -> list[int]:
    """The output columns of each projection a fused group's matmul computes side by side."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    return {"qkv": [q, kv, kv], "o": [shape.hidden], "gate_up": [shape.intermediate] * 2,
            "down": [shape.hidden]}[group]


def slice_offsets(shape: ModelShape, group: str) -> tuple[int, ...]:
    widths = slice_widths(shape, group)
    return tuple(sum(widths[:i]) for i in range(len(widths)))


def fold_modes(groups: Sequence[str], adapters: int, tuning: Tuning = DEFAULT_TUNING) -> dict[str, bool]:
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


def cases(shape: ModelShape, batches: Sequence[int], adapters: Sequence[int], groups: Sequence[str],
          plan: Tuning, device: torch.device) -> tuple[list[Case], list[str]]:
    """(the cases to measure, most used first; notes on what is not swept). Every batch's base
    GEMM (adapters 0), then each batch's folds in the order of `adapters` (at most the batch),
    each only for the groups a step of that many adapters folds under `plan`, in its mode. A
    batch without a base bucket runs another batch's launches in every step, with or without
    adapters (H200, 1B at 8 rows on the defaults: step 1.56 ms against 1.08 tuned), while a
    fold's bucket moves a few microseconds of a step of that many adapters (8 rows, 8
    adapters: o's fold 9.1 -> 7.4 us a launch) and sweeps slower (1B, whole `tune` runs: 8 rows' four base GEMMs 37 s,
    o's fold at 8 adapters alone 43 s): a first start's budget that ends early leaves folds
    unmeasured, not base GEMMs."""
    notes: list[str] = []
    experts = [g for g in groups if g in EXPERT_GROUPS] if shape.experts else []
    groups = [g for g in groups if g in shape.gemms()]  # a mixture of experts has no dense MLP

    def base(batch: int) -> list[Case]:
        return [Case(g, batch) for g in groups + experts] if 0 in adapters else []

    def folds(batch: int) -> list[Case]:
        out = []
        for count in adapters:
            if count == 0 or count > batch:
                continue
            modes = fold_modes(groups, count, plan)
            unfolded = [g for g in groups if g not in modes]
            if unfolded:
                notes.append(f"batch {batch}, {count} adapters: the step does not fold "
                             f"{','.join(unfolded)}: not swept")
            out += [Case(g, batch, count, expand, fold_splits(g, expand, count, len(slice_widths(shape, g)),
                                                             plan, device))
                    for g, expand in modes.items()]
            out += [Case(g, batch, count) for g in experts]  # each pair's LoRA beside the grouped GEMM
        return out

    parts = [base(b) for b in batches] + [folds(b) for b in batches]
    return [case for part in parts for case in part], notes


def launch_bytes(N: int, K: int, batch: int, esize: int, adapters: int = 0, rank: int = RANK,
                 slices: int = 1, expand: bool = True) -> int:
    """The bytes a decode GEMM launch must read or write at least: its weight, x and y, and
    with LoRA folded in each adapter's A (every slice's) and, where it expands, its B."""
    lora = adapters * rank * (slices * K + (N if expand else 0))
    return (N * K + batch * (K + N) + lora) * esize


def bucket_top(batch: int, batches: Sequence[int]) -> int:
    """The most rows a step that takes `batch`'s bucket may have (StepTunings.for_step): its
    own batch, or the decode GEMM's MAX_ROWS for the largest bucket swept. A tiling chosen
    at `batch` must also run there: its kernels compile for row tiles of the next power of 2
    (16 at least), which can take more shared memory than `batch`'s did."""
    return batch if any(b > batch for b in batches) else max(batch, MAX_ROWS)


def same_row_tile(a: int, b: int) -> bool:
    return row_tile(a) == row_tile(b)


# -- the launches and their references -------------------------------------------------------------

def gated(group: str, tuning: Tuning) -> bool:
    """Whether the node's base steps run `group`'s decode GEMM with SiLU(gate) * up in it
    (DecodeGemm.gated_silu): gate/up's tilings are then swept in that launch."""
    return group == "gate_up" and tuning.gate_up_silu


def gemm_call(x: torch.Tensor, w: torch.Tensor, group: str, tuning: Tuning) -> Callable[[], Any]:
    """The node's decode GEMM for x @ w with `tuning` (for gate/up, with SiLU * up in it where
    the node runs it so; for o and down, K-split as gemm_split_k says, the partials left
    unsummed as the add + norm after them takes them); on the CPU the Triton kernel in the
    interpreter where it runs, else the reference (torch.mm)."""
    from kernels.activation.reference import silu_mul
    from kernels.gemm import DecodeGemm

    split_k = tuning.gemm_split_k.get(group, 1)
    if x.is_cuda:
        gemm = DecodeGemm(x.device, tuning)
        if not gemm.applies(x, w, group):
            raise TuningError(f"the decode GEMM does not take {group} at batch {len(x)}")
        if gated(group, tuning):
            if gemm.gated_silu(x, w) is None:
                raise TuningError(f"no gated launch of gate/up at batch {len(x)}")
            return lambda: gemm.gated_silu(x, w)
        return lambda: gemm(x, w, group=group, leave_sums=split_k > 1)
    from kernels.dispatch import use_triton

    if use_triton(x):
        from kernels.gemm.triton_kernel import decode_gemm_triton

        block_n, block_k, stages = fitted_tiling(w, group, tuning.gemm_tilings)
        if gated(group, tuning):
            return lambda: decode_gemm_triton(x, w, block_n=gated_block_n(block_n), block_k=block_k,
                                              num_stages=stages, gated=True)
        return lambda: decode_gemm_triton(x, w, block_n=block_n, block_k=block_k, num_stages=stages,
                                          split_k=split_k)
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


def fold_copies(K: int, widths: list[int], batch: int, adapters: int, rank: int, expand: bool,
                copies: int, device: torch.device, dtype: torch.dtype,
                gen: torch.Generator, splits: int = 0) -> list[GemmLora]:
    """One GemmLora per weight copy, as the LoRA step plan builds a layer's
    (inference_node/runner/lora/overlap.py): `adapters` distinct adapters of rank `rank` on every
    slice, the batch's rows grouped by adapter in contiguous runs (as a decode graph orders
    them) with a segment table of `adapters` rows (the step's segment bucket), deltas about as
    large as the base output. Adapter s holds rank rows s*rank .. s*rank + rank - 1 of every
    slice's arena (adapters/slots.py). Each copy has its own A, B and launch counters (as
    each layer has); the shrink's rows are one buffer they share, with room for `splits`
    partial sums a row (a spread shrink, GemmLora.shrink_splits)."""
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


# -- the sweep -------------------------------------------------------------------------------------

@dataclass
class Sweep:
    """Measures cases of one shape on one device: every candidate checked against the
    reference (at the case's batch, and at its bucket's largest step where that compiles
    another row tile), then timed."""

    shape: ModelShape
    device: torch.device
    dtype: torch.dtype
    field: str                       # the base GEMM's tiling table (tiling_field)
    timer: Timer
    batches: Sequence[int]           # every bucket swept (a bucket's largest step: bucket_top)
    max_candidates: int | None = None
    quantization: str = "none"       # FP8 projections' (fp8, fp8-w8a8): their GEMM's launches, in `field`
    tp: int = 1                      # the tensor-parallel size whose rank's shard `shape` is
    rank: int = RANK
    gen: torch.Generator = field(default_factory=lambda: torch.Generator(device="cpu").manual_seed(0))
    _weights: dict[str, list[torch.Tensor]] = field(default_factory=dict)

    @property
    def fp8(self) -> bool:
        return self.quantization != "none"

    def copies(self, group: str, adapters: int = 0) -> int:
        if self.device.type != "cuda":
            return 1
        N, K = self.shape.gemms()[group]
        esize = 1 if self.fp8 else torch.finfo(self.dtype).bits // 8
        lora = adapters * self.rank * (len(slice_widths(self.shape, group)) * K + N) * esize
        return copies_for(N * K * esize + lora)

    def weights(self, group: str, copies: int) -> list:
        have = self._weights.get(group, [])
        if len(have) < copies:
            if self.fp8:
                have = fp8_trials.weights(self.shape, group, copies, self.device, self.gen)
            else:
                N, K = self.shape.gemms()[group]
                have = weight_copies(N, K, copies, self.device, self.dtype, self.gen)
            self._weights[group] = have
        return have[:copies]

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's experts (expert_trials.weights), made once per sweep: 30B-A3B's are 1.2 GB."""
        if "experts" not in self._weights:
            self._weights["experts"] = list(expert_trials.weights(self.shape, self.device, self.dtype))
        gate_up, down = self._weights["experts"]
        return gate_up, down

    def options(self, case: Case) -> list[Tiling]:
        if case.group in EXPERT_GROUPS:
            if case.adapters:
                return expert_trials.lora_options(case.group)[:self.max_candidates]
            return expert_trials.options(self.shape, case.group, self.dtype)[:self.max_candidates]
        if self.fp8:
            from kernels.host import num_sms

            sms = num_sms(self.device) if self.device.type == "cuda" else 1
            return fp8_trials.options(self.shape, case.group, self.quantization == "fp8-w8a8", case.batch,
                                      sms)[:self.max_candidates]
        N, K = self.shape.gemms()[case.group]
        w = torch.empty(N, K, dtype=self.dtype, device="meta").t()
        if case.adapters:
            found = candidates(w, case.group, "fold_tilings", slice_offsets=slice_offsets(self.shape, case.group))
        else:
            found = candidates(w, case.group, self.field)
            if self.tp == 1 and DEFAULT_TUNING.split_sums_in_norm:  # TP ranks all-reduce o and down whole
                found += split_candidates(w, case.group, self.field)
        return found[:self.max_candidates]

    def measure(self, case: Case, options: list[Tiling], budget: Budget) -> Measured:
        """The case's candidates (the default first) checked and timed until the budget is
        out; TuningError where the default fails."""
        nbytes = 0
        if case.group in EXPERT_GROUPS:
            if case.adapters:
                trials, nbytes = expert_trials.lora_trials(self.shape, self.device, self.dtype, self.rank, case,
                                                           options)
            else:
                trials, nbytes = expert_trials.trials(self.shape, self.device, self.dtype, self.expert_weights(),
                                                      case, options)
        elif self.fp8:
            K = self.shape.gemms()[case.group][1]
            trials, nbytes = fp8_trials.trials(self.shape, self.device, self.dtype, self.quantization == "fp8-w8a8",
                                               self.weights(case.group, self.copies(case.group)), case, options,
                                               self._inputs(case, K), self.tp)
        elif case.adapters:
            trials = self._fold_trials(case, options)
        else:
            trials = self._base_trials(case, options)
        timings: dict[Tiling, float] = {}
        rejected: list[str] = []
        unfit: list[str] = []
        for i, (option, trial) in enumerate(zip(options, trials)):
            if i > 0 and budget.out():
                break
            try:
                bad = trial.check()
                if bad:
                    rejected.append(f"{option}: {', '.join(bad)}")
                else:
                    timings[option] = trial.time(self.timer)
            except Exception as exc:  # a tiling the compiler or the device refuses
                # Triton's OutOfResources: a tiling for a GPU with more shared memory, not a fault.
                (unfit if type(exc).__name__ == "OutOfResources" else rejected).append(
                    f"{option}: {type(exc).__name__}: {str(exc)[:120]}")
            budget.step()
        default = options[0]
        if default not in timings:
            raise TuningError(f"{case.describe()}: the default tiling {default} failed: {rejected}")
        best = min(timings, key=timings.get)
        plain = min((t for t in timings if len(t) == 3), key=timings.get) if len(best) > 3 and not self.fp8 else None
        if not nbytes:
            N, K = self.shape.gemms()[case.group]
            esize = torch.finfo(self.dtype).bits // 8
            nbytes = launch_bytes(N, K, case.batch, esize, case.adapters, self.rank,
                                  len(slice_widths(self.shape, case.group)), case.expand)
        return Measured(case.group, case.batch, default, timings[default], best, timings[best],
                        tuple(rejected), case.adapters, case.expand, case.splits, nbytes, len(timings),
                        tuple(unfit), plain, timings[plain] if plain else 0.0)

    def _inputs(self, case: Case, K: int) -> list[torch.Tensor]:
        """x at the case's batch, and at its bucket's largest step where that is another row tile."""
        top = bucket_top(case.batch, self.batches)
        rows = [case.batch] if same_row_tile(case.batch, top) else [case.batch, top]
        return [tile_backed(torch.randn(r, K, generator=self.gen).to(self.device, self.dtype)) for r in rows]

    def _base_trials(self, case: Case, options: list[Tiling]) -> list["Trial"]:
        group = case.group
        N, K = self.shape.gemms()[group]
        w = self.weights(group, self.copies(group))
        inputs = self._inputs(case, K)
        refs = [gemm_reference(xi, w[0], group) for xi in inputs]
        trials = []
        for option in options:
            # A K-split option's partials are timed as left to the add + norm: its sum there
            # reads splits x 4 bytes a column of each row instead of 2, from L2.
            tuning = DEFAULT_TUNING.replace(**{self.field: {**getattr(DEFAULT_TUNING, self.field), group: option[:3]}},
                                            gemm_split_k={group: option[3]} if len(option) > 3 else {})

            def check(t=tuning) -> list[str]:
                errors = [(len(xi), rel_err(summed(gemm_call(xi, w[0], group, t)()), ref))
                          for xi, ref in zip(inputs, refs)]
                return [f"rel err {err:.1e} at {rows} rows" for rows, err in errors if not err <= MAX_REL_ERR]

            def timed(timer: Timer, t=tuning) -> float:
                return timer(lambda wc: gemm_call(inputs[0], wc, group, t), w)

            trials.append(Trial(check, timed))
        return trials

    def _fold_trials(self, case: Case, options: list[Tiling]) -> list["Trial"]:
        from kernels.gemm import DecodeGemm

        group, widths = case.group, slice_widths(self.shape, case.group)
        N, K = self.shape.gemms()[group]
        copies = self.copies(group, case.adapters)
        w = self.weights(group, copies)
        loras = fold_copies(K, widths, case.batch, case.adapters, self.rank, case.expand, copies,
                            self.device, self.dtype, self.gen, case.splits)
        inputs = self._inputs(case, K)
        checks = [(inputs[0], loras[0])] + [
            (xi, fold_copies(K, widths, len(xi), case.adapters, self.rank, case.expand, 1, self.device,
                             self.dtype, self.gen, case.splits)[0]) for xi in inputs[1:]]
        refs = [xi.float() @ w[0].float() + li.delta(xi) for xi, li in checks]
        trials = []
        for option in options:
            gemm = DecodeGemm(self.device, DEFAULT_TUNING.replace(
                fold_tilings={**DEFAULT_TUNING.fold_tilings, group: option}))

            def check(g=gemm) -> list[str]:
                for lora in loras + [li for _, li in checks[1:]]:
                    lora.sync.zero_()
                bad = []
                for (xi, li), ref in zip(checks, refs):
                    li.xa.fill_(float("nan"))  # rows no shrink stores would spread
                    err = rel_err(folded_output(g(xi, w[0], group=group, lora=li), li), ref)
                    if not err <= MAX_REL_ERR:
                        bad.append(f"rel err {err:.1e} at {len(xi)} rows")
                return bad

            def timed(timer: Timer, g=gemm) -> float:
                return timer(lambda c: (lambda: g(inputs[0], c[0], group=group, lora=c[1])), list(zip(w, loras)))

            trials.append(Trial(check, timed))
        return trials


def run(sweep: Sweep, todo: Sequence[Case], budget: Budget) -> tuple[list[Measured], list[Case]]:
    """(what was measured, the cases the budget left unstarted), each case logged."""
    plans = [(case, sweep.options(case)) for case in todo]
    for case, options in plans:
        if not options:
            N, K = sweep.shape.gemms()[case.group]
            log.debug("%s: no tiling divides its [%d, %d] weight: the node runs cuBLAS; not swept",
                     case.describe(), K, N)
    plans = [(c, o) for c, o in plans if o]
    budget.total = sum(len(o) for _, o in plans)
    results, skipped = [], []
    for case, options in plans:
        if budget.out():
            skipped.append(case)
            continue
        measured = sweep.measure(case, options, budget)
        if measured.timed < 2 and len(options) > 1:  # cut before any rival: nothing learnt
            skipped.append(case)
            continue
        results.append(measured)
        log.debug("%s: %d of %d tilings timed, %.0f s in", case.describe(), measured.timed,
                  len(options), budget.spent())
    if skipped:
        log.info("tuning kernels for %s: the budget of %.0f s is spent after %d/%d candidates; %d of %d "
                 "cases unmeasured", budget.what, budget.seconds, budget.done, budget.total, len(skipped),
                 len(plans))
    return results, skipped


# -- the table -------------------------------------------------------------------------------------

def winners(results: Sequence[Measured], min_gain: float) -> dict[tuple[int, int], dict[str, Tiling]]:
    """Per (batch, adapters) measured, the groups whose best tiling beats the default by more
    than min_gain (a fraction of the default's time)."""
    found: dict[tuple[int, int], dict[str, Tiling]] = {(r.batch, r.adapters): {} for r in results}
    for r in results:
        if r.best != r.default and r.best_us * (1 + min_gain) < r.default_us:
            found[r.batch, r.adapters][r.group] = r.best
    return found


def base_bucket(groups: dict[str, Tiling], field: str) -> dict[str, Any]:
    """A base bucket's choices from the groups' winners: the decode GEMMs' in `field` (a
    K-split winner's splits in gemm_split_k; an FP8 GEMM's choice holds its own), the routed
    experts' in moe_tilings."""
    decode_gemm = field in ("gemm_tilings", "gemm_tma_tilings")
    gemms = {g: t[:3] if decode_gemm else t for g, t in groups.items() if g in GROUPS}
    splits = {g: t[3] for g, t in groups.items() if g in GROUPS and decode_gemm and len(t) > 3}
    experts = {g.removeprefix("experts."): t for g, t in groups.items() if g in EXPERT_GROUPS}
    return ({field: {**getattr(DEFAULT_TUNING, field), **gemms}} if gemms else {}) | (
        {"gemm_split_k": splits} if splits else {}) | (
        {"moe_tilings": {**DEFAULT_TUNING.moe_tilings, **experts}} if experts else {})


def buckets_for(results: Sequence[Measured], field: str, min_gain: float,
                existing: TuningTable | None = None) -> tuple[list[Bucket], list[str]]:
    """(the buckets, the kinds of `existing`'s buckets kept): one at each (batch, adapters)
    measured, holding the groups whose best tiling beats the default by more than min_gain;
    a bucket where none does holds no choices of its own (so no other bucket's entry applies
    to it). A fold bucket (adapters above 0) also holds the base launches a step of its batch
    gets, without K splits past LORA_SPLIT_ROWS rows (a bucket stands alone over the node's
    tuning, and the groups a step does not fold run the base GEMM). Buckets of `existing` that
    this sweep did not measure are kept."""
    base = winners([r for r in results if r.adapters == 0], min_gain)
    folds = winners([r for r in results if r.adapters > 0], min_gain)
    base_choices = {batch: base_bucket(groups, field) for (batch, _), groups in base.items()}
    # The adapter buckets' base launches: each group's fastest without K splits.
    unsplit = winners([replace(r, best=r.plain, best_us=r.plain_us) if r.plain else r
                       for r in results if r.adapters == 0], min_gain)
    plain_choices = {batch: base_bucket(groups, field) for (batch, _), groups in unsplit.items()}
    kept = []
    if existing is not None:
        old_base = {b.batch: dict(b.choices) for b in existing.buckets
                    if b.adapters == 0 and b.batch not in base_choices}
        old_folds = {(b.batch, b.adapters): {g: t for g, t in b.choices.get("fold_tilings", {}).items()
                                             if DEFAULT_TUNING.fold_tilings.get(g) != t}
                     for b in existing.buckets if b.adapters > 0 and (b.batch, b.adapters) not in folds}
        if old_base:
            base_choices = {**old_base, **base_choices}
            plain_choices = {**old_base, **plain_choices}
            kept.append("base")
        if old_folds:
            folds = {**old_folds, **folds}
            kept.append("fold")

    def base_for(batch: int) -> dict[str, Any]:
        """The base bucket's choices a step of `batch` rows takes (StepTunings.for_step: the
        fewest rows at or above, else the most): up to LORA_SPLIT_ROWS rows whole, above them
        each group's fastest launch without K splits (a kept bucket's split groups at their
        default tiling)."""
        split_too = batch <= LORA_SPLIT_ROWS
        source = base_choices if split_too else plain_choices
        nearest = min((b for b in source if b >= batch), default=max(source, default=None))
        choices = dict(source[nearest]) if nearest is not None else {}
        if split_too:
            return choices
        split = choices.pop("gemm_split_k", {})
        if split and field in choices:
            default = getattr(DEFAULT_TUNING, field)
            choices[field] = {g: default[g] if g in split else t for g, t in choices[field].items()}
        return choices

    def fold_choices(groups: dict[str, Tiling]) -> dict[str, Any]:  # the experts': their LoRA launches
        gemms = {g: t for g, t in groups.items() if g in GROUPS}
        experts = {g.removeprefix("experts."): t for g, t in groups.items() if g in EXPERT_GROUPS}
        return ({"fold_tilings": {**DEFAULT_TUNING.fold_tilings, **gemms}} if gemms else {}) | (
            {"moe_lora_launches": {**DEFAULT_TUNING.moe_lora_launches, **experts}} if experts else {})

    buckets = [Bucket(batch, 0, choices) for batch, choices in sorted(base_choices.items())]
    buckets += [Bucket(batch, adapters, {**base_for(batch), **fold_choices(groups)})
                for (batch, adapters), groups in sorted(folds.items())]
    return sorted(buckets, key=lambda b: (b.batch, b.adapters)), kept


def print_results(results: Sequence[Measured], smoke: bool, bandwidth: float | None = None,
                  out: Callable[[str], None] = print) -> None:
    """The table of the sweep; with `bandwidth` (bytes/s of a device copy) each best launch
    against its floor: its bytes (launch_bytes) at that bandwidth."""
    unit = "us (CPU SMOKE: meaningless)" if smoke else "us per launch (CUDA graph)"
    fold = any(r.adapters for r in results)
    what = f" {'adapters':>8} {'fold':>6}" if fold else ""
    out(f"\n{'group':15} {'batch':>5}{what}  {'default tiling':>16} {'us':>8}  {'best tiling':>16} "
        f"{'us':>8} {'default/best':>12} {'floor us':>8} {'best/floor':>10}   [{unit}]")
    for r in sorted(results, key=lambda r: ((GROUPS + EXPERT_GROUPS).index(r.group), r.batch, r.adapters)):
        kind = "launch" if r.group in EXPERT_GROUPS else "whole" if r.expand else "spread" if r.splits else "shrink"
        mode = (f" {r.adapters:8d} {kind if r.adapters else '-':>6}"
                if fold else "")
        floor = r.nbytes / bandwidth * 1e6 if bandwidth and r.nbytes else None
        vs_floor = f"{floor:8.2f} {r.best_us / floor:10.2f}" if floor else f"{'-':>8} {'-':>10}"
        out(f"{r.group:15} {r.batch:5d}{mode}  {str(r.default):>16} {r.default_us:8.2f}  {str(r.best):>16} "
            f"{r.best_us:8.2f} {r.default_us / r.best_us:12.3f} {vs_floor}")
        for why in r.rejected:
            out(f"{'':16}rejected {why}")
        if r.unfit:
            out(f"{'':16}{len(r.unfit)} tiling(s) need more shared memory than this GPU has: "
                f"{', '.join(why.split(':')[0] for why in r.unfit)}")
