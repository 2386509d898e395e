"""Adapter benchmarks, one subcommand each (`python -m bench.adapters NAME --help` for more):

    python -m bench.adapters churn     # 1,000 adapters, Zipf popularity, adapter memory a quarter of the working set
    python -m bench.adapters tiers     # the first token with the adapter on the GPU, in host memory or on disk
    python -m bench.adapters fetch     # a 100 MB adapter from S3 through the store into host memory and a slot
    python -m bench.adapters fetch --disk-tier   # the node's disk tier alone

Nodes are built as `inference-node serve` builds them, adapters are random PEFT folders. Files
meant to be read from disk are dropped from the OS page cache first (posix_fadvise DONTNEED; on
tmpfs they are memory either way), and what stayed cached is measured (mincore).
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import hashlib
import json
import logging
import math
import mmap
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from bench.driver import Driver
from bench.harness import (ALL_MODULES, QV, Col, Spec, Table, add_by_device, add_common_args, add_node_args,
                           assign_adapters, bench_model, build_llm, device_line, dtype_name, engine_options, error_text,
                           make_specs, model_config, node_config, parse_range, pct, release_memory, runtime, sync,
                           timed_region, timed_runs, verdict, write_adapters, write_json)

log = logging.getLogger("bench.adapters")
TIERS = ("gpu", "host", "disk")
TARGETS = {"qv": QV, "all": ALL_MODULES}
WEIGHTS_FILE, CONFIG_FILE = "adapter_model.safetensors", "adapter_config.json"
# The adapter benchmarks' nodes: the start-up warm-up on, so the timed traffic compiles nothing.
NODE_OPTIONS = dict(prefix_caching=False, warmup="on")


# -- the OS page cache ------------------------------------------------------------------------------
def drop_cached(path: Path) -> bool:
    """Writes the file's dirty pages back, then asks the kernel to drop its cached pages
    (DONTNEED drops only clean ones). False where the call does not exist."""
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return True


def cached_share(path: Path) -> float | None:
    """The share of the file's pages in the page cache (mincore over a mapping never touched,
    so asking faults nothing in); None where the C library cannot be asked."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        map_file, unmap, mincore = libc.mmap, libc.munmap, libc.mincore
    except (OSError, AttributeError):
        return None
    map_file.restype = ctypes.c_void_p
    map_file.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    unmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    size = path.stat().st_size
    if size == 0:
        return 0.0
    fd = os.open(path, os.O_RDONLY)
    try:
        address = map_file(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address is None or address == ctypes.c_void_p(-1).value:
            return None
        try:
            vector = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
            return sum(v & 1 for v in vector) / len(vector) if mincore(address, size, vector) == 0 else None
        finally:
            unmap(address, size)
    finally:
        os.close(fd)


def drop_all(files: Sequence[Path]) -> float | None:
    """Every file dropped from the page cache; the share of the largest still cached after
    (None where the OS cannot be asked: then nothing is known of the drop)."""
    if not files or not all(drop_cached(f) for f in files):
        return None
    return cached_share(max(files, key=lambda f: f.stat().st_size))


def filesystem_of(path: Path) -> str:
    """The type of the file system holding `path` (its longest mount point), or "unknown"."""
    resolved, best, kind = str(path.resolve()), "", "unknown"
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return kind
    for fields in (line.split() for line in lines):
        mount = fields[1].replace("\\040", " ") if len(fields) > 2 else None
        if mount and (resolved == mount or resolved.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
            best, kind = mount, fields[2]
    return kind


def settle(engine, manager, timeout: float = 600.0) -> None:
    """Runs the engine loop until no adapter fetch or copy is in flight."""
    deadline = time.monotonic() + timeout
    while manager.busy():
        engine.run_once(block=False)
        time.sleep(0.001)
        if time.monotonic() > deadline:
            raise RuntimeError("adapter loads still in flight")


# -- churn -----------------------------------------------------------------------------------------
@dataclass
class Traffic:
    """One alpha's requests, each on its adapter, and their working set."""

    alpha: float
    specs: list[Spec]
    distinct: list[str]
    working_rows: int              # rank rows per targeted module the distinct adapters hold


@dataclass
class ChurnRow:
    key: str
    alpha: float
    ratio: float                   # working set / adapter memory (rank rows)
    output_tokens: int = 0
    requests: int = 0
    wall: float = math.nan
    ttft: list[float] = field(default_factory=list)
    tiers: dict[str, int] = field(default_factory=dict)
    first_touch: int = 0           # requests naming an adapter no earlier request named
    gpu_loads: int = 0
    gpu_evictions: int = 0
    compiles: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall

    def tier_share(self, tier: str) -> float:
        total = sum(self.tiers.values())
        return self.tiers.get(tier, 0) / total if total else math.nan


def adapter_names(n: int) -> list[str]:
    return [f"churn-{k:04d}" for k in range(n)]


def make_traffic(specs: list[Spec], names: list[str], rank_of: dict[str, int], alpha: float, seed: int) -> Traffic:
    order = list(names)
    random.Random(seed).shuffle(order)  # popularity independent of rank
    specs = assign_adapters(specs, order, alpha)
    distinct = sorted({s.adapter for s in specs})
    return Traffic(alpha, specs, distinct, sum(rank_of[n] for n in distinct))


def drop_page_cache(root: Path, names: list[str]) -> float | None:
    """Every file of the named adapters flushed and dropped from the page cache: the node has
    read from its disk only what it loaded, so a file first read in a row comes from the disk."""
    return drop_all([f for name in names for f in sorted((root / name).iterdir()) if f.is_file()])


def first_touches(specs: list[Spec], seen: set[str]) -> int:
    """Requests, in arrival order, naming an adapter neither `seen` (earlier traffic) nor an
    earlier request named: their disk loads are compulsory, whatever the policy."""
    seen, count = set(seen), 0
    for spec in sorted(specs, key=lambda s: (s.arrival, s.index)):
        count += spec.adapter not in seen
        seen.add(spec.adapter)
    return count


def run_churn_row(key: str, llm, traffic: Traffic, ratio: float, args, seen: set[str]) -> ChurnRow:
    """`seen`: the adapters the row's untimed traffic named before it."""
    manager, engine = llm.node.adapters, llm.engine
    result = ChurnRow(key, traffic.alpha, ratio)
    hits, evictions = dict(manager.tier_hits), manager.stats["evictions"]
    gpu_loads = sum(c.loads["gpu"] for c in manager.per_adapter.values())
    result.first_touch = first_touches(traffic.specs, seen)
    with timed_region(f"row {key} alpha {traffic.alpha:g}", log) as result.compiles:
        records, _ = Driver(engine, llm.node.model.device, args.concurrency, poisson=True).run(traffic.specs)
    result.requests, result.output_tokens = len(records), sum(r.tokens for r in records)
    result.wall = max(r.done for r in records) - min(r.submit for r in records)
    result.ttft = [r.first - r.submit for r in records]
    result.tiers = {t: manager.tier_hits.get(t, 0) - hits.get(t, 0) for t in manager.tier_hits}
    result.tiers["disk"] = result.tiers.pop("disk", 0) + result.tiers.pop("store", 0)  # a folder is the disk tier
    result.gpu_loads = sum(c.loads["gpu"] for c in manager.per_adapter.values()) - gpu_loads
    result.gpu_evictions = manager.stats["evictions"] - evictions
    return result


CHURN_TABLE = Table(Col("alpha", 5, ".2g"), Col("row", 9), Col("WS/mem", 6, ".2f"), Col("tok/s", 9, ".1f"),
                    Col("req/s", 7, ".2f"), Col("TTFT p50", 9, ".1f", "ms", 1e3), Col("p99", 9, ".1f", "ms", 1e3),
                    Col("max", 9, ".1f", "ms", 1e3), *(Col(t, 6, ".1f", "hit %", 100) for t in TIERS),
                    Col("new", 6, ".1f", "%", 100), Col("to GPU", 7, "d"), Col("evicted", 7, "d"),
                    Col("tput/res", 8, ".3f"), Col("p50/res", 8, ".2f"))


def churn_line(r: ChurnRow, resident: ChurnRow | None) -> str:
    if r.error:
        return f"{r.alpha:5.2g} {r.key:<9} FAILED: {r.error}"
    vs = resident is not None and r is not resident
    return CHURN_TABLE.row(r.alpha, r.key, r.ratio, r.tok_s, r.requests / r.wall, pct(r.ttft, 50), pct(r.ttft, 99),
                           max(r.ttft), *(r.tier_share(t) for t in TIERS),
                           None if r.key == "resident" else r.first_touch / r.requests, r.gpu_loads, r.gpu_evictions,
                           r.tok_s / resident.tok_s if vs else None,
                           pct(r.ttft, 50) / pct(resident.ttft, 50) if vs else None)


def churn(args) -> list[ChurnRow]:
    """Churn rows: `resident` (adapter memory for every adapter the traffic names, all pinned
    before timing) and one per GPU eviction policy (adapter memory of the --memory-alpha working
    set / --working-set-ratio rank rows, host memory of --host-adapters): before each alpha every
    adapter is unloaded and its files dropped from the page cache, then (--start warm) untimed
    traffic of the same popularity fills the tiers as serving would."""
    from inference_node.adapters.slots import budget_row_nbytes, row_nbytes

    device, dtype = runtime(args)
    args.max_loras = args.max_loras or args.concurrency
    prompt_len, output_len = parse_range(args.prompt_len), parse_range(args.output_len)
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory(prefix="bench-churn-") as tmp:
        work = args.workdir or Path(tmp)
        model = bench_model(args.model, work, dtype, device, args.seed)
        cfg = model_config(args.model)
        targets = TARGETS[args.targets]
        names = adapter_names(args.adapters)
        # Named by the model's shapes, targets and ranks: a --workdir may serve several models.
        root = work / (f"adapters-h{cfg.hidden_size}-l{cfg.num_layers}-{args.targets}-"
                       f"{'-'.join(map(str, args.ranks))}-{dtype_name(dtype)}")
        rank_of = write_adapters(root, cfg, names, args.ranks, targets, device, dtype, seed=10_000)
        specs = make_specs(args.requests, prompt_len, output_len, cfg.vocab_size, args.rate, args.seed)
        traffic = [make_traffic(specs, names, rank_of, alpha, args.seed) for alpha in args.alphas]
        reference = make_traffic(specs, names, rank_of, args.memory_alpha, args.seed)
        warm_specs = make_specs(args.warmup_requests or args.requests, prompt_len, output_len, cfg.vocab_size,
                                args.rate, args.seed + 1)
        warm_traffic = {t.alpha: make_traffic(warm_specs, names, rank_of, t.alpha, args.seed) for t in traffic}
        churn_rows = max(max(args.ranks), math.ceil(reference.working_rows / args.working_set_ratio))
        host = args.host_adapters or max(1, len(reference.distinct) // 2)
        everyone = sorted({n for t in traffic for n in t.distinct})
        resident_rows = sum(rank_of[n] for n in everyone)
        sizes = row_nbytes(cfg, dtype)
        per_row, arena_row = sum(sizes[m] for m in targets), budget_row_nbytes(cfg, dtype, targets)
        options = engine_options(args, prompt_len[1] + output_len[1] + args.block_size, args.concurrency, args.requests,
                                 **NODE_OPTIONS)
        header = [
            device_line(device, dtype),
            f"model: {model.description}: {cfg.num_layers} layers, hidden {cfg.hidden_size}",
            f"adapters: {len(names)} in the node's adapter folder (its disk tier, on {filesystem_of(root)}), ranks "
            f"{','.join(map(str, args.ranks))} on {','.join(targets)}; a rank row on them {per_row / 1e6:.3f} MB",
            f"traffic: {args.requests} requests, Poisson {args.rate:g}/s, prompt {prompt_len[0]}-{prompt_len[1]}, "
            f"output {output_len[0]}-{output_len[1]} tokens (ignore EOS), at most {args.concurrency} running, "
            f"{args.max_loras} adapters a step",
            "working sets (distinct adapters, rank rows, MB): " + "; ".join(
                f"alpha {t.alpha:g}: {len(t.distinct)}, {t.working_rows}, {t.working_rows * per_row / 1e6:.1f}"
                for t in traffic),
            f"adapter memory (rank rows; MB of the targeted modules' rows, of their fused groups' arenas): resident "
            f"{resident_rows} ({resident_rows * per_row / 1e6:.1f}, {resident_rows * arena_row / 1e6:.1f}; "
            f"{len(everyone)} adapters pinned); churn {churn_rows} ({churn_rows * per_row / 1e6:.1f}, "
            f"{churn_rows * arena_row / 1e6:.1f}: alpha {args.memory_alpha:g}'s working set / "
            f"{args.working_set_ratio:g}); host memory {host} adapters",
            f"node: {args.max_batched_tokens} tokens per step, {options['num_kv_blocks']} KV blocks of "
            f"{args.block_size}, decode graphs {args.decode_graphs}, piecewise graphs {args.mixed_graphs}, "
            "prefix cache off",
            "each churn row: every adapter unloaded, its files " + (
                "dropped from the OS page cache" if args.page_cache == "drop" else "kept in the OS page cache")
            + ", then " + (f"{len(warm_specs)} untimed requests of the same popularity (other draws, closed loop, 4 "
                           "tokens each)" if args.start == "warm" else "the timed traffic at once (cold)"),
        ]
        for line in header:
            print(line, flush=True)

        results: list[ChurnRow] = []
        # The resident node's host copies are only a cache of what its memory holds: keep one.
        nodes = [("resident", resident_rows, 1, "lru")]
        nodes += [(p, churn_rows, host, p) for p in args.policies.split(",") if p]
        for key, rows, max_cpu, policy in nodes:
            llm = None
            try:
                if device.type == "cuda" and rows * arena_row > 0.9 * torch.cuda.mem_get_info(device)[0]:
                    raise RuntimeError(f"{rows} rank rows of adapter memory need {rows * arena_row / 2**30:.1f} GiB: "
                                       "lower --requests, --ranks or --working-set-ratio")
                llm = build_llm(node_config(model, device, dtype, adapter_dir=str(root), max_loras=args.max_loras,
                                            max_lora_rank=max(args.ranks), lora_modules=targets,
                                            lora_memory_bytes=rows * arena_row, max_cpu_loras=max_cpu,
                                            adapter_eviction=policy, **options),
                                everyone if key == "resident" else ())
                # Untimed: a few requests through every kind of step, on this node's adapters.
                Driver(llm.engine, device, args.concurrency, poisson=False).run(
                    traffic[0].specs[:2 * args.concurrency], lambda s: min(4, s.max_tokens))
            except Exception as exc:
                log.exception("%s node failed", key)
                results += [ChurnRow(key, t.alpha, math.nan, error=error_text(exc)) for t in traffic]
                if llm is not None:
                    llm.close()
                continue
            manager, engine = llm.node.adapters, llm.engine
            for t in traffic:
                ratio = t.working_rows / rows
                try:
                    if key != "resident":
                        settle(engine, manager)
                        for name in list(manager.current):
                            if manager.unload(name):
                                raise RuntimeError(f"adapter {name} still has running requests")
                        if args.page_cache == "drop":
                            cached = drop_page_cache(root, names)
                            log.info("row %s alpha %g: page cache dropped, %s of the largest file still cached", key,
                                     t.alpha, "unknown" if cached is None else f"{100 * cached:.0f}%")
                        if args.start == "warm":
                            Driver(engine, device, args.concurrency, poisson=False).run(
                                warm_traffic[t.alpha].specs, lambda s: min(4, s.max_tokens))
                            settle(engine, manager)
                    seen = set(warm_traffic[t.alpha].distinct) if key != "resident" and args.start == "warm" else set()
                    r = run_churn_row(key, llm, t, ratio, args, seen)
                except Exception as exc:  # one broken row must not lose the others
                    log.exception("row %s alpha %g failed", key, t.alpha)
                    r = ChurnRow(key, t.alpha, ratio, error=error_text(exc))
                results.append(r)
                print(f"# {churn_line(r, None)}", file=sys.stderr, flush=True)
            llm.close()
            release_memory()

    resident_of = {r.alpha: r for r in results if r.key == "resident" and not r.error}
    CHURN_TABLE.print([churn_line(r, resident_of.get(t.alpha)) for t in traffic for r in results if r.alpha == t.alpha])
    for r in results:  # the targets: working set 4x the adapter memory, alpha 1.0
        res = resident_of.get(r.alpha)
        if r.key != "resident" and not r.error and math.isclose(r.alpha, 1.0) and res is not None:
            tput, p50 = r.tok_s / res.tok_s, pct(r.ttft, 50) / pct(res.ttft, 50)
            print(f"alpha 1.0 {r.key}: throughput {tput:.3f}x resident (target >= 0.8: {verdict(tput, tput >= 0.8)}), "
                  f"TTFT p50 {p50:.2f}x (target <= 2: {verdict(p50, p50 <= 2)}), working set {r.ratio:.2f}x the "
                  "adapter memory")
    compiled = sum(len(r.compiles) for r in results)
    if compiled:
        print(f"note: {compiled} JIT compiles landed in timed rows (see the log)")
    write_json(args.json, {"header": header, "rows": [
        {**{k: v for k, v in dataclasses.asdict(r).items() if k not in ("ttft", "compiles")},
         "tok_s": None if r.error else r.tok_s, "ttft_p50": None if r.error else pct(r.ttft, 50),
         "ttft_p99": None if r.error else pct(r.ttft, 99)} for r in results]})
    return results


# -- tiers ------------------------------------------------------------------------------------------
@dataclass
class Probe:
    tier: str                  # the tier planned for its adapter
    adapter: str
    timed: bool
    submit: float = math.nan
    first: float = math.nan
    done: float = math.nan
    met: str = ""              # the tier the manager counted for its request
    hits: dict[str, int] = field(default_factory=dict)
    load_seconds: float = math.nan                       # its source load (host and disk tiers)
    cached_after_drop: float | None = None               # disk tier: share of pages still cached
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.first - self.submit


class Loop:
    """Runs engine iterations from this thread: the background batch, one probe at a time,
    and the wall time of quiet iterations (each a decode step of the whole batch)."""

    def __init__(self, engine, prompts: list[list[int]], tokens: int, adapter: str, stall_s: float = 300.0) -> None:
        self.engine, self.prompts, self.tokens, self.adapter, self.stall_s = engine, prompts, tokens, adapter, stall_s
        self.background: list = []
        self.streamed: list[int] = []
        self.finished: list[str | None] = []
        self.stopping, self.failure = False, None
        self.steps: list[float] = []           # seconds of quiet decode steps of the whole batch
        self.iterations = self.restarts = 0
        self._previous = (0.0, False)          # (end of the last iteration, it was a quiet full step)

    def _on_background(self, i: int, ev) -> None:
        self.streamed[i] += len(ev.token_ids)
        if ev.finish_reason is not None:
            self.finished[i] = ev.finish_reason
            if not self.stopping and (ev.error is not None or ev.finish_reason == "error"):
                self.failure = f"background request {i} failed: {ev.finish_reason}: {ev.error}"

    def turn(self, quiet: bool = False) -> None:
        before = sum(self.streamed)
        self.engine.run_once(block=False)
        now = time.perf_counter()
        if self.failure:
            raise RuntimeError(self.failure)
        self.iterations += 1
        full = quiet and sum(self.streamed) - before == len(self.background) and self.running()
        if full and self._previous[1]:
            self.steps.append(now - self._previous[0])
        self._previous = (now, full)

    def until(self, done: Callable[[], bool], quiet: bool = False, what: str = "") -> None:
        deadline = time.monotonic() + self.stall_s
        while not done():
            self.turn(quiet)
            if time.monotonic() > deadline:
                raise RuntimeError(f"no end after {self.stall_s:.0f}s waiting for {what}")

    def running(self) -> bool:
        return bool(self.background) and all(r is None for r in self.finished)

    def tokens_left(self) -> int:
        return self.tokens - max(self.streamed, default=self.tokens)

    def start_background(self) -> None:
        from inference_node.engine.request import Request, SamplingParams

        self.restarts += bool(self.background)
        self.stopping = False
        self.background = [Request(list(p), SamplingParams(max_tokens=self.tokens, ignore_eos=True),
                                   emit=lambda ev, i=i: self._on_background(i, ev), adapter=self.adapter,
                                   request_id=f"background-{i}") for i, p in enumerate(self.prompts)]
        self.streamed, self.finished = [0] * len(self.background), [None] * len(self.background)
        for request in self.background:
            self.engine.submit(request)
        # Decoding once each streamed two tokens: its prompt is done and it is in the batch.
        self.until(lambda: min(self.streamed) >= 2, what="the background's prompts")

    def stop_background(self) -> None:
        self.stopping = True
        for request in self.background:
            self.engine.abort(request.id)
        self.until(lambda: all(r is not None for r in self.finished), what="the background to end")

    def probe(self, probe: Probe, prompt: list[int], new_tokens: int, manager) -> None:
        from inference_node.engine.request import Request, SamplingParams

        def on_event(ev) -> None:
            now = time.perf_counter()
            if ev.token_ids and math.isnan(probe.first):
                probe.first = now
            if ev.finish_reason is not None:
                probe.done = now
                if ev.error is not None or ev.finish_reason == "error":
                    probe.error = f"{ev.finish_reason}: {ev.error}"

        request = Request(list(prompt), SamplingParams(max_tokens=new_tokens, ignore_eos=True), emit=on_event,
                          adapter=probe.adapter, request_id=f"probe-{probe.adapter}")
        hits = dict(manager.tier_hits)
        probe.submit = time.perf_counter()
        self.engine.submit(request)
        self.until(lambda: not math.isnan(probe.done), what=f"probe {probe.adapter}")
        probe.met = request.adapter_tier
        probe.hits = {t: n - hits.get(t, 0) for t, n in manager.tier_hits.items() if n != hits.get(t, 0)}
        if not self.running():
            probe.error = probe.error or "the background ended during the probe"


def place(loop: Loop, manager, probe: Probe, files: list[Path]) -> None:
    """The probe's adapter put in its tier, untimed, while the background decodes: gpu (loaded
    into GPU adapter memory), host (fetched into host memory only), disk (nothing of it loaded,
    its files dropped from the page cache; `files`: where the disk tier keeps it, weights last)."""
    if probe.tier == "disk":
        if probe.adapter in manager.current:
            raise RuntimeError(f"{probe.adapter} is already on the node")
        probe.cached_after_drop = drop_all(files)
        return
    outcome: dict = {}
    done = lambda entry, error: outcome.update(entry=entry, error=error)  # noqa: E731
    if probe.tier == "gpu":
        manager.load(probe.adapter, "", False, done)
    else:
        manager.prefetch(probe.adapter, done)
    loop.until(lambda: bool(outcome) and not manager.busy(), what=f"{probe.adapter} into {probe.tier}")
    entry = outcome["entry"]
    if outcome["error"] is not None or entry is None or entry.tier != probe.tier:
        raise RuntimeError(f"{probe.adapter} should be in {probe.tier}, it is in "
                           f"{getattr(entry, 'tier', None)}: {outcome['error']}")


def run_probes(loop: Loop, manager, probes: list[Probe], prompts: list[list[int]],
               files: dict[str, list[Path]], args) -> None:
    """Each probe in turn: the background refreshed if it would end within two probes'
    iterations, the adapter placed, quiet steps, the probe, its adapter unloaded."""
    longest = 0
    for probe, prompt in zip(probes, prompts):
        if loop.tokens_left() < 2 * max(longest, 32):
            loop.stop_background()
            loop.start_background()
        start = loop.iterations
        place(loop, manager, probe, files[probe.adapter])
        for _ in range(args.quiet_steps):
            loop.turn(quiet=not manager.busy())
        loop.probe(probe, prompt, args.new_tokens, manager)
        if probe.tier != "gpu":
            probe.load_seconds = manager.counters(probe.adapter).load_seconds_sum
        if probe.adapter in manager.current and manager.unload(probe.adapter):
            raise RuntimeError(f"{probe.adapter} still has running requests after its probe ended")
        loop.until(lambda: not manager.busy(), what="the unload")
        longest = max(longest, loop.iterations - start)
        if probe.met != probe.tier and probe.error is None:
            probe.error = f"planned {probe.tier}, the manager counted {probe.met!r}"
        log.info("probe %s: TTFT %.2f ms, tier %s%s", probe.adapter, probe.ttft * 1e3, probe.met,
                 f" ({probe.error})" if probe.error else "")


def manifest_of(name: str, rank: int, config: bytes, weights: bytes):
    """The store's manifest of an adapter of these two files."""
    from adapter_store.records import AdapterInfo, FileEntry, Manifest, adapter_digest

    files = tuple(FileEntry(path, len(blob), hashlib.sha256(blob).hexdigest())
                  for path, blob in ((CONFIG_FILE, config), (WEIGHTS_FILE, weights)))
    digest = adapter_digest(f.sha256 for f in files)
    info = AdapterInfo(name, digest[:16], rank=rank, valid=True, size_bytes=len(config) + len(weights),
                       updated_at=int(time.time()))
    return Manifest(info, config.decode(), files, digest)


def fill_disk_tier(root: Path, names: list[str], rank: int, disk_dir: Path) -> dict[str, list[Path]]:
    """The folder's adapters as entries of the node's disk tier of store adapters, each as a
    fetch from the store leaves it; each one's files there that a load reads, weights last."""
    from inference_node.adapters.disk_tier import CHUNKS_FILE, DiskTier

    tier, files = DiskTier(disk_dir, 1 << 40), {}
    for name in names:
        blobs = [(root / name / CONFIG_FILE).read_bytes(), (root / name / WEIGHTS_FILE).read_bytes()]
        manifest = manifest_of(name, rank, *blobs)
        if tier.lookup(name, manifest.info.version) is None and not tier.put(manifest, blobs):
            raise RuntimeError(f"the disk tier did not keep {name}")
        digest = manifest.adapter_sha256
        files[name] = [disk_dir / digest / CHUNKS_FILE] + [disk_dir / digest / str(i) for i in range(len(blobs))]
    tier.close()  # the node's own tier takes the folder next
    return files


TIER_TABLE = Table(Col("tier", 5), Col("probes", 6, "d"), Col("TTFT p50", 9, ".2f", "ms", 1e3),
                   Col("max", 8, ".2f", "ms", 1e3), Col("-gpu p50", 9, ".2f", "ms", 1e3), Col("steps", 6, ".2f"),
                   Col("adapter", 8, ".2f", "MB"), Col("load p50", 9, ".1f", "ms", 1e3),
                   Col("cached", 7, ".0f", "%", 100))


def tiers(args) -> dict:
    """The first token of a probe whose adapter is on the GPU, only in host memory or only on
    the node's disk, one at a time (tiers interleaved, after one untimed probe each) while
    --background requests decode; TTFT is submit to first streamed token. Each probe's tier is
    the manager's own account; a probe that met another tier fails the run. `--disk folder`:
    the disk tier is --adapter-dir (a load reads, hashes and validates the files); `--disk
    disk-tier`: entries of the node's disk tier of store adapters, the store refusing
    connections (a load is refused at once and reads the verified disk copy). "One decode step"
    is the p50 of quiet loop iterations (no probe or adapter work in flight) in the same run.
    Targets (issue 32, Llama-3.1-8B shapes): host - gpu <= one decode step; disk - host <= 50 ms."""
    device, dtype = runtime(args)
    if args.background < 1:
        raise SystemExit("--background must be at least 1: its decode step is the yardstick")
    torch.manual_seed(args.seed)
    # Each load from the disk tier says the store is unreachable: expected here, so quiet for
    # this run (the level is put back for whatever else runs in this process).
    store_log = logging.getLogger("inference_node.adapters.store_source")
    level = store_log.level
    if not args.verbose:
        store_log.setLevel(logging.ERROR)
    refuser = socket.socket()
    try:
        with tempfile.TemporaryDirectory(prefix="bench-tiers-") as tmp:
            return _tiers(args, args.workdir or Path(tmp), device, dtype, refuser)
    finally:
        store_log.setLevel(level)
        refuser.close()


def _tiers(args, work: Path, device: torch.device, dtype: torch.dtype, refuser: socket.socket) -> dict:
    model = bench_model(args.model, work, dtype, device, args.seed)
    cfg = model_config(args.model)
    targets = TARGETS[args.targets]
    probes = [Probe(tier, f"tier-warm-{tier}", False) for tier in TIERS]
    probes += [Probe(tier, f"tier-{tier}-{k:03d}", True) for k in range(args.probes) for tier in TIERS]
    background_adapter = "tier-background" if args.background_adapter else ""
    names = [p.adapter for p in probes] + ([background_adapter] if background_adapter else [])
    root = work / f"tier-adapters-h{cfg.hidden_size}-l{cfg.num_layers}-{args.targets}-r{args.rank}-{dtype_name(dtype)}"
    write_adapters(root, cfg, names, [args.rank], targets, device, dtype)
    sizes = {tier: (root / f"tier-warm-{tier}" / WEIGHTS_FILE).stat().st_size / 1e6 for tier in TIERS}
    if args.disk == "folder":
        files = {n: [root / n / CONFIG_FILE, root / n / WEIGHTS_FILE] for n in names}
        source = dict(adapter_dir=str(root))
        disk_line = "the node's adapter folder (serve --adapter-dir)"
    else:
        disk_dir = root.with_name(root.name + "-disk-tier")
        files = fill_disk_tier(root, names, args.rank, disk_dir)
        refuser.bind(("127.0.0.1", 0))  # and never listening: connecting to it is refused
        source = dict(adapter_store=f"127.0.0.1:{refuser.getsockname()[1]}", adapter_disk_dir=str(disk_dir))
        disk_line = "the node's disk tier of store adapters, the store refusing connections"
    seqs = args.background + 1
    options = engine_options(args, args.prompt_len + args.background_tokens + args.block_size, seqs, seqs,
                             **NODE_OPTIONS)
    # Adapter memory for a few adapters (the background's, one probe's, spare), host memory for as many.
    llm = build_llm(node_config(model, device, dtype, max_loras=4, max_lora_rank=args.rank, max_cpu_loras=4,
                                **source, **options), [background_adapter] if background_adapter else [])
    manager = llm.node.adapters
    specs = make_specs(args.background + len(probes), (args.prompt_len,) * 2, (args.new_tokens,) * 2, cfg.vocab_size,
                       None, args.seed)
    header = [
        device_line(device, dtype), f"model: {model.description}: {cfg.num_layers} layers, hidden {cfg.hidden_size}",
        f"adapters: one fresh adapter per probe, rank {args.rank} on {','.join(targets)}, {sizes['gpu']:.2f} MB each; "
        f"disk tier: {disk_line}, on {filesystem_of(files[names[0]][-1])}",
        f"background: {args.background} requests of {args.prompt_len} prompt tokens on "
        f"{background_adapter or 'the base model'}, restarted before {args.background_tokens} tokens",
        f"probes: {args.probes} timed per tier (after one untimed), {args.prompt_len} prompt tokens, {args.new_tokens} "
        f"new, one at a time after {args.quiet_steps} quiet steps; 'cached': the share of the disk probe's pages still "
        "cached after the drop",
    ]
    for line in header:
        print(line, flush=True)
    loop = Loop(llm.engine, [s.prompt for s in specs[:args.background]], args.background_tokens, background_adapter)
    prompts = [s.prompt for s in specs[args.background:]]
    try:
        loop.start_background()
        run_probes(loop, manager, probes[:len(TIERS)], prompts, files, args)
        with timed_region("the timed probes", log) as compiles:
            run_probes(loop, manager, probes[len(TIERS):], prompts[len(TIERS):], files, args)
        loop.stop_background()
        sync(device)
        llm.engine.check_consistency()
    finally:
        llm.close()

    step = pct(loop.steps, 50)
    rows = []
    for tier in TIERS:
        timed = [p for p in probes if p.timed and p.tier == tier and p.error is None]
        cached = [p.cached_after_drop for p in timed if p.cached_after_drop is not None]
        loads = [p.load_seconds for p in timed if not math.isnan(p.load_seconds)]
        rows.append({"tier": tier, "ttft": [p.ttft for p in timed], "p50": pct([p.ttft for p in timed], 50),
                     "adapter_mb": sizes[tier], "load_p50": pct(loads, 50),
                     "cached_after_drop": max(cached, default=None)})
    gpu = rows[0]["p50"]
    print(f"one decode step (the background's, {len(loop.steps)} quiet steps): p50 {step * 1e3:.2f} ms, "
          f"p90 {pct(loop.steps, 90) * 1e3:.2f} ms")
    TIER_TABLE.print([f"{r['tier']:<5} {0:>6} no probe of this tier ended well" if not r["ttft"] else
                      TIER_TABLE.row(r["tier"], len(r["ttft"]), r["p50"], max(r["ttft"]), r["p50"] - gpu,
                                     (r["p50"] - gpu) / step, r["adapter_mb"], r["load_p50"], r["cached_after_drop"])
                      for r in rows])
    host_gpu, disk_host = rows[1]["p50"] - gpu, rows[2]["p50"] - rows[1]["p50"]
    targets_met = [f"target host - gpu <= one decode step: {host_gpu * 1e3:.2f} ms vs {step * 1e3:.2f} ms: "
                   f"{verdict(host_gpu, host_gpu <= step)}",
                   f"target disk - host <= 50 ms: {disk_host * 1e3:.2f} ms: {verdict(disk_host, disk_host <= 0.05)}"]
    failed = [p for p in probes if p.error]
    for line in targets_met + [f"probe {p.adapter} FAILED: {p.error}" for p in failed]:
        print(line)
    if compiles:
        print(f"note: {len(compiles)} JIT compiles landed among the timed probes (listed in the log)")
    result = {"header": header, "decode_step_p50": step, "decode_steps": len(loop.steps),
              "background_restarts": loop.restarts, "rows": rows,
              "probes": [{**dataclasses.asdict(p), "ttft": p.ttft} for p in probes],
              "targets": targets_met, "compiles": len(compiles), "ok": not failed}
    write_json(args.json, result)
    return result


# -- fetch ---------------------------------------------------------------------------------------------
BUCKET, NAME, FETCH_RANK = "bench-adapters", "bench-100mb", 64


def store_child(args) -> None:
    """The store, in a process of its own (no GIL shared with the node's side): commands on
    stdin ('clear', 'settle', 'quit'), replies on stdout."""
    from adapter_store.read_plans import DirectReads
    from adapter_store.server import BackgroundStore, StoreSettings
    from lora_common.malloc import keep_freed_buffers

    logging.basicConfig(level=logging.WARNING)
    keep_freed_buffers()  # as `adapter-store serve` does
    store = BackgroundStore(StoreSettings(bucket=BUCKET, s3_endpoint=args.endpoint, cache_dir=args.cache_dir, port=0,
                                          poll_interval_s=60, shard_bytes=args.shard_kb << 10,
                                          direct_reads=DirectReads(enabled=True)))
    print(json.dumps({"address": store.address}), flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "quit":
            break
        store.cache.wait_idle(60)  # the last download is stored (fsynced) after its stream ends
        if command == "clear":
            store.cache.clear()
        print(json.dumps({command: True}), flush=True)
    store.stop()


class StoreProcess:
    def __init__(self, server, cache_dir: Path, shard_kb: int) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.adapters", "fetch", "--child", "--endpoint",
                                      server.endpoint_url, "--cache-dir", str(cache_dir), "--shard-kb", str(shard_kb)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, **server.env()})
        self.address = self.command(None)["address"]

    def command(self, command: str | None) -> dict:
        """'clear': the store's disk cache emptied (the next fetch downloads from S3); 'settle':
        its last download stored, so it does not compete."""
        if command is not None:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the store process exited")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.write("quit\n")
        self.proc.stdin.flush()
        self.proc.wait(30)


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(run: Callable[[], int], runs: int, pids: Sequence[int] = (), before: Callable | None = None) -> dict:
    """MB/s (10^6 bytes/s) median and best over `runs` runs, and the CPU ms each process spent
    per run (this one first): on a shared machine the CPU columns stay put where rates do not."""
    rates, cpu, size = [], [], [0]

    def once() -> None:
        start = [time.process_time()] + [process_cpu_s(p) for p in pids]
        started = time.perf_counter()
        size[0] = run()
        rates.append(size[0] / (time.perf_counter() - started) / 1e6)
        cpu.append([(b - a) * 1e3 for a, b in zip(start, [time.process_time()] + [process_cpu_s(p) for p in pids])])

    timed_runs(once, runs, before)
    return {"median": statistics.median(rates), "best": max(rates), "size": size[0],
            "cpu_ms": [statistics.median(c) for c in zip(*cpu)]}


def fetch(args) -> list[tuple[str, dict]]:
    """An --mb adapter from S3 (an embedded SeaweedFS) through the store (a child process) into
    the node's host memory and a slot, on loopback, next to boto3 and bare gRPC, each received
    as the node receives it (one host buffer sized from the manifest, page-locked on CUDA, every
    file checked); `--disk-tier`: only DiskTier.read, cold and warm, per --read-threads count.
    Targets (issue 32): cold >= 1 GB/s or boto3's median / 1.5; warm >= 1 GB/s."""
    if args.child:
        return store_child(args) or []
    if args.threads:
        torch.set_num_threads(args.threads)
    from lora_common.malloc import keep_freed_buffers

    keep_freed_buffers()  # as the node's engine core process does
    rows = fetch_disk_tier(args) if args.disk_tier else fetch_store(args)
    table = Table(Col("path", max(len(label) for label, _ in rows)), Col("MB", 6, ".1f", scale=1e-6),
                  Col("median MB/s", 11, ".1f"), Col("best MB/s", 9, ".1f"), Col("CPU ms: node", 12, ".0f"),
                  Col("store", 5, ".0f"), Col("S3", 5, ".0f"))
    print(f"\nmedian and best of {args.runs} runs; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; "
          f"torch threads {torch.get_num_threads()}; host memory "
          f"{'page-locked' if torch.cuda.is_available() else 'pageable'}")
    table.print([(label, r["size"], r["median"], r["best"], *r["cpu_ms"]) for label, r in rows])
    if not args.disk_tier:
        boto3 = rows[0][1]["median"]
        print(f"targets (issue 32): cold >= {min(1000.0, boto3 / 1.5):.0f} MB/s (1 GB/s, or boto3's median / 1.5 if "
              "lower; streamed or by direct reads); warm >= 1000 MB/s")
    write_json(args.json, dict(rows))
    return rows


def fetch_disk_tier(args) -> list[tuple[str, dict]]:
    """DiskTier.read of an --mb adapter DiskTier.put wrote (under --workdir: put it on the disk
    to measure) into one reused host buffer: cold (pages dropped) and warm, checked against
    its chunk digests, and cold as an entry an older node wrote (no chunk digests: every file
    checked whole against the manifest's sha256)."""
    from adapter_store.records import file_offsets
    from inference_node.adapters.disk_tier import CHUNKS_FILE, DiskTier
    from inference_node.adapters.sources import host_buffer

    weights, config = os.urandom(int(args.mb * 1e6)), b'{"r": 16}'
    manifest = manifest_of(NAME, 16, config, weights)
    buffer = host_buffer(file_offsets(manifest)[-1] + len(weights), torch.cuda.is_available()).numpy()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-disk-tier-", dir=args.workdir) as tmp:
        root = Path(tmp)
        writer = DiskTier(root, 1 << 40)
        writer.put(manifest, [config, weights])
        writer.close()  # one tier a folder: each reader count's below opens it again
        folder = root / manifest.adapter_sha256
        paths = [folder / str(i) for i in range(len(manifest.files))]
        recorded = (folder / CHUNKS_FILE).read_bytes()
        print(f"DiskTier.read of {(len(config) + len(weights)) / 1e6:.1f} MB on {filesystem_of(root)}")
        for threads in args.read_threads:
            tier = DiskTier(root, 1 << 40, read_threads=threads)
            entry = tier.lookup(NAME)

            def read() -> int:
                tier.read(entry, lambda n: buffer[:n])
                return len(config) + len(weights)

            def as_older_entry() -> None:
                tier.flush()  # the last read's chunk digests are written, then taken away
                (folder / CHUNKS_FILE).unlink(missing_ok=True)
                drop_all(paths)

            rows.append((f"{threads:>2} readers, cold (page cache dropped)",
                         measure(read, args.runs, (), lambda: drop_all(paths))))
            rows.append((f"{threads:>2} readers, warm (page cache)", measure(read, args.runs)))
            rows.append((f"{threads:>2} readers, cold, older entry (whole-file sha256)",
                         measure(read, args.runs, (), as_older_entry)))
            tier.close()  # it wrote the chunk digests again: the same record
            if (folder / CHUNKS_FILE).read_bytes() != recorded:
                raise RuntimeError("the disk tier rewrote other chunk digests than put wrote")
    return rows


def fetch_store(args) -> list[tuple[str, dict]]:
    from safetensors import safe_open

    from adapter_store.client import AdapterStoreClient
    from adapter_store.push import push_adapter
    from adapter_store.records import file_offsets
    from adapter_store.s3 import S3Store
    from adapter_store.samples import sized_adapter
    from adapter_store.seaweedfs import SeaweedFS
    from inference_node.adapters.direct_reads import DirectReader, DirectReadSettings
    from inference_node.adapters.disk_tier import DiskTier
    from inference_node.adapters.slots import SlotBuffers
    from inference_node.adapters.sources import host_buffer
    from inference_node.adapters.store_source import StoreSource
    from inference_node.model.config import ModelConfig

    cuda = torch.cuda.is_available()
    with tempfile.TemporaryDirectory(prefix="bench-fetch-") as tmp, SeaweedFS(Path(tmp) / "seaweedfs") as server:
        server.create_bucket(BUCKET)
        folder = sized_adapter(Path(tmp) / NAME, args.mb, rank=FETCH_RANK)
        s3 = server.boto3_client()
        push_adapter(folder, NAME, S3Store(BUCKET, s3), "adapters/", progress=False,
                     **({"multipart_bytes": 1 << 40} if args.single_part else {}))
        key = f"adapters/{NAME}/{WEIGHTS_FILE}"
        weights_mb = (folder / WEIGHTS_FILE).stat().st_size / 1e6
        with safe_open(str(folder / WEIGHTS_FILE), "np") as tensors:  # ...layers.{i}...: a base model it fits
            layers = 1 + max(int(k.split(".")[4]) for k in tensors.keys())
        model = ModelConfig.from_dict({"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 8192,
                                       "num_hidden_layers": layers, "num_attention_heads": 32,
                                       "num_key_value_heads": 8})

        store = StoreProcess(server, Path(tmp) / "cache", args.shard_kb)
        pids = [store.proc.pid, server.process.pid]
        try:
            with AdapterStoreClient(store.address) as client:
                manifest = client.get_manifest(NAME)
                total = sum(f.size for f in manifest.files)
                reused = host_buffer(file_offsets(manifest)[-1] + manifest.files[-1].size, cuda)
                reader = DirectReader()
                sources = {"streamed": StoreSource(store.address, model, FETCH_RANK, pin_memory=cuda),
                           "direct": StoreSource(store.address, model, FETCH_RANK, pin_memory=cuda,
                                                 direct_reads=DirectReadSettings()),
                           "disk": StoreSource(store.address, model, FETCH_RANK, pin_memory=cuda,
                                               disk=DiskTier(Path(tmp) / "node-disk", 8 << 30))}
                sources["disk"].load(NAME, "")
                sources["disk"].disk.flush()
                loaded = {}

                def fetched_bytes(fetched) -> int:
                    return sum(len(b) for b in fetched.files.values())

                def node_load(source) -> Callable[[], int]:
                    return lambda: loaded.update(weights=source.load(NAME, "")) or total

                buffers = SlotBuffers(model, 1, FETCH_RANK, torch.float32, torch.device("cuda" if cuda else "cpu"))

                def to_slot() -> int:
                    buffers.free(0)  # its rows again: the copy is what is measured
                    assert buffers.place(0, buffers.ranks_of(loaded["weights"]))
                    event = buffers.write(0, loaded["weights"])
                    if event is not None:
                        event.synchronize()
                    return loaded["weights"].nbytes

                fresh = lambda n: host_buffer(n, cuda).numpy()  # noqa: E731
                clear = lambda: store.command("clear")  # noqa: E731
                runs = args.runs
                rows = [
                    ("boto3 get_object (one stream)",
                     measure(lambda: len(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()), runs, pids)),
                    ("store -> node cold (S3 -> store -> node host memory)",
                     measure(lambda: fetched_bytes(client.fetch(NAME, deadline_s=600, allocate=fresh)), runs, pids,
                             clear)),
                    ("store -> node cold, direct reads (read plan, S3 -> node host memory)",
                     measure(lambda: fetched_bytes(reader.read(client.get_read_plan(NAME), fresh)), runs, pids, clear)),
                    ("node load, direct reads (+ validation, views)",
                     measure(node_load(sources["direct"]), runs, pids)),
                ]
                store.command("settle")
                rows += [
                    ("store -> node warm (store disk cache -> node host memory)",
                     measure(lambda: fetched_bytes(client.fetch(NAME, deadline_s=600, allocate=fresh)), runs, pids)),
                    ("store -> node warm, into one reused host buffer", measure(lambda: fetched_bytes(client.fetch(
                        NAME, deadline_s=600, allocate=lambda n: reused[:n].numpy())), runs, pids)),
                    ("node load from the store, warm (+ validation, views)",
                     measure(node_load(sources["streamed"]), runs, pids)),
                    ("node load from its disk tier (sha256-verified, header checked)",
                     measure(node_load(sources["disk"]), runs, pids)),
                    (f"host -> slot copy ({'CUDA, pinned' if cuda else 'CPU slot buffers'})",
                     measure(to_slot, runs, pids)),
                ]
                for source in sources.values():
                    source.close()
                reader.close()
        finally:
            store.close()
    print(f"\nadapter: {weights_mb:.1f} MB safetensors "
          f"({'one PUT' if args.single_part else 'multipart'}); shards of {args.shard_kb} KiB; SeaweedFS and store on "
          "loopback; CPU: this process (the node), the store, SeaweedFS")
    return rows


# -- main ---------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    from inference_node.adapters.disk_tier import READ_THREADS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    def node_args(q: argparse.ArgumentParser) -> None:
        add_common_args(q, ("llama-1b-random", "tiny"))
        add_node_args(q)
        q.add_argument("--targets", choices=sorted(TARGETS), help="modules every adapter targets")

    c = sub.add_parser("churn", help=churn.__doc__.split(":")[0], description=churn.__doc__)
    node_args(c)
    c.set_defaults(targets="qv")
    c.add_argument("--adapters", type=int, default=1000, help="adapters in the node's adapter folder")
    c.add_argument("--ranks", type=lambda t: [int(x) for x in t.split(",")], default=[8, 16, 32, 64],
                   help="adapter k has rank ranks[k mod len]")
    c.add_argument("--alphas", type=lambda t: [float(x) for x in t.split(",")], default=[0.5, 1.0, 1.5])
    c.add_argument("--policies", default="lru,gdsf", help="churn rows: GPU eviction policies")
    add_by_device(c, "--requests", 600, 60, "requests per row", type=int)
    add_by_device(c, "--rate", 20, 10, "Poisson arrivals per second", type=float)
    add_by_device(c, "--prompt-len", "32:256", "8:32", "LO:HI tokens, uniform")
    add_by_device(c, "--output-len", "32:128", "4:8", "LO:HI tokens, uniform")
    add_by_device(c, "--concurrency", 64, 8, "max_num_seqs", type=int)
    c.add_argument("--max-loras", type=int, help="distinct adapters in one step (default: --concurrency)")
    c.add_argument("--working-set-ratio", type=float, default=4.0,
                   help="the churn rows' adapter memory: the --memory-alpha working set over this")
    c.add_argument("--memory-alpha", type=float, default=1.0)
    c.add_argument("--start", choices=["warm", "cold"], default="warm",
                   help="churn rows: untimed traffic of the same popularity first, or every first load timed")
    c.add_argument("--warmup-requests", type=int, default=0, help="--start warm's requests (0: --requests)")
    c.add_argument("--page-cache", choices=["drop", "keep"], default="drop",
                   help="churn rows: drop every adapter file from the OS page cache before each, or keep them")
    c.add_argument("--host-adapters", type=int, default=0,
                   help="adapters in host memory in the churn rows (0: half the --memory-alpha working set's)")
    c.set_defaults(run=churn)

    t = sub.add_parser("tiers", help=tiers.__doc__.split(",")[0], description=tiers.__doc__)
    node_args(t)
    t.set_defaults(targets="all", run=tiers)
    t.add_argument("--rank", type=int, default=16)
    t.add_argument("--disk", choices=["folder", "disk-tier"], default="folder",
                   help="the disk tier: the --adapter-dir folder, or the node's disk tier of store adapters")
    add_by_device(t, "--background", 32, 4, "requests decoding throughout", type=int)
    add_by_device(t, "--background-tokens", 1024, 256, "a background request's length before it restarts", type=int)
    t.add_argument("--background-adapter", action="store_true", help="the background on one pinned adapter")
    add_by_device(t, "--probes", 8, 2, "timed probes per tier", type=int)
    add_by_device(t, "--prompt-len", 128, 16, "a probe's and the background's prompt tokens", type=int)
    t.add_argument("--new-tokens", type=int, default=4, help="tokens a probe generates")
    t.add_argument("--quiet-steps", type=int, default=6, help="quiet loop iterations before each probe")

    f = sub.add_parser("fetch", help=fetch.__doc__.split(",")[0], description=fetch.__doc__)
    f.set_defaults(run=fetch)
    f.add_argument("--mb", type=float, default=100.0, help="adapter size in MB")
    f.add_argument("--runs", type=int, default=3)
    f.add_argument("--shard-kb", type=int, default=4096, help="the store's shard size")
    f.add_argument("--single-part", action="store_true", help="the weights in one PUT (an MD5 ETag)")
    f.add_argument("--threads", type=int, default=0, help="torch threads in this process (0: torch's default)")
    f.add_argument("--disk-tier", action="store_true", help="only the node's disk tier (no store, no S3)")
    f.add_argument("--read-threads", type=lambda s: [int(x) for x in s.split(",")], default=[READ_THREADS],
                   help=f"--disk-tier: comma-separated reader thread counts (default {READ_THREADS})")
    f.add_argument("--workdir", type=Path, default=None, help="--disk-tier: where the tier's files go")
    f.add_argument("--json", type=Path, default=None)
    f.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    f.add_argument("--endpoint", help=argparse.SUPPRESS)
    f.add_argument("--cache-dir", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None):
    args = parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    result = main()
    sys.exit(0 if not isinstance(result, dict) or result.get("ok", True) else 1)
