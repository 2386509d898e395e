"""Churn benchmark: many adapters, Zipf popularity, Poisson arrivals, adapter GPU memory far
smaller than the working set, beside the same traffic with every adapter already resident.

    python -m bench.churn_bench                                # CUDA: Llama-3.2-1B shapes, 1,000 adapters
    python -m bench.churn_bench --model llama-8b-random        # Llama-3.1-8B shapes
    python -m bench.churn_bench --device cpu --model tiny --adapters 40 --requests 40   # a smoke run

A folder of `--adapters` PEFT adapters (random weights, safetensors, ranks cycling through
`--ranks`, on `--targets`) is the node's local adapter directory: its disk tier. Each
alpha's traffic is the same requests (prompts, lengths, Poisson arrival times); only the
adapter each one names changes, drawn from Zipf(alpha) over the adapters in a shuffled order
(popularity is independent of rank).

The working set of an alpha is the rank rows of the distinct adapters its traffic names.
Rows, each on its own engine (built in turn, the same model, KV cache and places in a step):
  resident   adapter memory for every adapter the traffic names, all loaded and pinned before
             timing: every request finds its adapter on the GPU
  lru, gdsf  adapter memory of the `--memory-alpha` working set / `--working-set-ratio` rank
             rows, host memory of `--host-adapters` adapters, the GPU eviction policy named
             (adapters/eviction.py); before each alpha every adapter is unloaded, then
             (`--start warm`, the default) untimed traffic of the same popularity fills the
             tiers as serving would; `--start cold` times every adapter's first load too.
             Before that, every adapter file is flushed and dropped from the OS page cache
             (`--page-cache drop`, the default): the bench wrote them, but a node has read
             from its disk only what it loaded, so a file first read in a row comes from the
             disk and a file read again may come from the page cache, as on a serving node
             (`--page-cache keep`: every file stays cached; on tmpfs files are memory either way)

Columns: throughput (output tokens over the time from the first arrival to the last finish,
and requests/s), TTFT p50/p99/max, the share of requests whose adapter was on the GPU, in
host memory or only on disk when the node first saw them, the share naming an adapter that
no earlier request (the warm-up's included) named ("new": their disk loads are compulsory,
whatever the policy or the host memory), the adapters copied to the GPU and evicted from it
during the row, and the churn rows' throughput and TTFT p50 over the
resident row's at the same alpha (the issue's targets at alpha 1.0: >= 0.8 and <= 2).
Tier shares and GPU copies count the timed traffic only.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import math
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from bench import page_cache
from bench.common import ALL_MODULES, QV, CompileWatch, add_model_args, bench_model, bench_runtime, write_random_adapter
from bench.engine_driver import Driver, Spec, make_specs, parse_range, pct, preload_adapters, zipf_index

log = logging.getLogger("churn_bench")
COMPILES = CompileWatch()
TIERS = ("gpu", "host", "disk")
TARGETS = {"qv": QV, "all": ALL_MODULES}


@dataclass
class Traffic:
    """One alpha's requests: the adapter each names, and its working set."""

    alpha: float
    adapters: list[str]            # per spec
    distinct: list[str]
    working_rows: int              # rank rows per targeted module the distinct adapters hold


@dataclass
class RowResult:
    key: str
    alpha: float
    ratio: float                   # working set / adapter memory (rank rows)
    output_tokens: int = 0
    requests: int = 0
    wall: float = float("nan")
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

    @property
    def req_s(self) -> float:
        return self.requests / self.wall

    def ttft_pct(self, q: float) -> float:
        return pct(self.ttft, q)

    def tier_share(self, tier: str) -> float:
        total = sum(self.tiers.values())
        return self.tiers.get(tier, 0) / total if total else float("nan")


# -- adapters and traffic ------------------------------------------------------------------------------
def adapter_names(n: int) -> list[str]:
    return [f"churn-{k:04d}" for k in range(n)]


def write_adapters(root: Path, cfg, names: list[str], ranks: Sequence[int], targets: Sequence[str],
                   device: torch.device, dtype: torch.dtype) -> dict[str, int]:
    """PEFT adapters into root/<name> (kept where they exist: a --workdir reuses them); their ranks."""
    rank_of = {}
    for k, name in enumerate(names):
        rank_of[name] = ranks[k % len(ranks)]
        if not (root / name / "adapter_model.safetensors").exists():
            write_random_adapter(root / name, cfg, rank_of[name], targets, seed=10_000 + k,
                                 device=device, dtype=dtype)
    return rank_of


def make_traffic(specs: list[Spec], names: list[str], rank_of: dict[str, int], alpha: float,
                 seed: int) -> Traffic:
    order = list(names)
    random.Random(seed).shuffle(order)  # popularity independent of rank
    adapters = [order[zipf_index(spec.pick, len(order), alpha)] for spec in specs]
    distinct = sorted(set(adapters))
    return Traffic(alpha, adapters, distinct, sum(rank_of[n] for n in distinct))


# -- engines ---------------------------------------------------------------------------------------
def engine_args(args) -> argparse.Namespace:
    """What bench.serving_bench.build_engine reads (the node's start-up warm-up runs in it)."""
    return argparse.Namespace(block_size=args.block_size, concurrency=args.concurrency,
                              max_batched_tokens=args.max_batched_tokens,
                              requests=args.requests, prefix_caching=False, warmup="engine",
                              prefill_delay_factor=[])


def arena_row_nbytes(cfg, dtype: torch.dtype, targets: Sequence[str]) -> int:
    """Bytes of one rank row in every arena the targeted modules' fused groups keep (slots.py)."""
    from inference_node.adapters.slots import row_nbytes
    from inference_node.model.llama import FUSED_MODULES

    sizes = row_nbytes(cfg, dtype)
    return sum(sizes[m] for group in FUSED_MODULES.values() if set(group) & set(targets) for m in group)


def build(model, cfg, adapter_root: Path, args, rows: int, max_cpu: int, policy: str,
          max_model_len: int, num_blocks: int, device: torch.device, dtype: torch.dtype):
    """(engine, manager) with `rows` rank rows per module arena."""
    from bench.serving_bench import build_engine
    from inference_node.adapters.manager import AdapterManager
    from inference_node.adapters.slots import SlotBuffers
    from inference_node.adapters.sources import LocalDirSource

    cuda = device.type == "cuda"
    if cuda:
        need, free = rows * arena_row_nbytes(cfg, dtype, TARGETS[args.targets]), torch.cuda.mem_get_info(device)[0]
        if need > 0.9 * free:
            raise RuntimeError(f"{rows} rank rows of adapter memory need {need / 2**30:.1f} GiB, "
                               f"{free / 2**30:.1f} GiB is free: lower --requests, --ranks or --working-set-ratio")
    # Arenas only for the targeted modules' groups (the node's --lora-modules).
    buffers = SlotBuffers(cfg, args.max_loras, max(args.ranks), dtype, device, rows=rows,
                          modules=TARGETS[args.targets])
    source = LocalDirSource(adapter_root, cfg, max(args.ranks), pin_memory=cuda, dtype=dtype)
    manager = AdapterManager(buffers, source, max_cpu, pin_host_memory=cuda, eviction=policy)
    engine = build_engine(model, manager, engine_args(args), max_model_len, num_blocks,
                          args.use_graphs, args.use_mixed)
    return engine, manager


def settle(engine, manager, timeout: float = 600.0) -> None:
    """Runs the engine loop until no adapter fetch or copy is in flight."""
    deadline = time.monotonic() + timeout
    while manager.busy():
        engine.run_once(block=False)
        time.sleep(0.001)
        if time.monotonic() > deadline:
            raise RuntimeError("adapter loads still in flight")


def unload_all(engine, manager) -> None:
    """Every adapter off the node (GPU and host): the next row starts cold, from the disk tier."""
    settle(engine, manager)
    for name in list(manager.current):
        if manager.unload(name):
            raise RuntimeError(f"adapter {name} still has running requests")
    engine.check_consistency()


def drop_page_cache(adapter_root: Path, names: list[str]) -> float | None:
    """Every adapter file flushed and dropped from the OS page cache, so the node's next read
    of it comes from the disk; the share of the largest file's pages still cached after (None
    where the OS cannot be asked: then nothing is known of the drop)."""
    files = [f for name in names for f in sorted((adapter_root / name).iterdir()) if f.is_file()]
    if not all(page_cache.drop(f) for f in files):
        return None
    return page_cache.resident_share(max(files, key=lambda f: f.stat().st_size))


def warm_up_tiers(engine, manager, specs: list[Spec], traffic: Traffic, args, device: torch.device) -> None:
    """Untimed traffic of the same popularity (other draws), closed loop, a few tokens each:
    the row's tiers then hold what a node that has been serving this traffic holds, so the
    timed traffic measures churn, not the compulsory first load of every adapter."""
    adapter_of = {spec.index: name for spec, name in zip(specs, traffic.adapters)}
    Driver(engine, device, args.concurrency, poisson=False).run(
        specs, lambda s: adapter_of[s.index], lambda s: min(4, s.max_tokens))
    settle(engine, manager)


def first_touches(specs: list[Spec], adapter_of: dict[int, str], seen: set[str]) -> int:
    """Requests, in arrival order, naming an adapter that neither `seen` (what earlier traffic
    named) nor an earlier request named: their disk loads are compulsory, whatever the policy
    or the host memory."""
    seen = set(seen)
    count = 0
    for spec in sorted(specs, key=lambda s: (s.arrival, s.index)):
        count += adapter_of[spec.index] not in seen
        seen.add(adapter_of[spec.index])
    return count


def run_row(key: str, engine, manager, specs: list[Spec], traffic: Traffic, ratio: float,
            args, device: torch.device, seen: set[str]) -> RowResult:
    """`seen`: the adapters the row's untimed traffic named before it."""
    result = RowResult(key, traffic.alpha, ratio)
    hits_before = dict(manager.tier_hits)
    stats_before = dict(manager.stats)
    gpu_loads_before = sum(c.loads["gpu"] for c in manager.per_adapter.values())
    adapter_of = {spec.index: name for spec, name in zip(specs, traffic.adapters)}
    result.first_touch = first_touches(specs, adapter_of, seen)
    driver = Driver(engine, device, args.concurrency, poisson=True)
    gc.collect()
    gc.freeze()
    mark = COMPILES.mark()
    try:
        records, _ = driver.run(specs, lambda s: adapter_of[s.index])
    finally:
        gc.unfreeze()
    result.compiles = COMPILES.since(mark)
    for what in result.compiles:
        log.warning("row %s alpha %g: compiled during the timed run: %s", key, traffic.alpha, what[:300])
    result.requests = len(records)
    result.output_tokens = sum(r.tokens for r in records)
    result.wall = max(r.done for r in records) - min(r.submit for r in records)
    result.ttft = [r.first - r.submit for r in records]
    hits = {t: manager.tier_hits.get(t, 0) - hits_before.get(t, 0) for t in manager.tier_hits}
    hits["disk"] = hits.pop("disk", 0) + hits.pop("store", 0)  # a local folder is the disk tier
    result.tiers = hits
    result.gpu_loads = sum(c.loads["gpu"] for c in manager.per_adapter.values()) - gpu_loads_before
    result.gpu_evictions = manager.stats["evictions"] - stats_before["evictions"]
    return result


# -- the table -----------------------------------------------------------------------------------------
HEADER = (f"{'alpha':>5} {'row':<9} {'WS/mem':>6} {'tok/s':>9} {'req/s':>7} {'TTFT p50':>9} {'p99':>9} "
          f"{'max':>9} {'gpu':>6} {'host':>6} {'disk':>6} {'new':>6} {'to GPU':>7} {'evicted':>7} "
          f"{'tput/res':>8} {'p50/res':>8}")
UNITS = (f"{'':>5} {'':<9} {'':>6} {'':>9} {'':>7} {'ms':>9} {'ms':>9} {'ms':>9} {'hit %':>6} "
         f"{'hit %':>6} {'hit %':>6} {'%':>6} {'':>7} {'':>7} {'':>8} {'':>8}")


def format_row(r: RowResult, resident: RowResult | None) -> str:
    if r.error:
        return f"{r.alpha:5.2g} {r.key:<9} FAILED: {r.error}"
    vs_tput = vs_p50 = "-"
    if resident is not None and not resident.error and r is not resident:
        vs_tput = f"{r.tok_s / resident.tok_s:.3f}"
        vs_p50 = f"{r.ttft_pct(50) / resident.ttft_pct(50):.2f}"
    share = [f"{100 * r.tier_share(t):6.1f}" for t in TIERS]
    new = "-" if r.key == "resident" else f"{100 * r.first_touch / r.requests:6.1f}"
    return (f"{r.alpha:5.2g} {r.key:<9} {r.ratio:6.2f} {r.tok_s:9.1f} {r.req_s:7.2f} "
            f"{r.ttft_pct(50) * 1e3:9.1f} {r.ttft_pct(99) * 1e3:9.1f} {max(r.ttft) * 1e3:9.1f} "
            f"{' '.join(share)} {new:>6} {r.gpu_loads:7d} {r.gpu_evictions:7d} {vs_tput:>8} {vs_p50:>8}")


def targets_line(results: list[RowResult]) -> list[str]:
    """The issue's churn targets (working set 4x the adapter memory, alpha 1.0), as measured."""
    lines = []
    for r in results:
        if r.key == "resident" or r.error or not math.isclose(r.alpha, 1.0):
            continue
        res = next((x for x in results if x.key == "resident" and x.alpha == r.alpha and not x.error), None)
        if res is None:
            continue
        t, p = r.tok_s / res.tok_s, r.ttft_pct(50) / res.ttft_pct(50)
        lines.append(f"alpha 1.0 {r.key}: throughput {t:.3f}x resident (target >= 0.8: "
                     f"{'met' if t >= 0.8 else 'NOT met'}), TTFT p50 {p:.2f}x (target <= 2: "
                     f"{'met' if p <= 2 else 'NOT met'}), working set {r.ratio:.2f}x the adapter memory")
    return lines


# -- main --------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--adapters", type=int, default=1000, help="adapters in the node's adapter folder")
    p.add_argument("--ranks", type=lambda t: [int(x) for x in t.split(",")], default=[8, 16, 32, 64],
                   help="adapter k has rank ranks[k mod len]")
    p.add_argument("--targets", choices=sorted(TARGETS), default="qv", help="modules every adapter targets")
    p.add_argument("--alphas", type=lambda t: [float(x) for x in t.split(",")], default=[0.5, 1.0, 1.5])
    p.add_argument("--policies", default="lru,gdsf", help="churn rows: GPU eviction policies")
    p.add_argument("--requests", type=int, help="requests per row (CUDA 600, CPU 60)")
    p.add_argument("--rate", type=float, help="Poisson arrivals per second (CUDA 20, CPU 10)")
    p.add_argument("--prompt-len", help="LO:HI tokens, uniform (CUDA 32:256, CPU 8:32)")
    p.add_argument("--output-len", help="LO:HI tokens, uniform (CUDA 32:128, CPU 4:8)")
    p.add_argument("--concurrency", type=int, help="engine max_num_seqs (CUDA 64, CPU 8)")
    p.add_argument("--max-loras", type=int, help="distinct adapters in one step (default: --concurrency)")
    p.add_argument("--working-set-ratio", type=float, default=4.0,
                   help="the churn rows' adapter memory: the --memory-alpha working set over this")
    p.add_argument("--memory-alpha", type=float, default=1.0)
    p.add_argument("--start", choices=["warm", "cold"], default="warm",
                   help="churn rows: warm (untimed traffic of the same popularity first) or cold")
    p.add_argument("--warmup-requests", type=int, default=0, help="--start warm's requests (0: --requests)")
    p.add_argument("--page-cache", choices=["drop", "keep"], default="drop",
                   help="churn rows: drop every adapter file from the OS page cache before the row "
                        "(drop: a file the node has not read comes from the disk) or keep them cached")
    p.add_argument("--host-adapters", type=int, default=0,
                   help="adapters kept in host memory in the churn rows (0: half the --memory-alpha "
                        "working set's adapters)")
    p.add_argument("--max-batched-tokens", type=int, help="engine token budget per step (CUDA 2048, CPU 256)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--decode-graphs", choices=["auto", "on", "off"], default="auto")
    p.add_argument("--mixed-graphs", choices=["auto", "on", "off"], default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", type=Path, default=None, help="keep the checkpoint and adapters here")
    p.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("-v", "--verbose", action="store_true")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> list[RowResult]:
    args = parse_args(argv)
    device, dtype = bench_runtime(args, log)
    cuda = device.type == "cuda"
    args.requests = args.requests or (600 if cuda else 60)
    args.rate = args.rate or (20.0 if cuda else 10.0)
    args.concurrency = args.concurrency or (64 if cuda else 8)
    args.max_loras = args.max_loras or args.concurrency
    args.max_batched_tokens = args.max_batched_tokens or (2048 if cuda else 256)
    args.prompt_len = parse_range(args.prompt_len or ("32:256" if cuda else "8:32"))
    args.output_len = parse_range(args.output_len or ("32:128" if cuda else "4:8"))
    args.use_graphs = args.decode_graphs == "on" or (args.decode_graphs == "auto" and cuda)
    args.use_mixed = args.mixed_graphs == "on" or (args.mixed_graphs == "auto" and cuda)
    policies = [p for p in args.policies.split(",") if p]
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory(prefix="churn-bench-") as tmp:
        return _run(args, args.workdir or Path(tmp), device, dtype, policies)


def _checkpoint(args, work: Path, device: torch.device, dtype: torch.dtype) -> tuple[Path, str, str]:
    """(checkpoint, load format, description) of --model."""
    bench = bench_model(args.model or ("llama-1b-random" if device.type == "cuda" else "tiny"), work, dtype,
                        device, args.seed)
    return bench.checkpoint, bench.load_format, bench.description


def _run(args, work: Path, device: torch.device, dtype: torch.dtype, policies: list[str]) -> list[RowResult]:
    from inference_node.adapters.slots import row_nbytes
    from inference_node.model.config import ModelConfig
    from inference_node.model.llama import LlamaModel

    COMPILES.install()
    started = time.perf_counter()
    cuda = device.type == "cuda"
    checkpoint, load_format, model_name = _checkpoint(args, work, device, dtype)
    cfg = ModelConfig.from_checkpoint(checkpoint)
    targets = TARGETS[args.targets]
    names = adapter_names(args.adapters)
    # Named by the model's shapes, targets and ranks: a --workdir may serve several models.
    adapter_root = (work / f"adapters-h{cfg.hidden_size}-l{cfg.num_layers}-{args.targets}-"
                    f"{'-'.join(map(str, args.ranks))}-{str(dtype).removeprefix('torch.')}")
    rank_of = write_adapters(adapter_root, cfg, names, args.ranks, targets,
                             device if cuda else torch.device("cpu"), dtype)
    log.info("checkpoint and %d adapters ready in %.1fs", len(names), time.perf_counter() - started)

    max_model_len = args.prompt_len[1] + args.output_len[1] + args.block_size
    per_seq = -(-(max_model_len + 1) // args.block_size)
    num_blocks = args.concurrency * per_seq + args.concurrency + 8
    specs = make_specs(args.requests, args.prompt_len, args.output_len, cfg.vocab_size, args.rate, args.seed)
    traffic = [make_traffic(specs, names, rank_of, alpha, args.seed) for alpha in args.alphas]
    reference = make_traffic(specs, names, rank_of, args.memory_alpha, args.seed)
    warm_specs = make_specs(args.warmup_requests or args.requests, args.prompt_len, args.output_len,
                            cfg.vocab_size, args.rate, args.seed + 1)
    warm_traffic = {t.alpha: make_traffic(warm_specs, names, rank_of, t.alpha, args.seed) for t in traffic}
    churn_rows = max(max(args.ranks), math.ceil(reference.working_rows / args.working_set_ratio))
    host = args.host_adapters or max(1, len(reference.distinct) // 2)
    everyone = sorted({n for t in traffic for n in t.distinct})
    resident_rows = sum(rank_of[n] for n in everyone)
    row_bytes = row_nbytes(cfg, dtype)
    per_row = sum(row_bytes[m] for m in targets)  # a rank row on every targeted module
    arena_row = arena_row_nbytes(cfg, dtype, targets)

    model = LlamaModel.load(checkpoint, device, dtype, max_positions=max_model_len, load_format=load_format)
    header = [
        f"device: {torch.cuda.get_device_name(device) if cuda else 'CPU'}  torch {torch.__version__}  "
        f"dtype {str(dtype).removeprefix('torch.')}",
        f"model: {model_name}: {cfg.num_layers} layers, hidden {cfg.hidden_size}",
        f"adapters: {len(names)} in the node's adapter folder (its disk tier), ranks "
        f"{','.join(map(str, args.ranks))} on {','.join(targets)}; a rank row on them "
        f"{per_row / 1e6:.3f} MB",
        f"traffic: {args.requests} requests, Poisson {args.rate:g}/s, prompt {args.prompt_len[0]}-"
        f"{args.prompt_len[1]}, output {args.output_len[0]}-{args.output_len[1]} tokens (ignore EOS), "
        f"at most {args.concurrency} running, {args.max_loras} adapters a step",
        "working sets (distinct adapters, rank rows, MB): " + "; ".join(
            f"alpha {t.alpha:g}: {len(t.distinct)}, {t.working_rows}, {t.working_rows * per_row / 1e6:.1f}"
            for t in traffic),
        f"adapter memory (rank rows; MB of the targeted modules' rows, MB of the arenas of their "
        f"fused groups): resident {resident_rows} ({resident_rows * per_row / 1e6:.1f}, "
        f"{resident_rows * arena_row / 1e6:.1f}; {len(everyone)} adapters pinned); churn {churn_rows} "
        f"({churn_rows * per_row / 1e6:.1f}, {churn_rows * arena_row / 1e6:.1f}: alpha "
        f"{args.memory_alpha:g}'s working set / {args.working_set_ratio:g}); host memory {host} adapters",
        f"engine: {args.max_batched_tokens} tokens per step, {num_blocks} KV blocks of {args.block_size}, "
        f"decode graphs {'on' if args.use_graphs else 'off'}, piecewise graphs "
        f"{'on' if args.use_mixed else 'off'}, prefix cache off",
        f"adapter folder on {page_cache.filesystem_of(adapter_root)}; before each churn row its files are "
        + ("flushed and dropped from the OS page cache" if args.page_cache == "drop" else "kept in the OS page cache"),
        "start of each churn row: every adapter unloaded, then " + (
            f"{len(warm_specs)} untimed requests of the same popularity (other draws, closed loop, 4 tokens "
            "each): the timed traffic meets the tiers a serving node has" if args.start == "warm" else
            "the timed traffic at once: every adapter's first request loads it from disk"),
    ]
    for line in header:
        print(line, flush=True)

    results: list[RowResult] = []
    # The resident engine's host copies are only a cache of what its arenas hold: keep one.
    engines = [("resident", resident_rows, 1, "lru")]
    engines += [(p, churn_rows, host, p) for p in policies]
    for key, rows, max_cpu, policy in engines:
        engine = manager = None
        try:
            t = time.perf_counter()
            engine, manager = build(model, cfg, adapter_root, args, rows, max_cpu, policy,
                                    max_model_len, num_blocks, device, dtype)
            if key == "resident":
                preload_adapters(engine, manager, everyone)
            log.info("%s engine ready in %.1fs", key, time.perf_counter() - t)
            # Untimed: a few requests through every kind of step, on this engine's adapters.
            warm = specs[:min(len(specs), 2 * args.concurrency)]
            Driver(engine, device, args.concurrency, poisson=False).run(
                warm, lambda s: traffic[0].adapters[s.index], lambda s: min(4, s.max_tokens))
        except Exception as exc:
            log.exception("%s engine failed", key)
            results += [RowResult(key, t.alpha, float("nan"), error=f"{type(exc).__name__}: {exc}"[:200])
                        for t in traffic]
            if manager is not None:
                manager.shutdown()
            engine = manager = None
            gc.collect()
            continue
        for t in traffic:
            ratio = t.working_rows / rows
            try:
                if key != "resident":
                    unload_all(engine, manager)
                    if args.page_cache == "drop":
                        cached = drop_page_cache(adapter_root, names)
                        log.info("row %s alpha %g: page cache dropped; %s of the largest file still cached",
                                 key, t.alpha, "unknown" if cached is None else f"{100 * cached:.0f}%")
                    if args.start == "warm":
                        warm_up_tiers(engine, manager, warm_specs, warm_traffic[t.alpha], args, device)
                seen = set(warm_traffic[t.alpha].adapters) if key != "resident" and args.start == "warm" else set()
                r = run_row(key, engine, manager, specs, t, ratio, args, device, seen)
            except Exception as exc:  # one broken row must not lose the others
                log.exception("row %s alpha %g failed", key, t.alpha)
                r = RowResult(key, t.alpha, ratio, error=f"{type(exc).__name__}: {exc}"[:200])
            results.append(r)
            print(f"# {format_row(r, None)}", file=sys.stderr, flush=True)
        manager.shutdown()
        engine = manager = None
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()

    print(HEADER)
    print(UNITS)
    for t in traffic:
        resident = next((r for r in results if r.key == "resident" and r.alpha == t.alpha), None)
        for r in results:
            if r.alpha == t.alpha:
                print(format_row(r, resident))
    for line in targets_line(results):
        print(line)
    compiled = sum(len(r.compiles) for r in results)
    if compiled:
        print(f"note: {compiled} JIT compiles landed in timed rows (see the log)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"header": header, "rows": [
            {**{k: v for k, v in dataclasses.asdict(r).items() if k not in ("ttft", "compiles")},
             "tok_s": None if r.error else r.tok_s, "ttft_p50": None if r.error else r.ttft_pct(50),
             "ttft_p99": None if r.error else r.ttft_pct(99)} for r in results]}, indent=2))
    return results


if __name__ == "__main__":
    main()
