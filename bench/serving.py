"""Serving benchmark: the node with LoRA off, on but unused, and with many adapters, next to
Hugging Face PEFT's mixed-adapter generate, on the same requests, in one table; each row in
process and, when asked, through the served node's gRPC and HTTP APIs.

    python -m bench.serving                              # CUDA: Llama-3.2-1B shapes, random bf16 weights
    python -m bench.serving --device cpu                 # CPU: the embedded SmolLM2, small settings
    python -m bench.serving --model qwen3-8b-random --rows a,c,d --adapter-counts 32 --paths engine,grpc
    python -m bench.serving --model llama-8b-random --quantization fp8   # FP8 projections
    python -m bench.serving --model llama-8b-random --quantization fp8-w8a8
    python -m bench.serving --model llama-8b-random --rows a,c,p --adapter-counts 32 --quantization none,fp8-w8a8
    python -m bench.serving --model qwen3-30b-a3b-random --rows a,c --adapter-counts 32 --expert-adapters 8
    python -m bench.serving --poisson 20 --rounds 3      # open loop, Zipf popularity; rows take turns: medians
    python -m bench.serving --paths engine,grpc,http --rows b,c --adapter-counts 32 --api-processes 2

Rows (every one runs the same requests):
  a     base model, LoRA disabled (--max-loras 0)
  b     LoRA enabled (adapter memory for every row's adapters), no request uses an adapter
  c-N   N distinct adapters of rank 16 on all seven projections (--adapter-counts)
  d     32 adapters of rank 8 on q_proj and v_proj only
  e     Hugging Face PEFT: one PeftModel holding the adapters of c-32, generate(adapter_names=...)
  p     prefill: the requests' prompts alone (one new token each) on the base node: prompt tok/s
  x-N   (--expert-adapters N, a mixture of experts) N adapters of rank 16 on q,k,v,o and every
        routed expert (rows c there: q,k,v,o only), on a node of their own after the others
With several --quantization values every row runs once per value, on nodes of its own, and a
last table sets their base step, c-32's extra and prefill side by side.
Paths (rows a-d, p): engine, the node in this process (`LLM`) driven by `Engine.run_once`; grpc
and http, the same NodeConfig served by `inference-node serve`, driven by --clients processes
(Generate streams; /v1/completions streamed). Adapters are pinned in GPU adapter memory and
every row is warmed up (--warmup) before timing. Columns: docs/PERFORMANCE.md; on the engine
path, the decode step's p50 beside its floor (the bytes it must read over the copy bandwidth).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import math
import multiprocessing
import os
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from bench.driver import DecodeStep, Driver, ReqRecord
from bench.harness import (ALL_MODULES, ATTENTION_MODULES, QV, STEP_KINDS, Col, NodeProcess, Spec, StepBytes, Table,
                           adapter_bytes_per_rank, add_by_device, add_common_args, add_node_args, assign_adapters,
                           bench_model, build_llm, copy_bandwidth, device_line, dtype_name, engine_options, error_text,
                           expert_lora_bytes_per_rank,
                           kv_bytes_per_token, make_specs, medians, model_config, node_config, parse_range, pct,
                           release_memory, runtime, sync, timed_region, verdict, write_adapters, write_json)

log = logging.getLogger("bench.serving")
PATHS = ("engine", "grpc", "http")
NODES = ("base", "lora", "experts")  # a node per kind of row (Row.node)
QUANTIZATIONS = ("none", "fp8", "fp8-w8a8")


@dataclass
class Row:
    key: str
    label: str
    node: str                   # base (LoRA off), lora, or experts (expert arenas: rows x)
    pool: list[str]             # adapter names (empty: every request uses the base model)
    prompts_only: bool = False  # row p: one new token a request, so its time is the prompts'

    def requests(self, specs: list[Spec], args) -> list[Spec]:
        """The workload on this row's adapters: in turn, or (--poisson) by Zipf popularity."""
        specs = [dataclasses.replace(s, max_tokens=1) for s in specs] if self.prompts_only else specs
        return assign_adapters(specs, self.pool, args.zipf_alpha if args.poisson else None)


@dataclass
class RowResult:
    key: str
    path: str
    label: str
    records: list[ReqRecord] = field(default_factory=list)
    steps: list[DecodeStep] = field(default_factory=list)
    step_kinds: dict[str, int] = field(default_factory=dict)  # the node's steps by kind during the timed run
    compiles: list[str] = field(default_factory=list)         # JIT compiles during the timed run (engine path)
    error: str | None = None
    prompt_tokens: int = 0


# -- the engine in process --------------------------------------------------------------------------
def run_engine_row(row: Row, llm, specs: list[Spec], args) -> RowResult:
    engine, device = llm.engine, llm.node.model.device
    result, specs = RowResult(row.key, "engine", row.label), row.requests(specs, args)
    # Untimed: "full" runs the row's whole workload once (every shape the timed run meets, so no Triton
    # compile lands in it); "short" one batch of few tokens; "engine" nothing (the node's warm-up ran).
    if args.warmup == "full":
        Driver(engine, device, args.concurrency, poisson=bool(args.poisson)).run(specs)
    elif args.warmup == "short":
        Driver(engine, device, args.concurrency, poisson=False).run(
            specs[:args.concurrency], lambda s: min(args.warmup_tokens, s.max_tokens))
    driver = Driver(engine, device, args.concurrency, poisson=bool(args.poisson))
    before = dict(engine.stats.__dict__)
    with timed_region(f"row {row.key}", log) as result.compiles:
        result.records, result.steps = driver.run(specs)
    result.step_kinds = {k: engine.stats.__dict__[s] - before[s] for k, s in STEP_KINDS.items()}
    result.prompt_tokens = sum(len(s.prompt) for s in specs)
    return result


# -- the served node: client processes of gRPC and of the OpenAI-compatible HTTP API -----------------
def client_process(api: str, target: str, model: str, requests: list[Spec], concurrency: int,
                   poisson: bool, ready, start, results) -> None:
    """Sends its requests (closed loop at `concurrency`, or at their arrival times), puts their records on `results`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    client = _grpc_client if api == "grpc" else _http_client
    results.put(asyncio.run(client(target, model, requests, concurrency, poisson, ready, start)))


async def _drive(requests: list[Spec], concurrency: int, poisson: bool, start, one) -> list[ReqRecord]:
    await asyncio.get_running_loop().run_in_executor(None, start.wait)
    t0 = time.monotonic()
    gate = asyncio.Semaphore(concurrency if not poisson else max(len(requests), 1))

    async def timed(req: Spec) -> ReqRecord:
        if poisson:
            await asyncio.sleep(max(0.0, t0 + req.arrival - time.monotonic()))
        async with gate:
            rec = ReqRecord(submit=t0 + req.arrival if poisson else time.monotonic())
            await one(req, rec)
            rec.done = time.monotonic()
            return rec

    return await asyncio.gather(*(timed(r) for r in requests))


def _token(rec: ReqRecord, count: int) -> None:
    now = time.monotonic()
    rec.first, rec.last = rec.first or now, now
    rec.tokens += count


async def _grpc_client(target, model, requests, concurrency, poisson, ready, start) -> list[ReqRecord]:
    """One connection, a Generate stream per request."""
    import grpc

    from lora.v1 import inference_pb2 as pb
    from lora.v1 import inference_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
        stub = pb_grpc.InferenceNodeStub(channel)
        async for _ in stub.Generate(pb.GenerateRequest(prompt_token_ids=[1000, 1001], max_tokens=1)):
            pass
        ready.set()

        async def one(req: Spec, rec: ReqRecord) -> None:
            try:
                async for msg in stub.Generate(pb.GenerateRequest(
                        prompt_token_ids=req.prompt, max_tokens=req.max_tokens, adapter=req.adapter,
                        ignore_eos=True), timeout=600):
                    if msg.token_ids:
                        _token(rec, len(msg.token_ids))
            except grpc.aio.AioRpcError as exc:
                rec.error = f"{exc.code().name}: {exc.details()}"

        return await _drive(requests, concurrency, poisson, start, one)


async def _http_client(target, model, requests, concurrency, poisson, ready, start) -> list[ReqRecord]:
    """POST /v1/completions streamed, a connection per request in flight; the tokens counted
    from the last chunk's usage, the first and last token from the chunks carrying text."""
    import httpx

    url = f"{target}/completions"
    limits = httpx.Limits(max_connections=max(concurrency, 1), max_keepalive_connections=max(concurrency, 1))
    async with httpx.AsyncClient(limits=limits, timeout=600) as http:
        (await http.post(url, json={"model": model, "prompt": [1000, 1001], "max_tokens": 1})).raise_for_status()
        ready.set()

        async def one(req: Spec, rec: ReqRecord) -> None:
            body = {"model": req.adapter or model, "prompt": req.prompt, "max_tokens": req.max_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            try:
                async with http.stream("POST", url, json=body) as reply:
                    if reply.status_code != 200:
                        rec.error = f"HTTP {reply.status_code}: {(await reply.aread()).decode()[:200]}"
                    async for line in reply.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        event = json.loads(line[6:])
                        if "error" in event:
                            rec.error = event["error"]["message"]
                        elif event["choices"] and event["choices"][0]["text"]:
                            _token(rec, 0)
                        if event.get("usage"):
                            rec.tokens = event["usage"]["completion_tokens"]
            except httpx.HTTPError as exc:
                rec.error = f"{type(exc).__name__}: {exc}"

        return await _drive(requests, concurrency, poisson, start, one)


def run_clients(api: str, target: str, model: str, requests: list[Spec], concurrency: int,
                clients: int, poisson: bool) -> list[ReqRecord]:
    """The requests shared round robin over `clients` processes, `concurrency` split among them."""
    ctx = multiprocessing.get_context("spawn")
    start, results = ctx.Event(), ctx.Queue()
    clients = max(1, min(clients, len(requests)))
    readies = [ctx.Event() for _ in range(clients)]
    procs = [ctx.Process(target=client_process, args=(api, target, model, requests[i::clients], max(
        concurrency // clients + (i < concurrency % clients), 1), poisson, readies[i], start, results))
             for i in range(clients)]
    for p in procs:
        p.start()
    if not all(ready.wait(120) for ready in readies):
        raise RuntimeError("a client process did not connect")
    start.set()
    records = [rec for _ in procs for rec in results.get(timeout=3600)]
    for p in procs:
        p.join(30)
    return records


def run_served_row(row: Row, api: str, node: NodeProcess, model: str, specs: list[Spec], args) -> RowResult:
    poisson, requests = bool(args.poisson), row.requests(specs, args)
    target = node.target if api == "grpc" else node.http_url
    if args.warmup == "full":
        run_clients(api, target, model, requests, args.concurrency, args.clients, poisson)
    elif args.warmup == "short":
        warm = [dataclasses.replace(r, max_tokens=min(args.warmup_tokens, r.max_tokens)) for r in requests]
        run_clients(api, target, model, warm[:args.concurrency], args.concurrency, args.clients, False)
    before = node.steps()
    records = run_clients(api, target, model, requests, args.concurrency, args.clients, poisson)
    errors = [r.error for r in records if r.error]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, first: {errors[0]}")
    after = node.steps()
    return RowResult(row.key, api, row.label, records, step_kinds={k: after[k] - before[k] for k in after},
                     prompt_tokens=sum(len(r.prompt) for r in requests))


# -- Hugging Face PEFT --------------------------------------------------------------------------------
def run_peft_row(row: Row, checkpoint: Path, adapter_root: Path, specs: list[Spec], args,
                 device: torch.device, dtype: torch.dtype) -> RowResult:
    """PEFT's mixed-adapter generate: static batches of up to `concurrency` requests, one
    PeftModel holding every adapter of the row, adapter_names= per request."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    result = RowResult(row.key, "peft", row.label)
    base = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).to(device).eval()
    names = list(dict.fromkeys(row.pool))
    model = PeftModel.from_pretrained(base, adapter_root / names[0], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapter_root / name, adapter_name=name)
    model.eval()
    poisson, specs = bool(args.poisson), row.requests(specs, args)

    class Stamp(LogitsProcessor):
        """Called once per generated token position, after that step's forward."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            sync(device)
            self.times.append(time.perf_counter())
            return scores

    def generate(batch: list[Spec], new_tokens: int) -> list[float]:
        width = max(len(s.prompt) for s in batch)  # left padding:
        ids = torch.tensor([[0] * (width - len(s.prompt)) + s.prompt for s in batch])
        mask = torch.tensor([[0] * (width - len(s.prompt)) + [1] * len(s.prompt) for s in batch])
        stamp = Stamp()
        with torch.inference_mode():
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                 adapter_names=[s.adapter for s in batch], max_new_tokens=new_tokens,
                                 do_sample=False, eos_token_id=None, pad_token_id=0,
                                 logits_processor=LogitsProcessorList([stamp]))
        sync(device)
        if out.shape[1] - width != new_tokens:
            raise RuntimeError(f"PEFT generated {out.shape[1] - width} tokens, not {new_tokens}")
        return stamp.times

    generate(specs[:min(2, len(specs))], 2)  # warm-up
    records = [ReqRecord() for _ in specs]
    order = sorted(range(len(specs)), key=lambda i: (specs[i].arrival, i))
    t0, pos = time.perf_counter(), 0
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
        adapters = frozenset(s.adapter for s in batch)
        for k in range(1, len(times)):
            kv = sum(len(s.prompt) + k + 1 for s in batch)
            result.steps.append(DecodeStep(times[k] - times[k - 1], len(batch), adapters, kv))
    result.records = records
    return result


# -- the table -------------------------------------------------------------------------------------------
@dataclass
class Summary:
    key: str
    path: str
    label: str
    error: str | None = None
    decode_tps: float = math.nan
    e2e_tps: float = math.nan
    prefill_tps: float = math.nan   # prompt tokens over the same span as e2e_tps (row p: prefill alone)
    ttft_p50: float = math.nan
    ttft_p99: float = math.nan
    tpot_p50: float = math.nan
    tpot_p99: float = math.nan
    step_p50: float = math.nan
    forward_p50: float = math.nan
    host_p50: float = math.nan
    floor_p50: float = math.nan
    over_floor: float = math.nan
    batch: float = math.nan
    adapters_per_step: float = math.nan
    decode_steps: int = 0
    # decode_tps counts the decode steps whose call launched no prompt step (that launch's host work, an
    # eager 2048-token forward: 12-55 ms on an H100, is prefill's, in e2e tok/s); all_steps_tps all of them.
    steady_steps: int = 0
    all_steps_tps: float = math.nan
    output_tokens: int = 0
    step_kinds: dict = field(default_factory=dict)
    compiles: list = field(default_factory=list)
    step_seconds: list = field(default_factory=list)   # per decode step, in order (--json)
    step_boundary: list = field(default_factory=list)


def summarize(res: RowResult, nbytes: StepBytes, bw: float) -> Summary:
    s = Summary(res.key, res.path, res.label, res.error)
    if res.error:
        return s
    recs, s.compiles, s.step_kinds = res.records, list(res.compiles), dict(res.step_kinds)
    s.output_tokens = sum(r.tokens for r in recs)
    span = max(r.done for r in recs) - min(r.submit for r in recs)
    s.e2e_tps, s.prefill_tps = s.output_tokens / span, res.prompt_tokens / span
    ttft = [r.first - r.submit for r in recs]
    tpot = [(r.last - r.first) / (r.tokens - 1) for r in recs if r.tokens > 1]
    s.ttft_p50, s.ttft_p99, s.tpot_p50, s.tpot_p99 = pct(ttft, 50), pct(ttft, 99), pct(tpot, 50), pct(tpot, 99)
    steps = res.steps
    if steps:
        s.decode_steps = len(steps)
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
    return s


def median_summary(runs: list[Summary]) -> Summary:
    """One row over several rounds: each numeric column's median (the first error, if any)."""
    failed = [r for r in runs if r.error]
    if len(runs) == 1 or failed:
        return (failed or runs)[0]
    return Summary(**medians([dataclasses.asdict(r) for r in runs]))


MS = dict(fmt=".2f", unit="ms", scale=1e3)
TABLE = Table(Col("row", 6), Col("path", 6), Col("what", 34), Col("decode", 9, ".1f", "tok/s"),
              Col("e2e", 9, ".1f", "tok/s"), Col("TTFT p50", 9, ".1f", "ms", 1e3), Col("p99", 8, ".1f", "ms", 1e3),
              Col("TPOT p50", 9, **MS), Col("p99", 8, **MS), Col("step p50", 9, **MS), Col("fwd p50", 8, **MS),
              Col("host p50", 8, **MS), Col("floor", 8, ".3f", "ms", 1e3), Col("x floor", 8, ".2f", suffix="x"),
              Col("batch", 6, ".1f"), Col("adp/st", 6, ".1f"))


def format_row(s: Summary) -> str:
    if s.error:
        return f"{s.key:<6} {s.path:<6} {s.label:<34} FAILED: {s.error}"
    return TABLE.row(s.key, s.path, s.label, s.decode_tps, s.e2e_tps, s.ttft_p50, s.ttft_p99, s.tpot_p50, s.tpot_p99,
                     s.step_p50, s.forward_p50, s.host_p50, s.floor_p50, s.over_floor, s.batch, s.adapters_per_step)


def ratios(by: dict[str, Summary], reads: dict[str, float]) -> list[str]:
    """The engine rows' targets (issue 33's), each with what was measured (`by`: the rows that
    ran); reads: the seconds c-32's and each x row's adapters take to read at copy bandwidth."""
    a, a2, b, d, e = (by.get(key) for key in ("a", "a2", "b", "d", "e"))
    lines = []
    if a and a2:
        lines.append(f"control a2/a (same node setup, run after b-d): decode {a2.decode_tps / a.decode_tps:.3f}, "
                     f"end-to-end {a2.e2e_tps / a.e2e_tps:.3f}, step {a2.step_p50 * 1e3:.2f} vs "
                     f"{a.step_p50 * 1e3:.2f} ms")
    for x, target in ((b, 0.97), (d, 0.95)):
        if a and x:
            r = x.decode_tps / a.decode_tps
            lines.append(f"{x.key}/a throughput: decode {r:.3f}, end-to-end {x.e2e_tps / a.e2e_tps:.3f}  (target >= "
                         f"{target}: {verdict(r, r >= target)}); all decode steps "
                         f"{x.all_steps_tps / a.all_steps_tps:.3f} "
                         f"({a.steady_steps}/{a.decode_steps} and {x.steady_steps}/{x.decode_steps} steady), "
                         f"by step p50 {a.step_p50 / x.step_p50:.3f}")
    for x, read in ((by[k], read) for k, read in reads.items() if a and k in by):
        r, c32 = (x.step_p50 - a.step_p50) / read, x.key == "c-32"
        target = f"target <= 1.25: {verdict(r, r <= 1.25)}; " if c32 else ""  # (rows x: none yet)
        lines.append(("" if c32 else f"{x.key}/a decode throughput {x.decode_tps / a.decode_tps:.3f}; ")
                     + f"{x.key} extra decode step over a: {(x.step_p50 - a.step_p50) * 1e3:.3f} ms; reading its "
                     f"adapters' A and B{'' if c32 else ' (of the experts hit, routing uniform)'} at copy bandwidth: "
                     f"{read * 1e3:.3f} ms; ratio {r:.2f}  ({target}{x.adapters_per_step:.1f} adapters per decode "
                     "step)")
    if p := by.get("p"):
        lines.append(f"p: prefill {p.prefill_tps:.0f} prompt tok/s, TTFT p50 {p.ttft_p50 * 1e3:.1f} ms, p99 "
                     f"{p.ttft_p99 * 1e3:.1f} (the rows' prompts, one new token each)")
    if a:
        lines.append(f"a decode step / its floor: {a.over_floor:.2f}x  (target <= 1.15: "
                     f"{verdict(a.over_floor, a.over_floor <= 1.15)})")
    lora = [s for k, s in by.items() if k not in ("a", "a2", "e", "p")]
    if e and lora:
        worst = min(lora, key=lambda s: s.e2e_tps)
        r = worst.e2e_tps / e.e2e_tps
        lines.append(f"slowest LoRA row ({worst.key}) / PEFT (e): end-to-end {r:.1f}x, decode (slowest) "
                     f"{min(s.decode_tps for s in lora) / e.decode_tps:.1f}x  (target >= 20x: {verdict(r, r >= 20)})")
    return lines


def path_ratios(summaries: dict[tuple[str, str], Summary]) -> list[str]:
    """Each served row against the same row in process (gRPC; issue 29's targets) and HTTP
    against gRPC."""
    lines = []
    for (key, path), s in summaries.items():
        ref = summaries.get((key, "engine" if path == "grpc" else "grpc"))
        if path not in ("grpc", "http") or ref is None or s.error or ref.error:
            continue
        tps, ttft, tpot = s.e2e_tps / ref.e2e_tps, (s.ttft_p50 - ref.ttft_p50) * 1e3, s.tpot_p50 / ref.tpot_p50
        if path == "grpc":
            lines.append(f"{key}: grpc/engine tok/s {tps:.3f} (target >= 0.9: {verdict(tps, tps >= 0.9)}), TTFT p50 "
                         f"{ttft:+.1f} ms (target <= +15: {verdict(ttft, ttft <= 15)}), TPOT p50 x{tpot:.3f} "
                         f"(target <= 1.1: {verdict(tpot, tpot <= 1.1)})")
        else:
            lines.append(f"{key}: http/grpc tok/s {tps:.3f}, TTFT p50 {ttft:+.1f} ms, TPOT p50 x{tpot:.3f}")
    return lines


# -- main --------------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, ("llama-1b-random", "embedded"))
    p.add_argument("--paths", default="engine", help="comma-separated: engine (in process), grpc, http (served)")
    p.add_argument("--rows", default="a,b,c,d,e", help="which rows to run")
    add_by_device(p, "--requests", 128, 8, "requests per row", type=int)
    add_by_device(p, "--concurrency", 64, 4, "closed-loop requests in flight = the node's max_num_seqs = PEFT batch",
                  type=int)
    add_by_device(p, "--prompt-len", "32:256", "8:32", "LO:HI tokens, uniform")
    add_by_device(p, "--output-len", "128", "8", "LO:HI tokens, uniform")
    p.add_argument("--poisson", type=float, default=None, metavar="RATE",
                   help="open loop: Poisson arrivals at RATE requests/s, Zipf adapter popularity")
    p.add_argument("--zipf-alpha", type=float, default=1.0)
    p.add_argument("--adapter-counts", default="1,8,32,128", help="rows c: distinct rank-16 adapters")
    p.add_argument("--qv-adapters", type=int, default=32, help="row d: rank-8 q/v adapters")
    p.add_argument("--peft-adapters", type=int, default=32, help="row e: the first N adapters of rows c")
    p.add_argument("--expert-adapters", type=int, default=0, metavar="N", help="row x-N: N rank-16 adapters on "
                   "q,k,v,o and every routed expert of a mixture of experts (Qwen3-30B-A3B: 2 GB each)")
    p.add_argument("--quantization", default="none",
                   help="comma-separated, of none, fp8, fp8-w8a8: as `inference-node serve --quantization` (an FP8 "
                        "checkpoint is FP8 without it; the floor counts its projections at 1 byte a weight plus "
                        "their scales); several: the rows run once for each, then a table sets them side by side")
    add_node_args(p)
    p.add_argument("--prefix-caching", action="store_true", help="keep the prefix cache on (off: rows share prompts)")
    p.add_argument("--prefill-delay-factor", type=float, default=0.0, help="the node's (x the last prefill step)")
    p.add_argument("--rounds", type=int, default=1, help="engine rows a-d this many times, interleaved: medians")
    p.add_argument("--control", action="store_true", help="run row a again after rows b-d (a2) on a fresh node")
    add_by_device(p, "--warmup", "full", "short", "per row, untimed: its whole workload (compiles every shape), one "
                  "batch of --warmup-tokens tokens, or only the node's start-up warm-up",
                  choices=["full", "short", "engine"])
    p.add_argument("--warmup-tokens", type=int, default=4)
    p.add_argument("--clients", type=int, default=4, help="client processes of each API (grpc, http paths)")
    p.add_argument("--api-processes", default="auto", help="the served node's front-end processes")
    p.add_argument("--tune", action="append", default=[], metavar="NAME=VALUE",
                   help="a launch choice other than the node's default (kernels/tuning.py), repeatable")
    p.add_argument("--tuning-table", default="auto", help="as `inference-node serve --tuning-table`")
    p.add_argument("--tune-budget", type=float, default=0.0,
                   help="seconds each node may tune its kernels at start without a table (0: never)")
    args = p.parse_args(argv)
    args.paths = [x for x in args.paths.split(",") if x]
    if set(args.paths) - set(PATHS):
        p.error(f"--paths: choose from {', '.join(PATHS)}")
    args.quantization = list(dict.fromkeys(q for q in args.quantization.split(",") if q))
    if not args.quantization or set(args.quantization) - set(QUANTIZATIONS):
        p.error(f"--quantization: comma-separated, from {', '.join(QUANTIZATIONS)}")
    return args


def tuning_line(llm, which: str, build_s: float) -> str:
    """Where the node's tuning table came from and what it cost: a seed (kernels/configs), or
    a table tuned on a host (at this start where the node's build time holds its sweep's)."""
    from kernels.tuning_table import CONFIG_DIR

    table = llm.engine.runner.launches.tunings.table
    if table is None:
        return f"tuning table ({which} node): none, default launch choices; node built in {build_s:.0f} s"
    seed = table.path is not None and table.path.resolve().parent == CONFIG_DIR
    return (f"tuning table ({which} node): {table.path} ({'the seed' if seed else 'not a seed'}, {len(table.buckets)} "
            f"buckets, its sweep took {table.tuning_s or 0:.0f} s); node built in {build_s:.0f} s")


def memory_line(llm, kv_block: int, which: str) -> str:
    """The node's weights as loaded on its device, the KV blocks a GB of what they leave holds
    (bf16 against --quantization fp8 is read off two runs' lines; the rows' KV cache itself is
    sized to the workload, to time alike), a LoRA node's adapter memory and what it holds."""
    model = llm.node.model
    device_total = torch.cuda.get_device_properties(model.device).total_memory if model.device.type == "cuda" else 0
    free = (f"; at --gpu-memory-utilization 0.9 of {device_total / 1e9:.1f} GB, "
            f"{(0.9 * device_total - model.weight_bytes()) / kv_block:.0f} KV blocks beside the weights "
            "(before adapters and activations)" if device_total else "")
    if (manager := llm.node.adapters) is not None:  # what its adapter memory holds, the rows' adapters pinned
        held, memory = [i for i, e in enumerate(manager.slots) if e is not None], manager.buffers
        free += (f"; adapter memory {memory.nbytes() / 1e9:.3f} GB (expert arenas {memory.experts.nbytes() / 1e9:.3f}"
                 f" GB): {len(held)} adapters, {sum(memory.experts.of(s) is not None for s in held)} with expert LoRA")
    return (f"weights ({which} node): {model.weight_bytes() / 1e9:.3f} GB on the device"
            f"{' with FP8 projections' if model.fp8_projections else ''}; a KV block of "
            f"{llm.node.config.cache.block_size} tokens is {kv_block / 1e6:.3f} MB{free}")


def main(argv: Sequence[str] | None = None) -> dict[tuple[str, str], Summary]:
    args = parse_args(argv)
    device, dtype = runtime(args)
    log.setLevel(logging.INFO)
    args.prompt_len, args.output_len = parse_range(args.prompt_len), parse_range(args.output_len)
    torch.manual_seed(args.seed)
    runs, several = {}, len(args.quantization) > 1
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as tmp:
        for q in args.quantization:  # one after another: a node's weights leave the device before the next's
            json_path = args.json.with_suffix(f".{q}.json") if several and args.json else args.json
            runs[q] = _run(argparse.Namespace(**{**vars(args), "quantization": q, "json": json_path}),
                           args.workdir or Path(tmp), device, dtype)
    if several:
        print("\n--quantization side by side (engine path; x first: against the first's)")
        QUANT_TABLE.print(quantization_rows(runs))
    first = args.quantization[0]  # its rows keep their keys; the others' are suffixed /quantization
    return {(k if q == first else f"{k}/{q}", p): s for q, run in runs.items() for (k, p), s in run.items()}


QUANT_TABLE = Table(Col("quantization", 12), Col("a step", 8, **MS), Col("x first", 7, ".3f"),
                    Col("a floor", 8, **MS), Col("a", 9, ".1f", "tok/s"), Col("c-32", 9, ".1f", "tok/s"),
                    Col("c-32 extra", 10, **MS), Col("prefill", 9, ".0f", "tok/s"), Col("x first", 7, ".3f"))


def quantization_rows(runs: dict[str, dict[tuple[str, str], Summary]]) -> list[tuple]:
    """Each --quantization's engine rows a, c-32 and p (issue 57's comparison: the base step, the
    LoRA extra and prefill against the first value's, bf16 where it is `none`); NaN where a row
    did not run or failed."""
    col = lambda run, key, attr: getattr(run.get((key, "engine")), attr, math.nan)  # noqa: E731
    first = runs[next(iter(runs))]
    a0, p0 = col(first, "a", "step_p50"), col(first, "p", "prefill_tps")
    return [(q, col(r, "a", "step_p50"), col(r, "a", "step_p50") / a0, col(r, "a", "floor_p50"),
             col(r, "a", "decode_tps"), col(r, "c-32", "decode_tps"),
             col(r, "c-32", "step_p50") - col(r, "a", "step_p50"), col(r, "p", "prefill_tps"),
             col(r, "p", "prefill_tps") / p0) for q, r in runs.items()]


def _run(args, work: Path, device: torch.device, dtype: torch.dtype) -> dict[tuple[str, str], Summary]:
    from inference_node.config import GB, count_or_auto
    from kernels.tuning import tuning_from_text

    cuda, started = device.type == "cuda", time.perf_counter()
    cfg = model_config(args.model)
    if args.expert_adapters and not cfg.num_experts:
        raise SystemExit(f"--expert-adapters: {args.model} is not a mixture of experts (e.g. qwen3-30b-a3b-random)")
    model = bench_model(args.model, work, dtype, device, args.seed)
    wanted = set(args.rows.split(",")) - {"x"} | ({"x"} if args.expert_adapters else set())  # x: --expert-adapters
    if model.load_format == "dummy" and "e" in wanted:
        log.warning("row e needs weights on disk for PEFT: skipped with weights made at load")
        wanted.discard("e")
    counts = [int(c) for c in args.adapter_counts.split(",") if c]
    adapter_root = work / f"adapters-h{cfg.hidden_size}-l{cfg.num_layers}"
    r16 = [f"r16-all-{k:03d}" for k in range(max(counts + [args.peft_adapters if "e" in wanted else 0]))]
    qv = [f"r8-qv-{k:03d}" for k in range(args.qv_adapters)] if "d" in wanted else []
    xs = [f"r16-experts-{k:03d}" for k in range(args.expert_adapters)]
    # A mixture of experts' rows c: LoRA on attention only; rows x on every expert too (2 GB each at 30B).
    targets, what = (ATTENTION_MODULES, "q,k,v,o") if cfg.num_experts else (ALL_MODULES, "all 7 projections")
    write_adapters(adapter_root, cfg, r16, [16], targets, device, torch.bfloat16, seed=1000)
    write_adapters(adapter_root, cfg, qv, [8], QV, device, torch.bfloat16, seed=5000)
    write_adapters(adapter_root, cfg, xs, [16], ATTENTION_MODULES, device, torch.bfloat16, seed=9000, experts=True)
    os.sync()  # the written files' writeback must not run during the first timed row
    bw, itemsize = copy_bandwidth(device), dtype.itemsize
    abytes = {n: adapter_bytes_per_rank(cfg, 16, targets, itemsize) for n in r16 + xs}
    abytes |= {n: adapter_bytes_per_rank(cfg, 8, QV, itemsize) for n in qv}
    expert_lora = {n: expert_lora_bytes_per_rank(cfg, 16, itemsize) for n in xs}  # per expert
    x_bytes = abytes[xs[0]] + cfg.num_experts * expert_lora[xs[0]] if xs else 0
    fp8 = args.quantization != "none" or cfg.weight_quant is not None
    nbytes = StepBytes.of(cfg, itemsize, abytes, fp8=fp8, expert_lora=expert_lora)
    plain_weights = StepBytes.of(cfg, itemsize, {}).weights
    kv_block = kv_bytes_per_token(cfg, itemsize) * args.block_size
    specs = make_specs(args.requests, args.prompt_len, args.output_len, cfg.vocab_size, args.poisson, args.seed)

    rows = [row for row in (Row("a", "base, LoRA disabled", "base", []),
                            Row("b", "LoRA enabled, no adapter used", "lora", []),
                            *(Row(f"c-{n}", f"{n} adapters r16, {what}", "lora", r16[:n]) for n in counts),
                            Row("d", f"{len(qv)} adapters r8, q,v only", "lora", qv),
                            Row(f"x-{len(xs)}", f"{len(xs)} adapters r16, q,k,v,o + experts", "experts", xs),
                            Row("p", "prefill: prompts, 1 new token each", "base", [], prompts_only=True))
            if row.key[0] in wanted]
    peft_rows = [Row("e", f"HF PEFT generate, {args.peft_adapters} x r16 all 7", "base",
                     r16[:args.peft_adapters])] if "e" in wanted else []

    # One NodeConfig per node: in process and served alike.
    given = dict(item.split("=", 1) for item in args.tune)
    options = engine_options(args, args.prompt_len[1] + args.output_len[1] + args.block_size, args.concurrency,
                             args.requests, prefix_caching=args.prefix_caching,
                             prefill_delay_factor=args.prefill_delay_factor,
                             warmup="on" if args.warmup == "engine" else "off", tuning=tuning_from_text(given),
                             tuning_fixed=frozenset(given), tuning_table=args.tuning_table,
                             tune_budget=args.tune_budget, log_level="WARNING", quantization=args.quantization,
                             api_processes=count_or_auto(args.api_processes))
    pins = {node: list(dict.fromkeys(n for r in rows if r.node == node for n in r.pool)) for node in NODES}
    # A LoRA node's adapter memory: its rows' adapters; expert arenas only on rows x's (2 GB files).
    configs = {"base": node_config(model, device, dtype, max_loras=0, **options)} | {
        node: node_config(model, device, dtype, max_loras=max(len(pins[node]), 1), max_lora_rank=16,
                          max_cpu_loras=max(len(pins[node]), 1) if cuda else 1, adapter_dir=str(adapter_root),
                          **kw, **options)
        for node, kw in (("lora", {"lora_modules": targets} if cfg.num_experts else {}),
                         ("experts", dict(lora_modules=ALL_MODULES, max_adapter_bytes=(x_bytes // GB + 2) * GB)))}

    runner, on_off = configs["base"].runner, lambda on: "on" if on else "off"
    header = [
        f"{device_line(device, dtype)}  copy bandwidth (D2D, read+write): {bw / 1e9:.1f} GB/s",
        f"model: {model.description}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_heads}/"
        f"{cfg.num_kv_heads} heads, vocab {cfg.vocab_size}, {nbytes.weights / 1e9:.3f} GB of weights read per "
        "decode step" + (f" (FP8 projections: {(plain_weights - nbytes.weights) / 1e9:.3f} GB less than in "
                         f"{dtype_name(dtype)}, room for {(plain_weights - nbytes.weights) // kv_block} more KV blocks "
                         f"of {args.block_size} tokens)" if fp8 else ""),
        f"workload: {args.requests} requests, prompt {args.prompt_len[0]}-{args.prompt_len[1]} tokens, output "
        f"{args.output_len[0]}-{args.output_len[1]} tokens (ignore EOS), " + (
            f"open loop Poisson {args.poisson} req/s, Zipf({args.zipf_alpha}) adapter popularity, at most "
            f"{args.concurrency} running" if args.poisson else
            f"closed loop at concurrency {args.concurrency}, request i -> adapter i mod N"),
        f"node: max_num_seqs {args.concurrency}, {args.max_batched_tokens} tokens per step, "
        f"{options['num_kv_blocks']} KV blocks of {args.block_size}, prefix cache {on_off(args.prefix_caching)}, "
        f"decode graphs {on_off(runner.decode_graphs_on(device.type))}, piecewise graphs "
        f"{on_off(runner.mixed_graphs_on(device.type))}; adapter bytes: r16 {what} = "
        f"{abytes[r16[0]] / 1e6 if r16 else 0:.2f} MB" + (f", r8 q,v = {abytes[qv[0]] / 1e6:.2f} MB" if qv else "")
        + (f", x: r16 q,k,v,o + experts = {x_bytes / 1e6:.2f} MB ({len(xs) * x_bytes / 1e9:.2f} GB of adapter "
           "memory on its node)" if xs else ""),
        f"paths: {', '.join(args.paths)}" + (f"; served: {args.clients} client processes per API, front ends "
                                              f"{args.api_processes}" if set(args.paths) - {"engine"} else ""),
    ]
    print("\n".join(header), flush=True)

    results: dict[tuple[str, str], list[RowResult]] = {}

    def run_guarded(row: Row, path: str, fn: Callable[[], RowResult]) -> None:
        t = time.perf_counter()
        try:
            result = fn()
        except Exception as exc:  # one broken row must not lose the others
            log.exception("row %s (%s) failed", row.key, path)
            result = RowResult(row.key, path, row.label, error=error_text(exc))
        results.setdefault((row.key, path), []).append(result)
        log.info("row %s (%s) done in %.1fs", row.key, path, time.perf_counter() - t)
        print(f"# {format_row(summarize(result, nbytes, bw))}", file=sys.stderr, flush=True)

    def fail(group: list[Row], path: str, exc: Exception) -> None:
        log.exception("the %s node failed", path)
        for row in group:
            results[(row.key, path)] = [RowResult(row.key, path, row.label, error=error_text(exc))]

    groups = {node: [r for r in rows if r.node == node] for node in NODES}
    if "engine" in args.paths:
        # One node without LoRA (a) and one with adapter memory for every adapter (b, c, d),
        # both alive through every round: with --rounds N the rows take turns N times and
        # drift of the machine lands on all of them alike. Then rows x, on their node alone (its expert
        # arenas as deep as its others: beside rows c's adapters, 78 GB for c-32 at 30B).
        for phase in (("base", "lora"), ("experts",)):
            llms = {}
            for node in (n for n in phase if groups[n]):
                try:
                    t, llms[node] = time.perf_counter(), build_llm(configs[node], pins[node])
                    print(tuning_line(llms[node], node, time.perf_counter() - t), flush=True)
                    print(memory_line(llms[node], kv_block, node), flush=True)
                except Exception as exc:
                    fail(groups[node], "engine", exc)
            for _ in range(args.rounds):
                for row in (r for node in llms for r in groups[node]):
                    run_guarded(row, "engine", lambda row=row: run_engine_row(row, llms[row.node], specs, args))
            for node in list(llms):  # (no name left holding a node: its weights would stay on the device)
                llms.pop(node).close()
            release_memory()
        if args.control and groups["base"]:  # row a again on a fresh node: what order and drift alone do
            control = Row("a2", "base again, after b-d (control)", "base", [])
            rows.insert(rows.index(groups["base"][0]) + 1, control)
            llms["base"] = build_llm(configs["base"])
            run_guarded(control, "engine", lambda: run_engine_row(control, llms["base"], specs, args))
            llms.pop("base").close()
            release_memory()
    served = [p for p in args.paths if p != "engine"]
    for node_kind, group in ((k, g) for k, g in groups.items() if served and g):
        try:
            node = NodeProcess(configs[node_kind], work / f"node-{node_kind}.log")
        except Exception as exc:
            for path in served:
                fail(group, path, exc)
            continue
        try:
            node.pin(pins[node_kind])
            for path in served:  # the same requests through each API in turn
                for row in group:
                    run_guarded(row, path, lambda: run_served_row(row, path, node, model.checkpoint.name, specs, args))
        finally:
            node.stop()
    for row in peft_rows:
        rows.append(row)
        run_guarded(row, "peft", lambda: run_peft_row(row, model.checkpoint, adapter_root, specs, args, device, dtype))

    order = [(r.key, p) for r in rows for p in ("engine", *served, "peft") if (r.key, p) in results]
    per_round = {k: [summarize(r, nbytes, bw) for r in results[k]] for k in order}
    summaries = {k: median_summary(runs) for k, runs in per_round.items()}
    print()
    TABLE.print([format_row(s) for s in summaries.values()] + ["-" * len(TABLE.head()[0])])
    by_key = {k: s for (k, path), s in summaries.items() if path in ("engine", "peft") and not s.error}
    reads = {"c-32": 32 * abytes[r16[0]] / bw} if len(r16) >= 32 else {}
    if f"x-{len(xs)}" in by_key:  # its adapters' expert LoRA at the row's mean batch
        reads[f"x-{len(xs)}"] = nbytes.adapter_read(round(by_key[f"x-{len(xs)}"].batch), frozenset(xs)) / bw
    for line in ratios(by_key, reads) + path_ratios(summaries):
        print(line)
    if args.rounds > 1:
        print(f"rounds: {args.rounds}, engine rows interleaved in each; every column is the median over rounds. "
              "decode tok/s per round:")
        for (key, _), runs in per_round.items():
            if len(runs) > 1:
                print(f"  {key:<6} " + "  ".join(f"{r.decode_tps:9.1f}" for r in runs))
    engine_rows = {k: s for (k, p), s in summaries.items() if p == "engine" and not s.error}
    print("JIT compiles during timed runs (Triton kernels, torch.compile graphs; each stalls the step it lands in): "
          + ", ".join(f"{k} {sum(len(r.compiles) for r in results[(k, 'engine')])}" for k in engine_rows))
    kinds = {f"{k}{'' if p == 'engine' else '@' + p}": s.step_kinds for (k, p), s in summaries.items() if s.step_kinds}
    print("steps by kind, decode from CUDA graphs / piecewise graphs / eager decode / eager with prompt tokens: "
          + ", ".join(f"{k} {v['graph']}/{v['piecewise']}/{v['eager_decode']}/{v['eager_prefill']}"
                      for k, v in kinds.items()))
    print(f"columns: docs/PERFORMANCE.md. e: static batches of {args.concurrency}, TTFT as if generate streamed; "
          f"warm-up per row: {args.warmup}; total {time.perf_counter() - started:.0f}s")
    write_json(args.json, {"header": header, "copy_bandwidth": bw,
                           "rows": {f"{k}@{p}": dataclasses.asdict(s) for (k, p), s in summaries.items()},
                           "rounds": {f"{k}@{p}": [dataclasses.asdict(r) for r in runs]
                                      for (k, p), runs in per_round.items()}})
    return summaries


if __name__ == "__main__":
    main()
