"""The decode attention launch per step size (Tuning.attention_decode_launches): key tile,
warps and pipeline stages of the paged attention kernel, swept at each batch of BATCHES over
the shape's heads and checked against the PyTorch reference.

Why it is tuned: its best launch moves with the batch and the GPU. On an H200 at 8B's heads
the rule's launch (32 keys, 4 warps) was the fastest at 64 sequences, while at 256 a tile of
16 keys on 2 warps took 57.1 µs against 63.5; at 1B's, 256 sequences 33.1 against 39.3
(docs/PERFORMANCE.md). Each candidate is timed at two context lengths and judged by their sum,
so a launch that only wins on short contexts (where a step spends little in attention) does
not take long ones, where the step spends most.

Timing: one launch a layer's copy of the KV cache in a CUDA graph, as many copies as overflow
L2, as in a step where every layer reads its own cache. Alone, a launch misses the overlap a
step's chain of PDL launches gives it: 8B's 8-row winner replayed slower in the decode graph
(`tuner.profile --mode attention_decode_launches=none --mode default` sets the two side by
side). Off CUDA the kernel is the reference, which takes no launch: the sweep then only checks
its own logic (tests)."""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from kernels.tuning_table import ModelShape

from .trial import MAX_REL_ERR, Timer, copies_for, rel_err

log = logging.getLogger(__name__)

GROUP = "attention"                  # its name among the sweep's (group, batch, adapters) keys
BATCHES = (8, 64, 256)               # decode rows: the table's entries (the largest serves above it)
CONTEXTS = (256, 1024)               # tokens a sequence holds when timed; candidates ranked by the sum
TILES = (2048, 4096, 8192)           # keys times head dims of a key tile
WARPS = (2, 4, 8)
STAGES = (1, 3)
PAGE = 16                            # KV cache block size (the node's default)
MIN_GAIN = 0.02                      # a launch replaces the rule's where this much faster

Launch = tuple[int, int, int]        # (key tile elements, warps, stages)
RULE: Launch = (0, 0, 0)             # an entry that keeps the rule's launch


@dataclass(frozen=True)
class AttentionMeasured:
    batch: int
    default_us: float                # the rule's launch, summed over CONTEXTS
    best: Launch | None              # None: the rule's launch was the fastest
    best_us: float
    timed: int
    rejected: tuple[str, ...] = ()   # candidates that failed to run or to match the reference
    nbytes: int = 0                  # KV bytes one launch reads, summed over its contexts
    contexts: tuple[int, ...] = CONTEXTS


def candidates(head_dim: int) -> list[Launch | None]:
    """The rule's launch (None) first, then each (tile, warps, stages) whose key tile holds
    16 to 256 keys of `head_dim`-wide heads (kernels.attention.triton_kernel.key_block)."""
    out: list[Launch | None] = [None]
    for tile, warps, stages in itertools.product(TILES, WARPS, STAGES):
        if 16 <= tile // head_dim <= 256:
            out.append((tile, warps, stages))
    return out


class KvCase:
    """One batch's decode attention at one context length: a query a sequence and, per layer
    copy, a KV cache whose blocks are scattered as a serving node's are."""

    def __init__(self, shape: ModelShape, batch: int, context: int, device: torch.device, dtype: torch.dtype,
                 copies: int | None = None, seed: int = 0) -> None:
        gen = torch.Generator(device=device).manual_seed(seed)
        blocks_each = -(-context // PAGE)
        blocks = batch * blocks_each + 1
        heads, kv_heads, dim = shape.heads, shape.kv_heads, shape.head_dim
        self.nbytes = 2 * batch * context * kv_heads * dim * torch.empty(0, dtype=dtype).element_size()
        count = copies or copies_for(self.nbytes)
        self.caches = [tuple(torch.randn(blocks, PAGE, kv_heads, dim, generator=gen, device=device, dtype=dtype)
                             for _ in range(2)) for _ in range(count)]
        order = torch.randperm(blocks - 1, generator=gen, device=device).to(torch.int32)
        self.block_tables = order[:batch * blocks_each].view(batch, blocks_each).contiguous()
        self.q = torch.randn(batch, heads, dim, generator=gen, device=device, dtype=dtype)
        self.query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        self.out = torch.empty_like(self.q)
        self.context = context
        self.scale = dim ** -0.5

    def args(self, cache: tuple[torch.Tensor, torch.Tensor]) -> tuple[Any, ...]:
        return (self.q, *cache, self.block_tables, self.query_start_loc, self.seq_lens, self.scale, 1,
                self.context)

    def reference(self) -> torch.Tensor:
        from kernels.attention.reference import paged_attention_ref

        return paged_attention_ref(*self.args(self.caches[0])).float()


def attention_call(case: KvCase, launch: Launch | None) -> Callable[[Any], Callable[[], object]]:
    """calls_for of the timer: one launch over a cache copy, as the node's dispatch makes it
    (the reference off CUDA), with `launch` as the tuning's entry for the batch's rows."""
    from kernels.attention import paged_attention
    from kernels.tuning import DEFAULT_TUNING

    rows = str(case.q.shape[0])
    tuning = DEFAULT_TUNING.replace(attention_decode_launches={rows: launch} if launch else {})

    def calls_for(cache):
        return lambda: paged_attention(*case.args(cache), tuning, out=case.out)
    calls_for.launch = launch  # what the timer is timing (logs, tests)
    return calls_for


def measure(shape: ModelShape, batch: int, device: torch.device, dtype: torch.dtype, timer: Timer,
            spent: Callable[[], bool], step: Callable[[], None], offered: Sequence[Launch | None],
            contexts: Sequence[int] = CONTEXTS, copies: int | None = None) -> AttentionMeasured | None:
    """The batch's `offered` launches (the rule's first), each checked and timed at every
    context (None: the budget ended before the rule's launch and one rival were timed).
    `spent` is asked before each candidate, `step` told after it."""
    cases = [KvCase(shape, batch, context, device, dtype, copies) for context in contexts]
    references = [case.reference() for case in cases]
    times: dict[Launch | None, float] = {}
    rejected = []
    for launch in offered:
        if spent():
            break
        try:
            total = 0.0
            for case, reference in zip(cases, references):
                call = attention_call(case, launch)(case.caches[0])
                call()
                err = rel_err(case.out, reference)
                if not err <= MAX_REL_ERR:
                    raise ValueError(f"relative error {err:.2e} at context {case.context}")
                total += timer(attention_call(case, launch), case.caches)
            times[launch] = total
        except Exception as exc:  # a launch this GPU refuses (shared memory) or a wrong answer
            if launch is None:
                raise
            rejected.append(f"{'.'.join(map(str, launch))}: {exc}".splitlines()[0])
        step()
    if None in times and len(times) > 1 and not spent():
        # The rule's launch again, last: the first launch timed can pay for a GPU not yet at
        # its clocks (identical launches 100.0 and 93.0 µs, first and later, on an H200).
        times[None] = min(times[None], sum(timer(attention_call(case, None), case.caches) for case in cases))
    if None not in times or len(times) < 2:
        return None
    best = min(times, key=lambda k: times[k])
    nbytes = sum(case.nbytes for case in cases)
    del cases
    return AttentionMeasured(batch, times[None], best, times[best], len(times), tuple(rejected), nbytes,
                             tuple(contexts))


def launches_for(results: Sequence[AttentionMeasured], min_gain: float = MIN_GAIN) -> dict[str, Launch]:
    """The table's attention_decode_launches: an entry at each batch measured, the fastest
    launch where it beats the rule's by more than min_gain, else the rule's own launch written
    out (so that a smaller batch's entry does not serve it)."""
    entries: dict[str, Launch] = {}
    for r in sorted(results, key=lambda r: r.batch):
        if r.best is not None and r.best_us * (1 + min_gain) < r.default_us:
            entries[str(r.batch)] = r.best
        else:
            entries[str(r.batch)] = RULE
    return entries if any(launch != RULE for launch in entries.values()) else {}




def sweep(shape: ModelShape, device: torch.device, dtype: torch.dtype, timer: Timer, budget: Any,
          max_candidates: int | None = None) -> tuple[list[AttentionMeasured], list[int]]:
    """(what was measured, the batches the budget left unmeasured) of BATCHES, within the
    sweep's `budget` (sweep.Budget: its candidates added to its total). Off CUDA a smoke of
    one small batch at short contexts: the reference takes no launch."""
    smoke = device.type != "cuda"
    batches, contexts = ((BATCHES[0],), (16, 48)) if smoke else (BATCHES, CONTEXTS)
    offered = candidates(shape.head_dim)[:max_candidates]
    budget.total += len(batches) * len(offered)
    results, skipped = [], []
    for batch in batches:
        if budget.out():
            skipped.append(batch)
            continue
        try:
            measured = measure(shape, batch, device, dtype, timer, budget.out, budget.step, offered, contexts,
                               copies=1 if smoke else None)
        except torch.cuda.OutOfMemoryError as exc:  # its KV copies: the GEMMs' table is kept all the same
            log.warning("attention at %d sequences: no memory for its KV copies (%s): unmeasured", batch,
                        str(exc).splitlines()[0])
            measured = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if measured is None:
            skipped.append(batch)
            continue
        results.append(measured)
        log.debug("attention batch %d: %d of %d launches timed, %.0f s in", batch, measured.timed, len(offered),
                  budget.spent())
    return results, skipped


def print_attention(results: Sequence[Any], bandwidth: float | None = None,
                    out: Callable[[str], None] = print) -> None:
    """The attention rows of a sweep's results: the rule's launch and the best per batch, the
    best against its floor (the KV bytes at `bandwidth`)."""
    rows = sorted((r for r in results if isinstance(r, AttentionMeasured)), key=lambda r: r.batch)
    if not rows:
        return
    contexts = ", ".join(map(str, rows[0].contexts))
    out(f"\n{'attention':15} {'batch':>5}  {'rule us':>8}  {'best launch':>16} {'us':>8} {'rule/best':>9} "
        f"{'floor us':>8} {'best/floor':>10}   [us per launch summed over contexts {contexts}]")
    for r in rows:
        best = ".".join(map(str, r.best)) if r.best else "rule"
        floor = r.nbytes / bandwidth * 1e6 if bandwidth else None
        vs_floor = f"{floor:8.2f} {r.best_us / floor:10.2f}" if floor else f"{'-':>8} {'-':>10}"
        out(f"{'':15} {r.batch:5d}  {r.default_us:8.2f}  {best:>16} {r.best_us:8.2f} {r.default_us / r.best_us:9.3f} "
            f"{vs_floor}")
        for why in r.rejected:
            out(f"{'':16}rejected {why}")
