"""Soak: thousands of requests over many adapters at a fixed concurrency against a real
`inference-node serve` process on the CPU, some cancelled mid-stream and some invalid; prints
requests completed, errors by status, p50/p99 latency and the node's memory at start and end,
and fails if anything but cancellations and refusals of the invalid ones went wrong, the node
is not idle at the end (KV blocks and requests back) or its memory grew past a bound.

    python -m bench.soak --requests 3000 --adapters 24 --concurrency 16

A tiny random Llama (with the embedded SmolLM2's tokenizer) and random PEFT adapters of mixed
ranks and targets are made on the spot, so it runs in minutes on a laptop.
"""
from __future__ import annotations

import argparse
import collections
import random
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

import torch

from bench.harness import NodeProcess, bench_model, model_config, node_config, pct, write_random_adapter

TARGETS = (("q_proj", "v_proj"), ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj"))


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main(argv: Sequence[str] | None = None) -> int:
    import grpc

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--adapters", type=int, default=24)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-loras", type=int, default=8)
    ap.add_argument("--cancel-fraction", type=float, default=0.05)
    ap.add_argument("--invalid-fraction", type=float, default=0.02)
    ap.add_argument("--warmup-requests", type=int, default=200)
    ap.add_argument("--max-growth-mb", type=float, default=200.0,
                    help="fail when the node's memory grows more than this from warm-up to end")
    args = ap.parse_args(argv)
    rng, cpu = random.Random(0), torch.device("cpu")
    with tempfile.TemporaryDirectory(prefix="bench-soak-") as tmp:
        root = Path(tmp)
        print(f"making a random Llama and {args.adapters} adapters ...", flush=True)
        model = bench_model("tiny", root, torch.float32, cpu)
        cfg = model_config("tiny")
        names = [f"soak-{i:03d}" for i in range(args.adapters)]
        for i, name in enumerate(names):
            write_random_adapter(root / "adapters" / name, cfg, (2, 4, 8, 16)[i % 4], TARGETS[i % 3], seed=i,
                                 device=cpu, dtype=torch.float32, std=0.1)
        node = NodeProcess(node_config(model, cpu, torch.float32, num_kv_blocks=512, max_loras=args.max_loras,
                                       max_lora_rank=16, max_cpu_loras=max(args.adapters // 2, 1),
                                       adapter_dir=str(root / "adapters"), max_num_seqs=args.concurrency),
                           root / "node.log", timeout_s=120)
        try:
            outcomes: collections.Counter[str] = collections.Counter()
            latencies: list[float] = []
            lock = threading.Lock()

            def one(client) -> None:
                r = rng.random()
                prompt = [rng.randrange(100, 40000) for _ in range(rng.randrange(4, 48))]
                request = client.request(adapter=rng.choice(names + [""]), max_tokens=rng.randrange(4, 24),
                                         prompt_token_ids=prompt, ignore_eos=True)
                if r < args.invalid_fraction:
                    request.max_tokens = -1  # INVALID_ARGUMENT
                started = time.monotonic()
                try:
                    if r > 1 - args.cancel_fraction:
                        call = client.stream(request, timeout=120)
                        next(call)
                        call.cancel()
                        outcome = "cancelled"
                    else:
                        outcome = f"ok ({client.generate(request, timeout=120).finish_reason})"
                except grpc.RpcError as exc:
                    outcome = exc.code().name
                with lock:
                    outcomes[outcome] += 1
                    if outcome.startswith("ok"):
                        latencies.append(time.monotonic() - started)

            with node.client() as client, ThreadPoolExecutor(args.concurrency) as pool:
                list(pool.map(lambda _: one(client), range(min(args.warmup_requests, args.requests))))
                rss_start = rss_mb(node.pid)
                outcomes.clear()
                latencies.clear()
                started = time.monotonic()
                list(pool.map(lambda _: one(client), range(args.requests)))
                wall = time.monotonic() - started
                time.sleep(0.5)
                stats = client.stats()
            rss_end = rss_mb(node.pid)
        finally:
            node.stop()
    print(f"\n{args.requests} requests, {args.adapters} adapters + base, concurrency {args.concurrency}, "
          f"max_loras {args.max_loras}, {wall:.1f} s ({args.requests / wall:.1f} req/s)")
    print(f"{'outcome':24} {'count':>7}")
    for outcome, count in sorted(outcomes.items()):
        print(f"{outcome:24} {count:>7}")
    print(f"latency of completed requests: p50 {pct(latencies, 50) * 1000:.0f} ms, "
          f"p99 {pct(latencies, 99) * 1000:.0f} ms")
    print(f"node memory (RSS): {rss_start:.0f} MB after warm-up, {rss_end:.0f} MB at the end "
          f"(growth {rss_end - rss_start:+.0f} MB, bound {args.max_growth_mb:.0f} MB)")
    print(f"node at the end: {stats.running_requests} running, {stats.waiting_requests} waiting, "
          f"{stats.kv_blocks_free}/{stats.kv_blocks_total} KV blocks free")
    unexpected = {o for o in outcomes if not o.startswith("ok") and o not in ("cancelled", "INVALID_ARGUMENT")}
    idle = stats.running_requests == 0 and stats.waiting_requests == 0 and stats.kv_blocks_free == stats.kv_blocks_total
    ok = not unexpected and idle and rss_end - rss_start <= args.max_growth_mb
    print("PASS" if ok else f"FAIL (unexpected: {sorted(unexpected)}, idle: {idle})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
