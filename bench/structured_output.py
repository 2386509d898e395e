"""Structured output's cost per token: the same prompts answered as free text and under a JSON
schema (response_format json_schema), by the engine in-process, in one table.

    python -m bench.structured_output                    # CPU: the embedded SmolLM2
    python -m bench.structured_output --device cuda --concurrency 64 --requests 128
    python -m bench.structured_output --rounds 5        # medians of 5 rounds on a shared machine

Both rows run closed loop (--concurrency requests in flight) over the same chat prompts, greedy.
Constrained answers end when their JSON is whole (at most --max-tokens); each free-text answer
then runs (ignore_eos) to the length its prompt's JSON answer had, so both rows have the same
tokens per request and the same mix of steps, and differ only in the constraint. Columns: output
tokens, tok/s, time per output token (a request's first to last token over its tokens after the
first), TTFT (constrained: with the grammar's compile), the host's time in the runner's sampling
per step (on a CPU the sampling itself; on a GPU its launches), and for the constrained row the
host's mask work (GrammarCompiler.fill_masks, the one step of theirs the device may wait for) per
constrained token and per step that had some. --rounds N runs the rows in turn N times and
reports each column's median over the rounds (a shared machine's load moves between rounds, not
within one pair).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Sequence

from bench.driver import Driver, ReqRecord
from bench.harness import Col, Spec, Table, medians, pct

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
class RowResult:
    name: str
    records: list[ReqRecord]
    mask_calls: list[tuple[float, int]] = field(default_factory=list)   # (seconds, rows) per fill_masks
    sample_calls: list[float] = field(default_factory=list)            # seconds per ModelRunner.sample


def run_row(llm, name: str, prompts: list[list[int]], grammar: str, lengths: list[int], concurrency: int) -> RowResult:
    """Answers every prompt (prompts[i] with at most lengths[i] tokens) through the Driver,
    timing the grammar's mask work and the runner's sampling; records in prompt order."""
    engine = llm.engine
    grammars, runner = engine.constraints.grammars, engine.runner
    fill, sample = grammars.fill_masks, runner.sample
    result = RowResult(name, [])

    def timed_fill(chosen, out) -> None:
        started = time.perf_counter()
        fill(chosen, out)
        result.mask_calls.append((time.perf_counter() - started, len(chosen)))

    def timed_sample(*args, **kwargs) -> None:
        started = time.perf_counter()
        sample(*args, **kwargs)
        result.sample_calls.append(time.perf_counter() - started)

    grammars.fill_masks, runner.sample = timed_fill, timed_sample
    specs = [Spec(i, prompt, n, 0.0, 0.0) for i, (prompt, n) in enumerate(zip(prompts, lengths))]
    try:
        result.records, _ = Driver(engine, llm.node.model.device, concurrency, poisson=False).run(
            specs, grammar=grammar)
    finally:
        grammars.fill_masks = fill
        del runner.sample    # the class's method again
    return result


def summarize(row: RowResult) -> dict:
    recs = row.records
    tokens = sum(r.tokens for r in recs)
    tpot = [(r.last - r.first) / (r.tokens - 1) for r in recs if r.tokens > 1]
    ttft = [r.first - r.submit for r in recs if r.first is not None]
    masked_rows, mask_seconds = sum(rows for _, rows in row.mask_calls), sum(s for s, _ in row.mask_calls)
    return {"row": row.name, "requests": len(recs), "output_tokens": tokens, "tokens_per_request": tokens / len(recs),
            "tok_s": tokens / (max(r.done for r in recs) - min(r.submit for r in recs)),
            "tpot_p50": pct(tpot, 50), "tpot_p99": pct(tpot, 99), "ttft_p50": pct(ttft, 50),
            "sample_per_step": statistics.median(row.sample_calls) if row.sample_calls else math.nan,
            "mask_per_token": mask_seconds / masked_rows if masked_rows else math.nan,
            "mask_per_step": mask_seconds / len(row.mask_calls) if row.mask_calls else math.nan,
            "stops": sum(r.finish_reason == "stop" for r in recs)}


US = dict(fmt=".0f", unit="us", scale=1e6)
TABLE = Table(Col("row", 12), Col("reqs", 5, "d"), Col("tokens", 7, "d"), Col("tok/req", 8, ".1f"),
              Col("tok/s", 8, ".1f"), Col("TPOT p50", 9, ".2f", "ms", 1e3), Col("p99", 8, ".2f", "ms", 1e3),
              Col("TTFT p50", 9, ".1f", "ms", 1e3), Col("sample/step", 11, **US), Col("mask/tok", 9, **US),
              Col("mask/step", 9, **US))
COLUMNS = ("row", "requests", "output_tokens", "tokens_per_request", "tok_s", "tpot_p50", "tpot_p99", "ttft_p50",
           "sample_per_step", "mask_per_token", "mask_per_step")


def run(args: argparse.Namespace) -> list[dict]:
    import torch

    from inference_node.config import NodeConfig
    from inference_node.frontend.response_format import grammar_of
    from inference_node.llm import LLM
    from inference_node.tokenizer import TextCodec
    from lora.v1 import inference_pb2

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device == "cuda"
    requests, concurrency = args.requests or (128 if cuda else 8), args.concurrency or (64 if cuda else 4)
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
        lengths = [r.tokens for r in constrained_run.records]
        free_rounds.append(summarize(run_row(llm, "free text", prompts, "", lengths, concurrency)))
        constrained_rounds.append(summarize(constrained_run))
    llm.close()
    free, constrained = rows = [medians(free_rounds), medians(constrained_rounds)]
    print(f"device: {device}; model: {llm.checkpoint.name}; {requests} requests, {concurrency} in flight, greedy"
          f"{f'; medians of {args.rounds} rounds' if args.rounds > 1 else ''}")
    TABLE.print([[row[key] for key in COLUMNS] for row in rows])
    print(f"json_schema / free text: TPOT p50 x{constrained['tpot_p50'] / free['tpot_p50']:.2f}, "
          f"tok/s x{constrained['tok_s'] / free['tok_s']:.2f} "
          f"({constrained['stops']} of {constrained['requests']} JSON answers whole within {args.max_tokens} tokens)")
    return rows


def main(argv: Sequence[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", default="", help="an HF safetensors checkpoint (default: the embedded SmolLM2)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda where there is one")
    p.add_argument("--requests", type=int, default=None, help="prompts per row (CUDA 128, CPU 8)")
    p.add_argument("--concurrency", type=int, default=None, help="requests in flight (CUDA 64, CPU 4)")
    p.add_argument("--max-tokens", type=int, default=96, help="constrained answers' cap")
    p.add_argument("--rounds", type=int, default=1, help="rows in turn this many times; medians")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    main()
