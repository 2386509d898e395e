"""Adapter tier benchmark: the first token of a request whose adapter is on the GPU, only in
host memory, or only on the node's disk, while a batch of other requests decodes.

    python -m bench.tier_bench                                 # CUDA: Llama-3.2-1B shapes
    python -m bench.tier_bench --model llama-8b-random         # the issue's shape
    python -m bench.tier_bench --device cpu --model tiny       # a smoke run

Every probe has a fresh random PEFT adapter (rank --rank on --targets). The node is built as
`inference-node serve` builds it (NodeConfig, open_disk_tier, build_adapter_manager), its disk tier one of:
  --disk folder     `--adapter-dir`: the adapter folder is the disk tier. A load reads the
                    files, hashes them for the version and validates them, scanning every
                    weight for NaN, Inf and the weight bound.
  --disk disk-tier  `--adapter-store ... --adapter-disk-dir`: the adapters are entries of the
                    node's disk tier of store adapters (adapters/disk_tier.py, as a fetch from
                    the store leaves them), and the store refuses connections (a bound port
                    that never listens). A load asks the store for the current version, is
                    refused at once and, as a node does while its store is down, reads the
                    disk copy, verified against its sha256, validated without the value scan
                    (it passed it before it was written). A reachable store adds that one
                    round trip.
`--background` long requests (the base model, or one pinned adapter with
--background-adapter) keep every step a decode step of that batch. "One decode step" is the
p50 of the loop's wall time per iteration over quiet stretches (no probe and no adapter work
in flight; every background request streamed a token in it and in the one before),
measured in the same run.

Probes go one at a time, the tiers interleaved (gpu, host, disk, gpu, ...), after one
untimed probe of each tier. Before each, untimed, while the background decodes:
  gpu   its adapter loaded onto the GPU (AdapterManager.load)
  host  its adapter fetched into host memory only, none of it on the GPU (AdapterManager.prefetch)
  disk  nothing of it loaded; its files flushed and dropped from the OS page cache
        (posix_fadvise DONTNEED), so the probe reads them from the disk
then --quiet-steps quiet loop iterations, then the probe: a --prompt-len prompt and
--new-tokens tokens. TTFT is submit to first streamed token, as bench/engine_driver.py takes
it. Each probe's tier is the manager's own account (its tier hit counts, the request's
adapter_tier); a probe that met another tier than planned fails the run. After a probe its
adapter is unloaded, so every probe starts from the same node state; the background is
restarted between probes when it nears its end, so it never ends during one.

Columns: tier, probes, TTFT p50 and max, p50 minus the gpu tier's p50 (ms and in decode
steps), the adapter's size (its safetensors file), the source load p50 (read, hash and
validation into host memory: inside the disk tier's TTFT, untimed for the host tier), and
for the disk tier the share of its files' pages still cached after the drop.
Targets (issue 32, H100, Llama-3.1-8B shapes): host - gpu <= one decode step;
disk - host <= 50 ms.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import socket
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from bench import page_cache
from bench.churn_bench import TARGETS, engine_args, write_adapters
from bench.common import CompileWatch, add_model_args, bench_model, bench_runtime
from bench.engine_driver import make_specs, pct, sync

log = logging.getLogger("tier_bench")
COMPILES = CompileWatch()
TIERS = ("gpu", "host", "disk")
WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"


@dataclass
class Probe:
    tier: str                  # the tier planned for its adapter
    adapter: str
    timed: bool
    submit: float = float("nan")
    first: float = float("nan")
    done: float = float("nan")
    met: str = ""              # the tier the manager counted for its request
    hits: dict[str, int] = field(default_factory=dict)   # the manager's tier hits during it
    load_seconds: float = float("nan")                   # its source load (host and disk tiers)
    cached_after_drop: float | None = None               # disk tier: share of pages still cached
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.first - self.submit


@dataclass
class TierRow:
    tier: str
    ttft: list[float]
    adapter_mb: float
    load_p50: float
    cached_after_drop: float | None

    @property
    def p50(self) -> float:
        return pct(self.ttft, 50)


# -- the engine loop, driven from this thread ------------------------------------------------------
class Loop:
    """Runs engine iterations from this thread: the background batch, one probe at a time,
    and the wall time of quiet iterations (each a decode step of the whole batch)."""

    def __init__(self, engine, prompts: list[list[int]], tokens: int, adapter: str,
                 stall_seconds: float = 300.0) -> None:
        from inference_node.engine.request import Request, SamplingParams

        self.engine = engine
        self._make = lambda i, prompt: Request(  # noqa: E731
            list(prompt), SamplingParams(max_tokens=tokens, ignore_eos=True),
            emit=lambda ev, i=i: self._on_background(i, ev), adapter=adapter, request_id=f"background-{i}")
        self.prompts, self.tokens, self.stall_seconds = prompts, tokens, stall_seconds
        self.background: list = []
        self.streamed: list[int] = []
        self.finished: list[str | None] = []   # finish reason of each background request
        self.stopping = False
        self.failure: str | None = None        # a background request that failed
        self.steps: list[float] = []           # seconds of quiet decode steps of the whole batch
        self.iterations = 0
        self.restarts = 0                      # background batches started after the first
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
        deadline = time.monotonic() + self.stall_seconds
        while not done():
            self.turn(quiet)
            if time.monotonic() > deadline:
                raise RuntimeError(f"no end after {self.stall_seconds:.0f}s waiting for {what}")

    def running(self) -> bool:
        return bool(self.background) and all(r is None for r in self.finished)

    def tokens_left(self) -> int:
        return self.tokens - max(self.streamed, default=self.tokens)

    def start_background(self) -> None:
        self.restarts += bool(self.background)
        self.stopping = False
        self.background = [self._make(i, p) for i, p in enumerate(self.prompts)]
        self.streamed = [0] * len(self.background)
        self.finished = [None] * len(self.background)
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


# -- placing a probe's adapter in its tier ------------------------------------------------------------
def place(loop: Loop, manager, probe: Probe, files: list[Path]) -> None:
    """Puts the probe's adapter in its tier, untimed, while the background decodes; `files`:
    where the disk tier keeps it, the weights last."""
    if probe.tier == "disk":
        if probe.adapter in manager.current:
            raise RuntimeError(f"{probe.adapter} is already on the node")
        if all(page_cache.drop(f) for f in files):
            probe.cached_after_drop = page_cache.resident_share(files[-1])
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
    """Every probe in turn: the background refreshed if it would end within two probes'
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


def fill_disk_tier(root: Path, names: list[str], rank: int, disk_dir: Path) -> dict[str, list[Path]]:
    """The folder's adapters as entries of the node's disk tier of store adapters, each as a
    fetch from the store leaves it (its manifest: files, sha256s, the version they give);
    each one's files there that a load reads (its chunk digests too), the weights last."""
    from adapter_store.records import AdapterInfo, FileEntry, Manifest, adapter_digest
    from inference_node.adapters.disk_tier import CHUNKS_FILE, DiskTier

    tier = DiskTier(disk_dir, 1 << 40)
    files = {}
    for name in names:
        blobs = [(root / name / CONFIG_FILE).read_bytes(), (root / name / WEIGHTS_FILE).read_bytes()]
        entries = tuple(FileEntry(path, len(blob), hashlib.sha256(blob).hexdigest())
                        for path, blob in zip((CONFIG_FILE, WEIGHTS_FILE), blobs))
        digest = adapter_digest(f.sha256 for f in entries)
        info = AdapterInfo(name, digest[:16], rank=rank, valid=True, size_bytes=sum(map(len, blobs)),
                           updated_at=int(time.time()))
        manifest = Manifest(info, blobs[0].decode(), entries, digest)
        if tier.lookup(name, info.version) is None and not tier.put(manifest, blobs):
            raise RuntimeError(f"the disk tier did not keep {name}")
        files[name] = [disk_dir / digest / CHUNKS_FILE] + [disk_dir / digest / str(i) for i in range(len(blobs))]
    tier.close()  # the node's own tier takes the folder next
    return files


# -- the table ---------------------------------------------------------------------------------------
def tier_rows(probes: list[Probe], sizes: dict[str, float]) -> list[TierRow]:
    rows = []
    for tier in TIERS:
        timed = [p for p in probes if p.timed and p.tier == tier and p.error is None]
        cached = [p.cached_after_drop for p in timed if p.cached_after_drop is not None]
        rows.append(TierRow(tier, [p.ttft for p in timed], sizes[tier],
                            pct([p.load_seconds for p in timed if not math.isnan(p.load_seconds)], 50),
                            max(cached) if cached else None))
    return rows


HEADER = (f"{'tier':<5} {'probes':>6} {'TTFT p50':>9} {'max':>8} {'-gpu p50':>9} {'steps':>6} "
          f"{'adapter':>8} {'load p50':>9} {'cached':>7}")
UNITS = (f"{'':<5} {'':>6} {'ms':>9} {'ms':>8} {'ms':>9} {'':>6} {'MB':>8} {'ms':>9} {'%':>7}")


def format_row(row: TierRow, gpu: TierRow, step: float) -> str:
    if not row.ttft:
        return f"{row.tier:<5} {0:>6} no probe of this tier ended well"
    delta = row.p50 - gpu.p50 if gpu.ttft else float("nan")
    load = "-" if math.isnan(row.load_p50) else f"{row.load_p50 * 1e3:.1f}"
    cached = "-" if row.cached_after_drop is None else f"{100 * row.cached_after_drop:.0f}"
    return (f"{row.tier:<5} {len(row.ttft):>6} {row.p50 * 1e3:9.2f} {max(row.ttft) * 1e3:8.2f} "
            f"{delta * 1e3:9.2f} {delta / step:6.2f} {row.adapter_mb:8.2f} {load:>9} {cached:>7}")


def target_lines(rows: dict[str, TierRow], step: float) -> list[str]:
    """The issue's targets, as measured."""
    def p50(tier: str) -> float:
        return rows[tier].p50 if rows[tier].ttft else float("nan")

    host_gpu, disk_host = p50("host") - p50("gpu"), p50("disk") - p50("host")
    return [f"target host - gpu <= one decode step: {host_gpu * 1e3:.2f} ms vs {step * 1e3:.2f} ms: "
            f"{'met' if host_gpu <= step else 'NOT met'}",
            f"target disk - host <= 50 ms: {disk_host * 1e3:.2f} ms: {'met' if disk_host <= 0.05 else 'NOT met'}"]


# -- main --------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--targets", choices=sorted(TARGETS), default="all", help="modules every adapter targets")
    p.add_argument("--disk", choices=["folder", "disk-tier"], default="folder",
                   help="the disk tier: the --adapter-dir folder, or the node's disk tier of store adapters")
    p.add_argument("--background", type=int, help="background requests decoding throughout (CUDA 32, CPU 4)")
    p.add_argument("--background-tokens", type=int,
                   help="a background request's length before it is restarted (CUDA 1024, CPU 256)")
    p.add_argument("--background-adapter", action="store_true",
                   help="the background runs on one pinned adapter (default: the base model)")
    p.add_argument("--probes", type=int, help="timed probes per tier (CUDA 8, CPU 2)")
    p.add_argument("--prompt-len", type=int, help="a probe's prompt tokens, also the background's (CUDA 128, CPU 16)")
    p.add_argument("--new-tokens", type=int, default=4, help="tokens a probe generates")
    p.add_argument("--quiet-steps", type=int, default=6, help="quiet loop iterations before each probe")
    p.add_argument("--max-batched-tokens", type=int, help="engine token budget per step (CUDA 2048, CPU 256)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--decode-graphs", choices=["auto", "on", "off"], default="auto")
    p.add_argument("--mixed-graphs", choices=["auto", "on", "off"], default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", type=Path, default=None,
                   help="keep the checkpoint and adapters here (on the disk to measure: the page cache "
                        "is dropped for the disk tier's files, which does nothing on tmpfs)")
    p.add_argument("--json", type=Path, default=None, help="also write the rows and probes as JSON")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("-v", "--verbose", action="store_true")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    device, dtype = bench_runtime(args, log, logging.INFO if args.verbose else logging.WARNING)
    cuda = device.type == "cuda"
    args.background = args.background if args.background is not None else (32 if cuda else 4)
    if args.background < 1:
        raise SystemExit("--background must be at least 1: its decode step is the yardstick")
    args.background_tokens = args.background_tokens or (1024 if cuda else 256)
    args.probes = args.probes or (8 if cuda else 2)
    args.prompt_len = args.prompt_len or (128 if cuda else 16)
    args.max_batched_tokens = args.max_batched_tokens or (2048 if cuda else 256)
    args.use_graphs = args.decode_graphs == "on" or (args.decode_graphs == "auto" and cuda)
    args.use_mixed = args.mixed_graphs == "on" or (args.mixed_graphs == "auto" and cuda)
    torch.manual_seed(args.seed)
    # Each load from the disk tier says the store is unreachable: expected here. The level is
    # put back after, for whatever else runs in this process (the test suite does).
    store_source = logging.getLogger("inference_node.adapters.store_source")
    level = store_source.level
    if not args.verbose:
        store_source.setLevel(logging.ERROR)
    try:
        with tempfile.TemporaryDirectory(prefix="tier-bench-") as tmp:
            return _run(args, args.workdir or Path(tmp), device, dtype)
    finally:
        store_source.setLevel(level)


def _run(args, work: Path, device: torch.device, dtype: torch.dtype) -> dict:
    from bench.serving_bench import build_engine
    from inference_node.model.config import ModelConfig
    from inference_node.model.llama import LlamaModel
    from inference_node.config import NodeConfig
    from inference_node.node import build_adapter_manager, open_disk_tier

    COMPILES.install()
    cuda = device.type == "cuda"
    model_name = args.model or ("llama-1b-random" if cuda else "tiny")
    bench = bench_model(model_name, work, dtype, device, args.seed)
    cfg = ModelConfig.from_checkpoint(bench.checkpoint)
    targets = TARGETS[args.targets]

    # One fresh adapter per probe (the untimed first probe of each tier included).
    probes = [Probe(tier, f"tier-warm-{tier}", False) for tier in TIERS]
    probes += [Probe(tier, f"tier-{tier}-{k:03d}", True) for k in range(args.probes) for tier in TIERS]
    background_adapter = "tier-background" if args.background_adapter else ""
    names = [p.adapter for p in probes] + ([background_adapter] if background_adapter else [])
    root = work / (f"tier-adapters-h{cfg.hidden_size}-l{cfg.num_layers}-{args.targets}-r{args.rank}-"
                   f"{str(dtype).removeprefix('torch.')}")
    write_adapters(root, cfg, names, [args.rank], targets, device, dtype)
    sizes = {tier: (root / f"tier-warm-{tier}" / WEIGHTS_FILE).stat().st_size / 1e6 for tier in TIERS}
    refuser = socket.socket()
    if args.disk == "folder":
        files = {n: [root / n / CONFIG_FILE, root / n / WEIGHTS_FILE] for n in names}
        config = NodeConfig.of(adapter_dir=str(root))
        disk_line = "the node's adapter folder (serve --adapter-dir)"
    else:
        disk_dir = root.with_name(root.name + "-disk-tier")
        files = fill_disk_tier(root, names, args.rank, disk_dir)
        refuser.bind(("127.0.0.1", 0))  # and never listening: connecting to it is refused
        config = NodeConfig.of(adapter_store=f"127.0.0.1:{refuser.getsockname()[1]}", adapter_disk_dir=str(disk_dir))
        disk_line = "the node's disk tier of store adapters, the store refusing connections"

    max_model_len = args.prompt_len + args.background_tokens + args.block_size
    per_seq = -(-(max_model_len + 1) // args.block_size)
    seqs = args.background + 1
    num_blocks = seqs * per_seq + seqs + 8
    model = LlamaModel.load(bench.checkpoint, device, dtype, max_positions=max_model_len,
                            load_format=bench.load_format)
    # Adapter memory for a few adapters of --rank (the background's, one probe's, spare),
    # host memory for as many.
    config = config.replace(max_loras=4, max_lora_rank=args.rank, max_cpu_loras=4)
    disk = open_disk_tier(config, bench.checkpoint)
    manager = build_adapter_manager(config, model, device, dtype, disk=disk)
    if not hasattr(manager, "prefetch"):
        raise SystemExit("this node's AdapterManager has no prefetch(): the host tier cannot be set up")
    engine = build_engine(model, manager, engine_args(argparse.Namespace(
        block_size=args.block_size, concurrency=seqs, max_batched_tokens=args.max_batched_tokens,
        requests=seqs)), max_model_len, num_blocks, args.use_graphs, args.use_mixed)

    specs = make_specs(args.background + len(probes), (args.prompt_len, args.prompt_len),
                       (args.new_tokens, args.new_tokens), cfg.vocab_size, None, args.seed)
    background_prompts = [s.prompt for s in specs[:args.background]]
    probe_prompts = [s.prompt for s in specs[args.background:]]
    filesystem = page_cache.filesystem_of(files[names[0]][-1])
    header = [
        f"device: {torch.cuda.get_device_name(device) if cuda else 'CPU'}  torch {torch.__version__}  "
        f"dtype {str(dtype).removeprefix('torch.')}",
        f"model: {bench.description}: {cfg.num_layers} layers, hidden {cfg.hidden_size}",
        f"adapters: one fresh adapter per probe, rank {args.rank} on {','.join(targets)}, "
        f"{sizes['gpu']:.2f} MB each; disk tier: {disk_line}, on {filesystem}",
        f"background: {args.background} requests of {args.prompt_len} prompt tokens on "
        f"{background_adapter or 'the base model'}, restarted before {args.background_tokens} tokens",
        f"probes: {args.probes} timed per tier (after one untimed), {args.prompt_len} prompt tokens, "
        f"{args.new_tokens} new, one at a time after {args.quiet_steps} quiet steps",
        f"engine: {args.max_batched_tokens} tokens per step, {num_blocks} KV blocks of {args.block_size}, "
        f"decode graphs {'on' if args.use_graphs else 'off'}, piecewise graphs "
        f"{'on' if args.use_mixed else 'off'}, prefix cache off",
        "disk tier: the probe's files fsynced and dropped from the page cache (posix_fadvise "
        "DONTNEED) before it; 'cached' is the share of pages still cached after the drop (mincore)",
    ]
    for line in header:
        print(line, flush=True)

    loop = Loop(engine, background_prompts, args.background_tokens, background_adapter)
    try:
        if background_adapter:
            outcome: dict = {}
            manager.load(background_adapter, "", True, lambda e, err: outcome.update(entry=e, error=err))
            loop.until(lambda: bool(outcome) and not manager.busy(), what="the background's adapter")
            if outcome["error"] is not None:
                raise RuntimeError(f"the background's adapter: {outcome['error']}")
        loop.start_background()
        warm = [p for p in probes if not p.timed]
        run_probes(loop, manager, warm, probe_prompts, files, args)
        mark = COMPILES.mark()
        run_probes(loop, manager, probes[len(warm):], probe_prompts[len(warm):], files, args)
        compiles = COMPILES.since(mark)
        loop.stop_background()
    finally:
        manager.shutdown()
        if disk is not None:
            disk.close()
        refuser.close()
    sync(device)
    engine.check_consistency()

    step = pct(loop.steps, 50)
    rows = tier_rows(probes, sizes)
    by_tier = {r.tier: r for r in rows}
    print(f"one decode step (the background's, {len(loop.steps)} quiet steps): p50 {step * 1e3:.2f} ms, "
          f"p90 {pct(loop.steps, 90) * 1e3:.2f} ms")
    print(HEADER)
    print(UNITS)
    for row in rows:
        print(format_row(row, by_tier["gpu"], step))
    targets_met = target_lines(by_tier, step)
    for line in targets_met:
        print(line)
    failed = [p for p in probes if p.error]
    for p in failed:
        print(f"probe {p.adapter} FAILED: {p.error}")
    if compiles:
        print(f"note: {len(compiles)} JIT compiles landed among the timed probes (listed in the log)")
        for what in compiles:
            log.warning("compiled among the timed probes: %s", what[:300])
    result = {"header": header, "decode_step_p50": step, "decode_steps": len(loop.steps),
              "background_restarts": loop.restarts,
              "rows": [{**asdict(r), "p50": r.p50 if r.ttft else None} for r in rows],
              "probes": [{**asdict(p), "ttft": p.ttft} for p in probes],
              "targets": targets_met, "compiles": len(compiles), "ok": not failed}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(_plain(result), indent=2))
    return result


def _plain(value):
    """JSON has no NaN: a value not measured is null."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
