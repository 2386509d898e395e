"""Soak: thousands of requests over many adapters at a fixed concurrency against a real
`inference-node serve` process (CPU), some cancelled mid-stream and some invalid, printing
requests completed, errors by status, p50/p99 latency and the node's memory at start and end.

    .venv/bin/python -m bench.soak --requests 3000 --adapters 24 --concurrency 16

Uses a small random Llama checkpoint (with the embedded SmolLM2's tokenizer) and random
PEFT-format adapters made on the spot, so it runs in minutes on a laptop.
"""
from __future__ import annotations

import argparse
import collections
import random
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import torch

from bench.common import TINY_LLAMA, copy_tokenizer, write_random_adapter, write_random_checkpoint
from inference_node.model.config import ModelConfig
from inference_node.model.embedded import default_checkpoint
from lora_client.node_client import NodeClient
from lora_client.processes import Child, console_script, free_port, wait_healthy


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def make_models(root: Path, adapters: int) -> tuple[Path, list[str]]:
    cpu = torch.device("cpu")
    base = write_random_checkpoint(root / "base", TINY_LLAMA, torch.float32, cpu, std=0.3)
    copy_tokenizer(default_checkpoint(), base)
    cfg = ModelConfig.from_checkpoint(base)
    names = []
    for i in range(adapters):
        name = f"soak-{i:03d}"
        rank = (2, 4, 8, 16)[i % 4]
        targets = [["q_proj", "v_proj"], ["q_proj", "k_proj", "v_proj", "o_proj"],
                   ["gate_proj", "up_proj", "down_proj"]][i % 3]
        write_random_adapter(root / "adapters" / name, cfg, rank, targets, seed=i, device=cpu,
                             dtype=torch.float32, std=0.1)
        names.append(name)
    return base, names


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--adapters", type=int, default=24)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-loras", type=int, default=8)
    ap.add_argument("--cancel-fraction", type=float, default=0.05)
    ap.add_argument("--invalid-fraction", type=float, default=0.02)
    ap.add_argument("--max-growth-mb", type=float, default=200.0,
                    help="fail when the node's memory grows more than this from warm-up to end")
    args = ap.parse_args()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        root = Path(tmp)
        print(f"making a random Llama and {args.adapters} adapters ...", flush=True)
        base, names = make_models(root, args.adapters)
        port = free_port()
        node = Child("inference-node", console_script("inference-node") + [
            "serve", "--port", str(port), "--model", str(base), "--device", "cpu", "--num-kv-blocks", "512",
            "--max-loras", str(args.max_loras), "--max-lora-rank", "16", "--max-cpu-loras", str(args.adapters // 2),
            "--adapter-dir", str(root / "adapters"), "--max-num-seqs", str(args.concurrency)],
            root / "node.log")
        target = f"127.0.0.1:{port}"
        try:
            wait_healthy(target, 120, node)
            outcomes: collections.Counter[str] = collections.Counter()
            latencies: list[float] = []
            lock = threading.Lock()

            def one(i: int, client: NodeClient) -> None:
                r = rng.random()
                adapter = rng.choice(names + [""])
                prompt = [rng.randrange(100, 40000) for _ in range(rng.randrange(4, 48))]
                request = client.request(adapter=adapter, prompt_token_ids=prompt,
                                         max_tokens=rng.randrange(4, 24), ignore_eos=True)
                if r < args.invalid_fraction:
                    request.max_tokens = -1                # INVALID_ARGUMENT
                started = time.monotonic()
                try:
                    if r > 1 - args.cancel_fraction:
                        call = client.stream(request, timeout=120)
                        next(call)
                        call.cancel()
                        outcome = "cancelled"
                    else:
                        result = client.generate(request, timeout=120)
                        outcome = f"ok ({result.finish_reason})"
                except grpc.RpcError as exc:
                    outcome = exc.code().name
                with lock:
                    outcomes[outcome] += 1
                    if outcome.startswith("ok"):
                        latencies.append(time.monotonic() - started)

            with NodeClient(target) as client, ThreadPoolExecutor(args.concurrency) as pool:
                list(pool.map(lambda i: one(i, client), range(min(200, args.requests))))  # warm-up
                rss_start = rss_mb(node.proc.pid)
                outcomes.clear(); latencies.clear()
                started = time.monotonic()
                list(pool.map(lambda i: one(i, client), range(args.requests)))
                wall = time.monotonic() - started
                time.sleep(0.5)
                stats = client.stats()
            rss_end = rss_mb(node.proc.pid)
        finally:
            node.stop()
    latencies.sort()
    q = statistics.quantiles(latencies, n=100) if len(latencies) > 1 else [0.0] * 99
    print(f"\n{args.requests} requests, {args.adapters} adapters + base, concurrency {args.concurrency}, "
          f"max_loras {args.max_loras}, {wall:.1f} s ({args.requests / wall:.1f} req/s)")
    print(f"{'outcome':24} {'count':>7}")
    for outcome, count in sorted(outcomes.items()):
        print(f"{outcome:24} {count:>7}")
    print(f"latency of completed requests: p50 {q[49] * 1000:.0f} ms, p99 {q[98] * 1000:.0f} ms")
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
