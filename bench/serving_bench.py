"""Serving benchmark: the engine with LoRA off, on but unused, and with many adapters, next to
Hugging Face PEFT's mixed-adapter generate, all on the same requests, in one table.

    python -m bench.serving_bench                     # CUDA: Llama-3.2-1B-shaped random bf16 model
    python -m bench.serving_bench --model llama-8b-random --rows a,c,d --adapter-counts 32   # Llama-3.1-8B shapes
    python -m bench.serving_bench --poisson 20        # open loop, Poisson arrivals, Zipf popularity
    python -m bench.serving_bench --device cpu        # CPU: the embedded SmolLM2, small settings
    python -m bench.serving_bench --rows a,b,c,d --rounds 3   # rows take turns 3 times: medians
    python -m bench.serving_bench --structured --rounds 3     # free text against response_format json_schema

Rows (every one runs the same requests, in the same process):
  a     base model, LoRA disabled (build_engine(lora=None))
  b     LoRA enabled (slots allocated), no request uses an adapter
  c-N   N distinct adapters of rank 16 on all seven projections (N = 1, 8, 32, 128)
  d     32 adapters of rank 8 on q_proj and v_proj only
  e     Hugging Face PEFT: one PeftModel holding the adapters of c-32, generate(adapter_names=...)

Columns: decode tok/s (tokens of pure-decode steps / their time), end-to-end tok/s (output
tokens / wall time from the first arrival to the last finish), TTFT and time per output token
(p50, p99), and for decode steps the step time (p50) next to its floor: the bytes a decode step
must read (base weights + the distinct adapters' A and B in that step + the KV it attends
over) divided by the device-to-device copy bandwidth measured in the same run.

The engine is driven from this thread with `Engine.run_once` (no loop thread), each call timed
on the host without a synchronize: the engine launches step n+1 before it waits for step n's
tokens, so in steady state one call lasts one step of the GPU, and its time is charged to
step n. A step is a decode step when every scheduled chunk is one decode token. All adapters are pinned in GPU slots before timing; every row is warmed up first.
Closed loop (default): a fixed number of requests in flight, request i uses adapter i mod N.
--poisson RATE: arrivals at RATE requests/s, adapter popularity Zipf(--zipf-alpha).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from bench.common import ALL_MODULES, QV, CompileWatch, add_model_args, bench_model, bench_runtime, copy_bandwidth, write_random_adapter
from bench.engine_driver import (DecodeStep, Driver, ReqRecord, Spec, make_specs, parse_range, pct,
                                 preload_adapters, sync, zipf_index)
from bench.tp_floor import StepBytes, adapter_bytes_per_rank

log = logging.getLogger("serving_bench")
COMPILES = CompileWatch()  # installed by _run; every row reports what compiled in its timed run


@dataclass
class Row:
    key: str
    label: str
    lora: bool                 # runs on the engine with LoRA slots
    pool: list[str]            # adapter names (empty: every request uses the base model)
    peft: bool = False
    delay: float | None = None  # the scheduler's prefill_delay_factor for this row (None: the engine's)

    def adapter_of(self, spec: Spec, poisson: bool, alpha: float) -> str:
        if not self.pool:
            return ""
        if poisson:
            return self.pool[zipf_index(spec.pick, len(self.pool), alpha)]
        return self.pool[spec.index % len(self.pool)]


@dataclass
class RowResult:
    key: str
    label: str
    records: list[ReqRecord] = field(default_factory=list)
    steps: list[DecodeStep] = field(default_factory=list)
    graph_steps: int | None = None
    # Steps with prompt tokens or past the decode graphs: (replayed piece by piece, eager).
    other_steps: tuple[int, int] | None = None
    compiles: list[str] = field(default_factory=list)  # JIT compiles during the timed run
    error: str | None = None


# -- the engine ---------------------------------------------------------------------------------------
def build_engine(model, lora, args, max_model_len: int, num_blocks: int, use_graphs: bool,
                 use_mixed: bool = False, launches=None):
    from inference_node.engine.build import build_engine as engine_for
    from inference_node.engine.config import EngineConfig

    kw = dict(num_kv_blocks=num_blocks, block_size=args.block_size, max_num_seqs=args.concurrency,
              max_num_batched_tokens=args.max_batched_tokens, max_queue=args.requests + args.concurrency,
              max_model_len=max_model_len, prefix_caching=args.prefix_caching)
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    if "decode_graphs" in names:
        kw["decode_graphs"] = use_graphs
    if "max_graph_batch" in names:
        kw["max_graph_batch"] = args.concurrency
    if "piecewise_graphs" in names:
        kw["piecewise_graphs"] = use_mixed
    if "prefill_delay_factor" in names and len(args.prefill_delay_factor) == 1:
        kw["prefill_delay_factor"] = args.prefill_delay_factor[0]
    engine = engine_for(model, EngineConfig(**kw), lora=lora, launches=launches)
    runner = engine.runner
    if args.warmup == "engine":
        # The node's start-up warm-up (what Engine.start runs before serving), instead of
        # running each row's workload untimed: the timed runs' compile counts then say
        # whether the warm-up alone leaves anything to compile under requests.
        started = time.perf_counter()
        runner.warm_up()
        log.info("engine warm-up: %d forwards in %.1fs", runner.warmup_forwards, time.perf_counter() - started)
    graphs = runner.decode_graphs
    if graphs is not None:
        # What Engine.start does before its loop (this benchmark drives run_once itself).
        started = time.perf_counter()
        try:
            graphs.capture_all()
            log.info("decode graphs captured in %.1fs", time.perf_counter() - started)
        except Exception:
            log.exception("decode graph capture failed: decode runs eagerly")
            runner.decode_graphs = None
    mixed = runner.piecewise_graphs
    if mixed is not None:
        started = time.perf_counter()
        try:
            mixed.capture_all()
            log.info("piecewise graphs captured in %.1fs", time.perf_counter() - started)
        except Exception:
            log.exception("piecewise graph capture failed: prefill and mixed steps run eagerly")
            runner.piecewise_graphs = None
    return engine


def run_engine_row(row: Row, engine, specs: list[Spec], args, device: torch.device) -> RowResult:
    result = RowResult(row.key, row.label)
    if row.delay is not None:  # rows compared by prefill delay share one engine
        engine.scheduler.config = dataclasses.replace(engine.scheduler.config, prefill_delay_factor=row.delay)
    trace = args.trace / f"{row.key}.json" if args.trace else None
    driver = Driver(engine, device, args.concurrency, poisson=bool(args.poisson), trace=trace)
    adapter_of = lambda s: row.adapter_of(s, bool(args.poisson), args.zipf_alpha)  # noqa: E731
    # Warm-up, untimed: "full" runs the row's whole workload once (every prefill/decode shape
    # the timed run meets, so no Triton compile lands in it); "short": one batch, few tokens;
    # "engine": none here (build_engine ran the node's start-up warm-up).
    if args.warmup == "full":
        Driver(engine, device, args.concurrency, poisson=bool(args.poisson)).run(specs, adapter_of)
    elif args.warmup == "short":
        Driver(engine, device, args.concurrency, poisson=False).run(
            specs[:args.concurrency], adapter_of, lambda s: min(args.warmup_tokens, s.max_tokens))
    # Engine.start freezes start-up objects out of the garbage collector; this process's own
    # set-up (checkpoint, adapters, other rows) is frozen the same way before timing.
    gc.collect()
    gc.freeze()
    graph_before = getattr(engine.stats, "graph_steps", None)
    stats_before = dict(engine.stats.__dict__)
    mark = COMPILES.mark()
    try:
        result.records, result.steps = driver.run(specs, adapter_of)
    finally:
        gc.unfreeze()
    result.compiles = COMPILES.since(mark)
    for what in result.compiles:
        log.warning("row %s: compiled during the timed run: %s", row.key, what[:300])
    if graph_before is not None:
        result.graph_steps = engine.stats.graph_steps - graph_before
    if "piecewise_graph_steps" in stats_before:
        after = engine.stats.__dict__
        result.other_steps = (after["piecewise_graph_steps"] - stats_before["piecewise_graph_steps"],
                              after["eager_prefill_steps"] - stats_before["eager_prefill_steps"]
                              + after["eager_decode_steps"] - stats_before["eager_decode_steps"])
    return result


# -- Hugging Face PEFT ------------------------------------------------------------------------------------
def run_peft_row(row: Row, checkpoint: Path, adapter_dirs: dict[str, Path], specs: list[Spec], args,
                 device: torch.device, dtype: torch.dtype) -> RowResult:
    """PEFT's mixed-adapter generate: static batches of up to `concurrency` requests, one
    PeftModel holding every adapter of the row, adapter_names= per request."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    result = RowResult(row.key, row.label)
    base = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).to(device).eval()
    names = list(dict.fromkeys(row.pool))
    model = PeftModel.from_pretrained(base, adapter_dirs[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapter_dirs[name], adapter_name=name)
    model.eval()
    poisson = bool(args.poisson)

    class Stamp(LogitsProcessor):
        """Called once per generated token position, after that step's forward."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            sync(device)
            self.times.append(time.perf_counter())
            return scores

    def generate(batch: list[Spec], new_tokens: int) -> list[float]:
        width = max(len(s.prompt) for s in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for j, s in enumerate(batch):  # left padding
            ids[j, width - len(s.prompt):] = torch.tensor(s.prompt)
            mask[j, width - len(s.prompt):] = 1
        stamp = Stamp()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids.to(device), attention_mask=mask.to(device),
                adapter_names=[row.adapter_of(s, poisson, args.zipf_alpha) for s in batch],
                max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                logits_processor=LogitsProcessorList([stamp]))
        sync(device)
        if out.shape[1] - width != new_tokens:
            raise RuntimeError(f"PEFT generated {out.shape[1] - width} tokens, not {new_tokens}")
        return stamp.times

    generate(specs[:min(2, len(specs))], 2)  # warm-up
    records = [ReqRecord() for _ in specs]
    order = sorted(range(len(specs)), key=lambda i: (specs[i].arrival, i))
    t0 = time.perf_counter()
    pos = 0
    while pos < len(order):
        now = time.perf_counter()
        if poisson:  # whatever has arrived, up to `concurrency` requests
            ready = [i for i in order[pos:pos + args.concurrency] if t0 + specs[i].arrival <= now]
            if not ready:
                time.sleep(max(0.0, min(t0 + specs[order[pos]].arrival - now, 0.01)))
                continue
        else:  # closed loop: the next batch is submitted when the previous one returns
            ready = order[pos:pos + args.concurrency]
        pos += len(ready)
        batch = [specs[i] for i in ready]
        for i in ready:
            records[i].submit = t0 + specs[i].arrival if poisson else now
        times = generate(batch, max(s.max_tokens for s in batch))
        end = time.perf_counter()
        for i in ready:  # TTFT as if generate streamed (it does not: generous to PEFT)
            r = records[i]
            r.first, r.last, r.done, r.tokens = times[0], times[specs[i].max_tokens - 1], end, specs[i].max_tokens
        adapters = frozenset(row.adapter_of(s, poisson, args.zipf_alpha) for s in batch)
        for k in range(1, len(times)):
            kv = sum(len(s.prompt) + k + 1 for s in batch)
            result.steps.append(DecodeStep(times[k] - times[k - 1], len(batch), adapters, kv))
    result.records = records
    del model, base
    return result


# -- report ------------------------------------------------------------------------------------------------
@dataclass
class Summary:
    key: str
    label: str
    error: str | None = None
    decode_tps: float = float("nan")
    e2e_tps: float = float("nan")
    ttft_p50: float = float("nan")
    ttft_p99: float = float("nan")
    tpot_p50: float = float("nan")
    tpot_p99: float = float("nan")
    step_p50: float = float("nan")
    forward_p50: float = float("nan")
    host_p50: float = float("nan")
    floor_p50: float = float("nan")
    over_floor: float = float("nan")
    batch: float = float("nan")
    adapters_per_step: float = float("nan")
    decode_steps: int = 0
    graph_steps: int | None = None
    piecewise_steps: int | None = None  # other steps replayed piece by piece (piecewise_graphs.py)
    eager_steps: int | None = None      # steps run eagerly
    output_tokens: int = 0
    # decode_tps counts the decode steps whose call did not also launch a prefill or mixed
    # step (that launch's host work lands in the call's time); all_steps_tps counts them all.
    steady_steps: int = 0
    all_steps_tps: float = float("nan")
    compiles: list = field(default_factory=list)  # JIT compiles during the timed run
    step_seconds: list = field(default_factory=list)  # per decode step, in order (--json)
    step_boundary: list = field(default_factory=list)


def summarize(res: RowResult, nbytes: StepBytes, bw: float) -> Summary:
    s = Summary(res.key, res.label, res.error)
    if res.error:
        return s
    s.compiles = list(res.compiles)
    recs = res.records
    s.output_tokens = sum(r.tokens for r in recs)
    wall = max(r.done for r in recs) - min(r.submit for r in recs)
    s.e2e_tps = s.output_tokens / wall
    ttft = [r.first - r.submit for r in recs]
    tpot = [(r.last - r.first) / (r.tokens - 1) for r in recs if r.tokens > 1]
    s.ttft_p50, s.ttft_p99 = pct(ttft, 50), pct(ttft, 99)
    s.tpot_p50, s.tpot_p99 = pct(tpot, 50), pct(tpot, 99)
    steps = res.steps
    if steps:
        s.decode_steps = len(steps)
        # Decode throughput over the steady decode steps: a step whose call also launched a
        # prefill chunk carries that launch's host work (an eager 2048-token forward: 12-55 ms
        # on the H100 runs, once per wave of the closed loop), which is prefill cost, counted
        # in e2e tok/s. The all-steps figure stays in --json and beside the ratios.
        s.all_steps_tps = sum(st.batch for st in steps) / sum(st.seconds for st in steps)
        steady = [st for st in steps if not st.boundary] or steps
        s.steady_steps = len(steady)
        s.decode_tps = sum(st.batch for st in steady) / sum(st.seconds for st in steady)
        s.step_seconds = [round(st.seconds, 7) for st in steps]
        s.step_boundary = [st.boundary for st in steps]
        floors = [nbytes.step(st.batch, st.adapters, st.kv_tokens) / bw for st in steps]
        s.step_p50 = pct([st.seconds for st in steps], 50)
        s.forward_p50 = pct([st.forward for st in steps if not math.isnan(st.forward)], 50)
        s.host_p50 = pct([st.host for st in steps if not math.isnan(st.host)], 50)
        s.floor_p50 = pct(floors, 50)
        s.over_floor = pct([st.seconds / f for st, f in zip(steps, floors)], 50)
        s.batch = statistics.fmean(st.batch for st in steps)
        s.adapters_per_step = statistics.fmean(len(st.adapters) for st in steps)
    s.graph_steps = res.graph_steps
    if res.other_steps is not None:
        s.piecewise_steps, s.eager_steps = res.other_steps
    return s


def median_summary(runs: list[Summary]) -> Summary:
    """One row over several rounds: each numeric column's median (the first error, if any)."""
    if len(runs) == 1:
        return runs[0]
    failed = [r for r in runs if r.error]
    if failed:
        return failed[0]
    merged = dataclasses.replace(runs[0])
    for f in dataclasses.fields(Summary):
        values = [getattr(r, f.name) for r in runs]
        if f.name not in ("key", "label", "error") and all(isinstance(v, (int, float)) for v in values):
            med = statistics.median(values)
            setattr(merged, f.name, type(values[0])(med) if isinstance(values[0], int) else med)
    return merged


HEADER = (f"{'row':<6} {'what':<34} {'decode':>9} {'e2e':>9} {'TTFT p50':>9} {'p99':>8} "
          f"{'TPOT p50':>9} {'p99':>8} {'step p50':>9} {'fwd p50':>8} {'host p50':>8} {'floor':>8} {'x floor':>8} "
          f"{'batch':>6} {'adp/st':>6}")
UNITS = (f"{'':<6} {'':<34} {'tok/s':>9} {'tok/s':>9} {'ms':>9} {'ms':>8} "
         f"{'ms':>9} {'ms':>8} {'ms':>9} {'ms':>8} {'ms':>8} {'ms':>8} {'':>8} {'':>6} {'':>6}")


def _ms(seconds: float, width: int) -> str:
    return f"{'-':>{width}}" if math.isnan(seconds) else f"{seconds * 1e3:{width}.2f}"


def format_row(s: Summary) -> str:
    if s.error:
        return f"{s.key:<6} {s.label:<34} FAILED: {s.error}"
    return (f"{s.key:<6} {s.label:<34} {s.decode_tps:9.1f} {s.e2e_tps:9.1f} {s.ttft_p50 * 1e3:9.1f} "
            f"{s.ttft_p99 * 1e3:8.1f} {s.tpot_p50 * 1e3:9.2f} {s.tpot_p99 * 1e3:8.2f} "
            f"{s.step_p50 * 1e3:9.2f} {_ms(s.forward_p50, 8)} {_ms(s.host_p50, 8)} {s.floor_p50 * 1e3:8.3f} {s.over_floor:7.2f}x {s.batch:6.1f} "
            f"{s.adapters_per_step:6.1f}")


def ratios(by: dict[str, Summary], adapter_read_32: float, c32_key: str) -> list[str]:
    """The targets (issue 33's for d, c-32 and a), each with what was measured."""
    lines = []

    def ok(v: float, good: bool) -> str:
        return "n/a" if math.isnan(v) else ("met" if good else "NOT met")

    def get(key: str) -> Summary | None:
        s = by.get(key)
        return s if s is not None and not s.error else None

    a, b, d, e, c32 = get("a"), get("b"), get("d"), get("e"), get(c32_key)
    a2 = get("a2")
    if a and a2:
        lines.append(f"control a2/a (same engine setup, run after b-d): decode {a2.decode_tps / a.decode_tps:.3f}, "
                     f"end-to-end {a2.e2e_tps / a.e2e_tps:.3f}, step {a2.step_p50 * 1e3:.2f} vs {a.step_p50 * 1e3:.2f} ms")
    def others(x: Summary) -> str:
        return (f"; all decode steps {x.all_steps_tps / a.all_steps_tps:.3f} ({a.steady_steps}/"
                f"{a.decode_steps} and {x.steady_steps}/{x.decode_steps} steady), by step p50 "
                f"{a.step_p50 / x.step_p50:.3f}")

    if a and b:
        r, r2 = b.decode_tps / a.decode_tps, b.e2e_tps / a.e2e_tps
        lines.append(f"b/a throughput: decode {r:.3f}, end-to-end {r2:.3f}  (target >= 0.97: {ok(r, r >= 0.97)})"
                     + others(b))
    if a and d:
        r, r2 = d.decode_tps / a.decode_tps, d.e2e_tps / a.e2e_tps
        lines.append(f"d/a throughput: decode {r:.3f}, end-to-end {r2:.3f}  (target >= 0.95: {ok(r, r >= 0.95)})"
                     + others(d))
    if a and c32:
        extra = c32.step_p50 - a.step_p50
        r = extra / adapter_read_32
        lines.append(f"{c32_key} extra decode step over a: {extra * 1e3:.3f} ms; reading 32 adapters' A and B at "
                     f"copy bandwidth: {adapter_read_32 * 1e3:.3f} ms; ratio {r:.2f}  "
                     f"(target <= 1.25: {ok(r, r <= 1.25)}; {c32.adapters_per_step:.1f} adapters per decode step)")
    if a:
        lines.append(f"a decode step / its floor: {a.over_floor:.2f}x  (target <= 1.15: "
                     f"{ok(a.over_floor, a.over_floor <= 1.15)})")
    if e:
        lora_rows = [s for k, s in by.items() if k not in ("a", "a2", "e") and not s.error]
        if lora_rows:
            worst = min(lora_rows, key=lambda s: s.e2e_tps)
            r = worst.e2e_tps / e.e2e_tps
            rd = min(s.decode_tps for s in lora_rows) / e.decode_tps
            lines.append(f"slowest LoRA row ({worst.key}) / PEFT (e): end-to-end {r:.1f}x, decode (slowest) "
                         f"{rd:.1f}x  (target >= 20x: {ok(r, r >= 20)})")
    return lines


# -- main ----------------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, "HF safetensors checkpoint dir, 'llama-1b-random', 'llama-8b-random' or 'embedded' "
                      "(default: llama-1b-random on CUDA, embedded SmolLM2 on CPU)")
    p.add_argument("--requests", type=int, help="requests per row (CUDA 128, CPU 8)")
    p.add_argument("--concurrency", type=int, help="closed-loop requests in flight = engine max_num_seqs "
                                                   "= PEFT batch (CUDA 64, CPU 4)")
    p.add_argument("--prompt-len", help="LO:HI tokens, uniform (CUDA 32:256, CPU 8:32)")
    p.add_argument("--output-len", help="LO:HI tokens, uniform (CUDA 128, CPU 8)")
    p.add_argument("--poisson", type=float, default=None, metavar="RATE",
                   help="open loop: Poisson arrivals at RATE requests/s, Zipf adapter popularity")
    p.add_argument("--zipf-alpha", type=float, default=1.0)
    p.add_argument("--adapter-counts", default="1,8,32,128", help="rows c: distinct rank-16 adapters")
    p.add_argument("--qv-adapters", type=int, default=32, help="row d: rank-8 q/v adapters")
    p.add_argument("--peft-adapters", type=int, default=32, help="row e: the first N adapters of rows c")
    p.add_argument("--rows", default="a,b,c,d,e", help="which rows to run")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-batched-tokens", type=int, help="engine token budget per step (CUDA 2048, CPU 256)")
    p.add_argument("--prefix-caching", action="store_true",
                   help="keep the engine's prefix cache on (off by default: rows share prompts)")
    p.add_argument("--decode-graphs", choices=["auto", "on", "off"], default="auto")
    p.add_argument("--mixed-graphs", choices=["auto", "on", "off"], default="auto",
                   help="replay prefill and mixed steps piece by piece from CUDA graphs (auto: on CUDA)")
    p.add_argument("--prefill-delay-factor", type=lambda t: [float(x) for x in t.split(",")], default=[],
                   help="engine admission delay, x the last prefill step (default: the engine's); "
                        "several, comma-separated: each engine row runs once per factor, as ROW@FACTOR")
    p.add_argument("--rounds", type=int, default=1,
                   help="run rows a-d this many times, interleaved; report each column's median")
    p.add_argument("--control", action="store_true",
                   help="run row a again after rows b-d (a2) on a fresh engine: shows order/drift effects")
    p.add_argument("--warmup", choices=["full", "short", "engine"], default=None,
                   help="per row, untimed: the whole workload once (CUDA default: JIT-compiles every "
                        "shape) or one batch of --warmup-tokens tokens (CPU default); 'engine': only "
                        "the node's start-up warm-up, once per engine (the timed runs count what it missed)")
    p.add_argument("--warmup-tokens", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", type=Path, default=None, help="keep the checkpoint and adapters here")
    p.add_argument("--json", type=Path, default=None, help="also write the results as JSON")
    p.add_argument("--trace", type=Path, default=None, metavar="DIR",
                   help="write a torch.profiler trace of decode steps 100-109 per row to DIR/ROW.json")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--tune", action="append", default=[], metavar="NAME=VALUE",
                   help="a launch choice other than the node's default (kernels/tuning.py; the "
                        "form of `inference-node serve --NAME`), repeatable; wins over the table")
    p.add_argument("--tuning-table", default="auto",
                   help="per-bucket launch choices, as `inference-node serve --tuning-table`: auto "
                        "(the table filed for this GPU and shape, if any), off, or a file's path")
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("--structured", action="store_true",
                   help="instead of the rows: the same prompts as free text and under response_format json_schema, "
                        "one table (bench/structured_output.py; --model embedded or a checkpoint with its tokenizer)")
    args = p.parse_args(argv)
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Summary]:
    args = parse_args(argv)
    if args.structured:
        from bench.structured_output import run as structured_table

        structured_table(argparse.Namespace(
            checkpoint="" if args.model in (None, "embedded") else args.model,
            device=None if args.device == "auto" else args.device, requests=args.requests,
            concurrency=args.concurrency, max_tokens=96, rounds=args.rounds, threads=args.threads))
        return {}
    device, dtype = bench_runtime(args, log)
    cuda = device.type == "cuda"
    args.requests = args.requests or (128 if cuda else 8)
    args.concurrency = args.concurrency or (64 if cuda else 4)
    prompt_len = parse_range(args.prompt_len or ("32:256" if cuda else "8:32"))
    output_len = parse_range(args.output_len or ("128" if cuda else "8"))
    args.max_batched_tokens = args.max_batched_tokens or (2048 if cuda else 256)
    args.warmup = args.warmup or ("full" if cuda else "short")
    counts = [int(c) for c in args.adapter_counts.split(",") if c]
    wanted = set(args.rows.split(","))
    use_graphs = args.decode_graphs == "on" or (args.decode_graphs == "auto" and cuda)
    args.use_mixed = args.mixed_graphs == "on" or (args.mixed_graphs == "auto" and cuda)
    torch.manual_seed(args.seed)

    with tempfile.TemporaryDirectory(prefix="serving-bench-") as tmp:
        work = args.workdir or Path(tmp)
        return _run(args, work, device, dtype, prompt_len, output_len, counts, wanted, use_graphs)


def _run(args, work: Path, device: torch.device, dtype: torch.dtype, prompt_len, output_len,
         counts: list[int], wanted: set[str], use_graphs: bool) -> dict[str, Summary]:
    from inference_node.adapters.manager import AdapterManager
    from inference_node.adapters.slots import SlotBuffers
    from inference_node.adapters.sources import LocalDirSource
    from inference_node.model.config import ModelConfig
    from inference_node.model.llama import LlamaModel
    from inference_node.runner.launches import StepLaunches
    from kernels.tuning import tuning_from_text
    from inference_node.tuner.tune import node_table
    from kernels.tuning_table import ModelShape, StepTunings

    cuda = device.type == "cuda"
    COMPILES.install()
    started = time.perf_counter()
    model_arg = args.model or ("llama-1b-random" if cuda else "embedded")
    bench = bench_model(model_arg, work, dtype, device, args.seed)
    checkpoint, load_format, model_name = bench.checkpoint, bench.load_format, bench.description
    if load_format == "dummy" and "e" in wanted:
        log.warning("row e needs a checkpoint on disk for PEFT: skipped with random weights made at load")
        wanted.discard("e")
    cfg = ModelConfig.from_checkpoint(checkpoint)
    max_out, max_prompt = output_len[1], prompt_len[1]
    max_model_len = max_prompt + max_out + args.block_size
    per_seq = -(-(max_model_len + 1) // args.block_size)
    num_blocks = args.concurrency * per_seq + args.concurrency + 8

    # Adapters: pool of rank-16 all-projection adapters (rows c, e), rank-8 q/v ones (row d).
    adapter_root = work / "adapters"
    r16 = [f"r16-all-{k:03d}" for k in range(max(counts + [args.peft_adapters if "e" in wanted else 0]))]
    qv = [f"r8-qv-{k:03d}" for k in range(args.qv_adapters)] if "d" in wanted else []
    dirs: dict[str, Path] = {}
    gen_device = device if cuda else torch.device("cpu")
    for k, name in enumerate(r16):
        dirs[name] = adapter_root / name
        if not (dirs[name] / "adapter_model.safetensors").exists():
            write_random_adapter(dirs[name], cfg, 16, ALL_MODULES, seed=1000 + k, device=gen_device)
    for k, name in enumerate(qv):
        dirs[name] = adapter_root / name
        if not (dirs[name] / "adapter_model.safetensors").exists():
            write_random_adapter(dirs[name], cfg, 8, QV, seed=5000 + k, device=gen_device)
    os.sync()  # the written files' writeback must not run during the first timed row
    log.info("checkpoint and %d adapters ready in %.1fs", len(dirs), time.perf_counter() - started)

    bw = copy_bandwidth(device, (1 << 30) if cuda else (64 << 20))
    given = dict(item.split("=", 1) for item in args.tune)
    tuning = tuning_from_text(given)
    table = node_table(args.tuning_table, device, ModelShape.of(cfg), dtype, budget_s=0).table  # never tunes
    steps = table.tunings(tuning, fixed=given) if table is not None else StepTunings.fixed(tuning)
    log.info("tuning table: %s", table.path if table is not None else f"none ({args.tuning_table})")
    model = LlamaModel.load(checkpoint, device, dtype, max_positions=max_model_len,
                            gemm_groups=steps.base.gemm_groups, load_format=load_format)
    launches = StepLaunches(device, steps, model.gemm_groups)
    itemsize = dtype.itemsize
    abytes = {n: adapter_bytes_per_rank(cfg, 16, ALL_MODULES, itemsize) for n in r16}
    abytes |= {n: adapter_bytes_per_rank(cfg, 8, QV, itemsize) for n in qv}
    nbytes = StepBytes.of(cfg, itemsize, abytes)
    specs = make_specs(args.requests, prompt_len, output_len, cfg.vocab_size, args.poisson, args.seed)

    rows: list[Row] = []
    if "a" in wanted:
        rows.append(Row("a", "base, LoRA disabled", False, []))
    if "b" in wanted:
        rows.append(Row("b", "LoRA enabled, no adapter used", True, []))
    if "c" in wanted:
        for n in counts:
            rows.append(Row(f"c-{n}", f"{n} adapters r16, all 7 projections", True, r16[:n]))
    if "d" in wanted:
        rows.append(Row("d", f"{len(qv)} adapters r8, q,v only", True, qv))
    if len(args.prefill_delay_factor) > 1:  # side by side: each engine row once per factor
        rows = [dataclasses.replace(r, key=f"{r.key}@{f:g}", label=f"{r.label[:26]}, delay {f:g}", delay=f)
                for r in rows for f in args.prefill_delay_factor]
    control = Row("a2", "base again, after b-d (control)", False, []) if args.control and "a" in wanted else None
    if "e" in wanted:
        rows.append(Row("e", f"HF PEFT generate, {args.peft_adapters} x r16 all 7", False,
                        r16[:args.peft_adapters], peft=True))

    device_name = torch.cuda.get_device_name(device) if cuda else "CPU"
    header = [
        f"device: {device_name}  torch {torch.__version__}  dtype {str(dtype).removeprefix('torch.')}  "
        f"copy bandwidth (D2D, read+write): {bw / 1e9:.1f} GB/s",
        f"model: {model_name}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_heads}/"
        f"{cfg.num_kv_heads} heads, vocab {cfg.vocab_size}, {nbytes.weights / 1e9:.3f} GB of weights read "
        f"per decode step",
        f"workload: {args.requests} requests, prompt {prompt_len[0]}-{prompt_len[1]} tokens, output "
        f"{output_len[0]}-{output_len[1]} tokens (ignore EOS), " + (
            f"open loop Poisson {args.poisson} req/s, Zipf({args.zipf_alpha}) adapter popularity, "
            f"at most {args.concurrency} running" if args.poisson else
            f"closed loop at concurrency {args.concurrency}, request i -> adapter i mod N"),
        f"engine: max_num_seqs {args.concurrency}, {args.max_batched_tokens} tokens per step, "
        f"{num_blocks} KV blocks of {args.block_size}, prefix cache "
        f"{'on' if args.prefix_caching else 'off'}, decode graphs {'on' if use_graphs else 'off'}, "
        f"piecewise graphs for other steps {'on' if args.use_mixed else 'off'}; "
        f"adapter bytes: r16 all 7 = {abytes[r16[0]] / 1e6 if r16 else 0:.2f} MB"
        + (f", r8 q,v = {abytes[qv[0]] / 1e6:.2f} MB" if qv else ""),
    ]
    for line in header:
        print(line, flush=True)

    results: dict[str, list[RowResult]] = {}

    def run_guarded(row: Row, fn: Callable[[], RowResult]) -> None:
        t = time.perf_counter()
        try:
            result = fn()
        except Exception as exc:  # one broken row must not lose the others
            log.exception("row %s failed", row.key)
            result = RowResult(row.key, row.label, error=f"{type(exc).__name__}: {exc}"[:200])
        results.setdefault(row.key, []).append(result)
        s = summarize(result, nbytes, bw)
        log.info("row %s done in %.1fs: %s", row.key, time.perf_counter() - t, format_row(s))
        print(f"# {format_row(s)}", file=sys.stderr, flush=True)

    def release() -> None:
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()

    # (a) LoRA disabled: its own engine. (b, c, d) one engine with a slot for every adapter,
    # all pinned before timing. Both live through every round, so with --rounds N the rows
    # take turns N times and drift of the machine lands on all of them alike.
    base_rows = [r for r in rows if not r.lora and not r.peft]
    lora_rows = [r for r in rows if r.lora]
    engines: dict[str, object] = {}
    manager = None
    if base_rows:
        engines["base"] = build_engine(model, None, args, max_model_len, num_blocks, use_graphs, args.use_mixed, launches)
    if lora_rows:
        names = list(dict.fromkeys(n for r in lora_rows for n in r.pool))
        slots = max(len(names), 1)
        buffers = SlotBuffers(cfg, slots, 16, dtype, device)
        # Host copies of slot-resident adapters are only a cache: on CPU keep one (memory).
        manager = AdapterManager(buffers, LocalDirSource(adapter_root, cfg, 16),
                                 max_cpu_loras=slots if cuda else 1, pin_host_memory=cuda)
        log.info("LoRA: %d slots, %.2f GB", slots, buffers.nbytes() / 1e9)
        try:
            engines["lora"] = build_engine(model, manager, args, max_model_len, num_blocks, use_graphs, args.use_mixed, launches)
            t = time.perf_counter()
            preload_adapters(engines["lora"], manager, names)
            log.info("%d adapters pinned in slots in %.1fs", len(names), time.perf_counter() - t)
        except Exception as exc:
            log.exception("LoRA engine failed")
            engines.pop("lora", None)
            for row in lora_rows:
                results[row.key] = [RowResult(row.key, row.label, error=f"{type(exc).__name__}: {exc}"[:200])]
            lora_rows = []
    for rnd in range(args.rounds):
        if args.rounds > 1:
            log.info("round %d of %d", rnd + 1, args.rounds)
        for row in base_rows + lora_rows:
            engine = engines["lora" if row.lora else "base"]
            run_guarded(row, lambda row=row, engine=engine: run_engine_row(row, engine, specs, args, device))
    if manager is not None:
        manager.shutdown()
    engines = engine = manager = buffers = None
    release()

    if control is not None:  # row a again, on a fresh engine: what order and drift alone do
        rows.insert(rows.index(next(r for r in rows if r.key == "a")) + 1, control)
        engine = build_engine(model, None, args, max_model_len, num_blocks, use_graphs, args.use_mixed, launches)
        run_guarded(control, lambda: run_engine_row(control, engine, specs, args, device))
        engine = None
        release()
    del model
    release()
    for row in (r for r in rows if r.peft):
        run_guarded(row, lambda row=row: run_peft_row(row, checkpoint, dirs, specs, args, device, dtype))

    per_round = {row.key: [summarize(r, nbytes, bw) for r in results[row.key]] for row in rows}
    summaries = {key: median_summary(runs) for key, runs in per_round.items()}
    print()
    print(HEADER)
    print(UNITS)
    print("-" * len(HEADER))
    for row in rows:
        print(format_row(summaries[row.key]))
    print("-" * len(HEADER))
    read_32 = 32 * adapter_bytes_per_rank(cfg, 16, ALL_MODULES, itemsize) / bw
    for line in ratios(summaries, read_32, "c-32"):
        print(line)
    if args.rounds > 1:
        print(f"rounds: {args.rounds}, rows a-d interleaved in each; every column is the median over "
              f"rounds. decode tok/s per round:")
        for key, runs in per_round.items():
            if len(runs) > 1:
                print(f"  {key:<6} " + "  ".join(f"{r.decode_tps:9.1f}" for r in runs))
    print("JIT compiles during timed runs (Triton kernels, torch.compile graphs; each stalls the step "
          "it lands in): " + ", ".join(f"{k} {sum(len(r.compiles) for r in results.get(k, []))}"
                                      for k in summaries if k != "e"))
    graphs = {k: s.graph_steps for k, s in summaries.items() if s.graph_steps is not None}
    if graphs:
        print("decode steps replayed from CUDA graphs: " + ", ".join(
            f"{k} {g}/{summaries[k].decode_steps}" for k, g in graphs.items()))
    others = {k: (s.piecewise_steps, s.eager_steps) for k, s in summaries.items() if s.eager_steps is not None}
    if others:
        print("other steps (prompt chunks, maybe beside decodes), replayed piece by piece / eager: " + ", ".join(
            f"{k} {p}/{e}" for k, (p, e) in others.items()))
    print(f"decode columns: pure-decode steps only; decode tok/s leaves out the steps whose call also "
          f"launched a prefill chunk (its host work is prefill's, in e2e); step = one Engine.run_once (schedule and launch "
          f"step n+1, then wait for and stream step n), charged to step n, host time, no extra sync; fwd = the forward on "
          f"the device (CUDA events around graph replay or eager forward, queued behind step n); host = "
          f"step minus the wait for sampled tokens; floor = (weights + distinct adapters' A,B + KV attended) / "
          f"copy bandwidth; 'x floor' = p50 of step/floor. e: static batches of {args.concurrency}, "
          f"TTFT taken as if generate streamed. warm-up per row: {args.warmup}; "
          f"total {time.perf_counter() - started:.0f}s")
    if args.json:
        args.json.write_text(json.dumps({
            "header": header, "rows": {k: dataclasses.asdict(s) for k, s in summaries.items()},
            "rounds": {k: [dataclasses.asdict(r) for r in runs] for k, runs in per_round.items()},
            "copy_bandwidth": bw}, indent=2, default=str))
    return summaries


if __name__ == "__main__":
    main()
