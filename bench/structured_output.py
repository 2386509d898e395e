"""Structured output's cost per token: the same prompts answered as free text and under a JSON
schema (response_format json_schema), by the engine in-process, in one table.

    python -m bench.structured_output                    # CPU: the embedded SmolLM2
    python -m bench.structured_output --device cuda --concurrency 64 --requests 128
    python -m bench.structured_output --rounds 5        # medians of 5 rounds on a shared machine

Both rows run closed loop (--concurrency requests in flight) over the same chat prompts, greedy.
Constrained answers end when their JSON is whole (at most --max-tokens); each free-text answer
then runs (ignore_eos) to the length its prompt's JSON answer had, so both rows have the same
tokens per request and the same mix of steps, and differ only in the constraint. Columns: output tokens, output tok/s,
time per output token (p50, p99: a request's first to last token over its tokens after the
first), TTFT p50 (constrained: with the grammar's compile), the host's time in the runner's
sampling per step (on a CPU the sampling itself; on a GPU its launches), and for the
constrained row the host's mask work per constrained token (GrammarCompiler.fill_masks, the
one step of theirs the device may wait for) and per step that had some. --rounds N runs the
rows in turn N times and reports each column's median over the rounds (a shared machine's
load moves between rounds, not within one pair).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass, field
from typing import Sequence

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"type": "string", "maxLength": 24},
                         "languages": {"type": "array", "items": {"enum": ["English", "French", "Japanese",
                                                                           "Spanish", "German"]},
                                       "maxItems": 3},
                         "employed": {"type": "boolean"}},
          "required": ["name", "age", "city", "languages", "employed"], "additionalProperties": False}


@dataclass
class Timing:
    submitted: float
    first: float | None = None
    last: float | None = None
    tokens: int = 0
    reason: str | None = None


@dataclass
class RowResult:
    name: str
    wall: float
    timings: list[Timing]
    mask_calls: list[tuple[float, int]] = field(default_factory=list)   # (seconds, rows) per fill_masks
    sample_calls: list[float] = field(default_factory=list)            # seconds per ModelRunner.sample


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_row(llm, name: str, prompts: list[list[int]], grammar: str, lengths: list[int], concurrency: int) -> RowResult:
    """Answers every prompt (prompts[i] with at most lengths[i] tokens), `concurrency` in
    flight, driving the engine from this thread; timings in prompt order."""
    from inference_node.engine.request import Request, SamplingParams

    engine = llm.engine
    grammars = engine.constraints.grammars
    fill = grammars.fill_masks
    calls: list[tuple[float, int]] = []

    def timed_fill(chosen, out) -> None:
        started = time.perf_counter()
        fill(chosen, out)
        calls.append((time.perf_counter() - started, len(chosen)))

    runner = engine.runner
    sample = runner.sample
    samples: list[float] = []

    def timed_sample(*args, **kwargs) -> None:
        started = time.perf_counter()
        sample(*args, **kwargs)
        samples.append(time.perf_counter() - started)

    grammars.fill_masks = timed_fill
    runner.sample = timed_sample
    timings: list[Timing] = [Timing(0.0) for _ in prompts]
    pending = list(range(len(prompts)))[::-1]
    open_count = 0

    def submit() -> None:
        nonlocal open_count
        i = pending.pop()
        timing = timings[i]
        timing.submitted = time.perf_counter()

        def emit(event, timing=timing) -> None:
            nonlocal open_count
            if event.token_ids:
                now = time.perf_counter()
                timing.first = timing.first or now
                timing.last = now
                timing.tokens += len(event.token_ids)
            if event.finish_reason is not None:
                timing.reason = event.finish_reason
                open_count -= 1
                if event.error is not None:
                    raise RuntimeError(f"{name}: a request failed: {event.error}")

        params = SamplingParams(max_tokens=lengths[i], ignore_eos=not grammar)
        engine.submit(Request(list(prompts[i]), params, emit, grammar_source=grammar))
        open_count += 1

    started = time.perf_counter()
    try:
        while pending or open_count:
            while pending and open_count < concurrency:
                submit()
            engine.run_once(block=False)
    finally:
        grammars.fill_masks = fill
        del runner.sample    # the class's method again
    return RowResult(name, time.perf_counter() - started, timings, calls, samples)


def summarize(row: RowResult) -> dict:
    tokens = sum(t.tokens for t in row.timings)
    tpot = [(t.last - t.first) / (t.tokens - 1) for t in row.timings if t.tokens > 1]
    ttft = [t.first - t.submitted for t in row.timings if t.first is not None]
    masked_rows = sum(rows for _, rows in row.mask_calls)
    mask_seconds = sum(s for s, _ in row.mask_calls)
    return {"row": row.name, "requests": len(row.timings), "output_tokens": tokens,
            "tokens_per_request": tokens / len(row.timings), "tok_s": tokens / row.wall,
            "tpot_p50_ms": 1e3 * percentile(tpot, 0.5), "tpot_p99_ms": 1e3 * percentile(tpot, 0.99),
            "ttft_p50_ms": 1e3 * percentile(ttft, 0.5),
            "mask_us_per_token": 1e6 * mask_seconds / masked_rows if masked_rows else float("nan"),
            "mask_us_per_step": 1e6 * mask_seconds / len(row.mask_calls) if row.mask_calls else float("nan"),
            "sample_us_per_step": 1e6 * statistics.median(row.sample_calls) if row.sample_calls else float("nan"),
            "stops": sum(t.reason == "stop" for t in row.timings)}


def median_row(rounds: list[dict]) -> dict:
    """Each numeric column's median over the rounds."""
    return {key: (statistics.median(r[key] for r in rounds) if isinstance(value, float) else value)
            for key, value in rounds[0].items()}


HEADER = (f"{'row':<12} {'reqs':>5} {'tokens':>7} {'tok/req':>8} {'tok/s':>8} {'TPOT p50':>9} {'TPOT p99':>9} "
          f"{'TTFT p50':>9} {'sample/step':>12} {'mask/tok':>9} {'mask/step':>10}")


def format_row(s: dict) -> str:
    def us(value: float) -> str:
        return "-" if value != value else f"{value:.0f}us"

    return (f"{s['row']:<12} {s['requests']:>5} {s['output_tokens']:>7} {s['tokens_per_request']:>8.1f} "
            f"{s['tok_s']:>8.1f} {s['tpot_p50_ms']:>7.2f}ms {s['tpot_p99_ms']:>7.2f}ms {s['ttft_p50_ms']:>7.1f}ms "
            f"{us(s['sample_us_per_step']):>12} {us(s['mask_us_per_token']):>9} {us(s['mask_us_per_step']):>10}")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", default="", help="an HF safetensors checkpoint (default: the embedded SmolLM2)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda where there is one")
    p.add_argument("--requests", type=int, default=None, help="prompts per row (CUDA 128, CPU 8)")
    p.add_argument("--concurrency", type=int, default=None, help="requests in flight (CUDA 64, CPU 4)")
    p.add_argument("--max-tokens", type=int, default=96, help="constrained answers' cap")
    p.add_argument("--rounds", type=int, default=1, help="rows in turn this many times; medians")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")


def run(args: argparse.Namespace) -> list[dict]:
    import torch

    from inference_node.config import NodeConfig
    from inference_node.frontend.response_format import grammar_of
    from inference_node.llm import LLM
    from inference_node.tokenizer import TextCodec
    from lora.v1 import inference_pb2

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device == "cuda"
    requests = args.requests or (128 if cuda else 8)
    concurrency = args.concurrency or (64 if cuda else 4)
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(NodeConfig.of(checkpoint=args.checkpoint, device=device, max_loras=0,
                            max_num_seqs=max(concurrency, 8)))
    llm.prepare()
    codec = TextCodec(llm.checkpoint)
    prompts = [codec.encode_chat([{"role": "user", "content": f"Invent person number {i}: name, age, city, "
                                                             "languages and whether they work, as JSON."}])
               for i in range(requests)]
    grammar = grammar_of(inference_pb2.ResponseFormat(type=inference_pb2.ResponseFormat.JSON_SCHEMA,
                                                      json_schema=json.dumps(SCHEMA)))
    # Warm-up: the grammar's vocabulary tables, the kernels of both rows' shapes.
    run_row(llm, "warm-up", prompts[:2], grammar, [8, 8], 2)
    run_row(llm, "warm-up", prompts[:2], "", [8, 8], 2)
    free_rounds, constrained_rounds = [], []
    for _ in range(args.rounds):
        constrained_run = run_row(llm, "json_schema", prompts, grammar, [args.max_tokens] * requests, concurrency)
        lengths = [t.tokens for t in constrained_run.timings]
        free_rounds.append(summarize(run_row(llm, "free text", prompts, "", lengths, concurrency)))
        constrained_rounds.append(summarize(constrained_run))
    llm.close()
    free, constrained = rows = [median_row(free_rounds), median_row(constrained_rounds)]
    print(f"device: {device}; model: {llm.checkpoint.name}; {requests} requests, {concurrency} in flight, greedy"
          f"{f'; medians of {args.rounds} rounds' if args.rounds > 1 else ''}")
    print(HEADER)
    for row in rows:
        print(format_row(row))
    print(f"json_schema / free text: TPOT p50 x{constrained['tpot_p50_ms'] / free['tpot_p50_ms']:.2f}, "
          f"tok/s x{constrained['tok_s'] / free['tok_s']:.2f} "
          f"({constrained['stops']} of {constrained['requests']} JSON answers whole within {args.max_tokens} tokens)")
    return rows


def main(argv: Sequence[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    main()
