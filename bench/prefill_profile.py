"""Where a prefill step's time goes: the node's eager forward over prompt chunks, by kernel.

serving_bench.py's TTFT column is mostly prefill: in its closed loop a wave of 64 prompts is
prefilled in chunks of up to 2048 tokens, eagerly (no CUDA graph), and a LoRA row adds a
shrink and an expand launch per fused projection (inference_node/runner/lora/eager.py). This script builds such
a chunk (sequences of one prompt length, sequence i on adapter i mod N) and prints, per
configuration, the forward's GPU time, the host's time to queue it (a prefill step is
host-bound when the two are close: its launches cost more host time than GPU time) and, from
torch.profiler, its kernel families.

    python -m bench.prefill_profile                      # CUDA: Llama-3.2-1B-shaped, 16 x 128 tokens
    python -m bench.prefill_profile --seqs 8 --prompt 256 --configs base,c8
    python -m bench.prefill_profile --device cpu --tiny --seqs 2 --prompt 16   # CPU smoke
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from bench.common import config_slots, kernel_families, random_model


def prompt_chunks(seqs: int, prompt: int, block_size: int, slots: list[int]) -> list:
    """Whole-prompt chunks of `seqs` sequences, sequence i on slots[i % n] (none: no LoRA)."""
    per_seq = -(-prompt // block_size)
    chunks = []
    for i in range(seqs):
        req = SimpleNamespace(id=i, num_computed=0, all_token_ids=[(7 * i + j) % 1000 + 1 for j in range(prompt)],
                              block_ids=list(range(i * per_seq, (i + 1) * per_seq)),
                              lora_slot=slots[i % len(slots)] if slots else -1, feedback_row=-1)
        chunks.append(SimpleNamespace(request=req, num_new_tokens=prompt, completes_prompt=True))
    return chunks


def timed_ms(run, reps: int, cuda: bool) -> float:
    """Median GPU time of one call (CUDA events around each)."""
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            run()
    return statistics.median(times) if times else float("nan")


def host_ms(run, reps: int, cuda: bool) -> float:
    """Host time of one call, launching only: with the GPU idle at the start and the calls not
    waited for, this is the time the host needs to queue a forward. Where it is close to the
    GPU time, the step is host-bound."""
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        run()
    elapsed = time.perf_counter() - start
    if cuda:
        torch.cuda.synchronize()
    return elapsed * 1e3 / reps


def host_profile(run, reps: int, top: int, cuda: bool) -> None:
    """cProfile of `reps` forwards, by own time: which Python functions the host's queueing
    time is spent in (Triton's launcher, the wrappers, torch's dispatch)."""
    import cProfile
    import pstats

    if cuda:
        torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(reps):
        run()
    profiler.disable()
    if cuda:
        torch.cuda.synchronize()
    stats = pstats.Stats(profiler)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]
    print(f"   host profile, {reps} forwards, per forward: own ms, calls, cumulative ms, function")
    for (file, line, name), (_, calls, own, cumulative, _) in rows:
        print(f"   {own * 1e3 / reps:8.3f} {calls // reps:6d} {cumulative * 1e3 / reps:8.3f}  "
              f"{Path(file).name}:{line} {name}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seqs", type=int, default=16)
    p.add_argument("--prompt", type=int, default=128, help="tokens per sequence (all of them new)")
    p.add_argument("--configs", default="base,c1,c8,c32,d32")
    p.add_argument("--layers", type=int, default=None, help="fewer layers (smoke runs)")
    p.add_argument("--tiny", action="store_true", help="a tiny model of the same family (smoke runs)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--cprofile", type=int, default=0, metavar="N",
                   help="also print the host's Python profile of N forwards (where queueing time goes)")
    args = p.parse_args()

    from inference_node.engine.kv_cache import KVCache
    from inference_node.model.launch import LaunchChoices
    from inference_node.runner.batch import build_forward_batch
    from inference_node.runner.lora.eager import applier_for_slots
    from kernels.tuning import DEFAULT_TUNING

    device, dtype = torch.device(args.device), torch.bfloat16
    cuda = device.type == "cuda"
    names = [c for c in args.configs.split(",") if c]
    block = 16
    cfg, model = random_model(device, dtype, args.layers, args.prompt + 16, tiny=args.tiny)
    kv = KVCache(cfg, args.seqs * -(-args.prompt // block) + 1, block, dtype, device)
    buffers, plan = config_slots(cfg, names, dtype, device)
    launch = LaunchChoices.of(device, DEFAULT_TUNING)
    tokens = args.seqs * args.prompt
    print(f"device {torch.cuda.get_device_name(device) if cuda else 'CPU'}; {cfg.num_layers} layers; "
          f"prefill of {args.seqs} x {args.prompt} = {tokens} tokens, eager")
    results = {}
    for n in names:
        chunks = prompt_chunks(args.seqs, args.prompt, block, plan[n])
        batch = build_forward_batch(chunks, block, device)
        applier = (applier_for_slots(buffers, [(c.request.lora_slot, c.num_new_tokens) for c in chunks])
                   if plan[n] else None)

        def run(batch=batch, applier=applier):
            return model.forward(batch, kv.k, kv.v, launch, applier)

        run()  # compiles
        ms = timed_ms(run, args.reps, cuda)
        host = host_ms(run, args.reps, cuda)
        results[n] = ms
        if not cuda:
            print(f"{n}: forward ran, host {host:.1f} ms (CPU: no GPU timings)")
            continue
        line = (f"\n== {n}: forward {ms:.3f} ms GPU time ({tokens / ms:.0f} tokens/ms); the host "
                f"takes {host:.3f} ms to queue it")
        if "base" in results and n != "base":
            line += f", +{ms - results['base']:.3f} ms over base"
        print(line)
        if args.cprofile:
            host_profile(run, args.cprofile, args.top, cuda)
        if args.no_profile:
            continue
        for fam, (us, count) in sorted(kernel_families(run, 3).items(), key=lambda kv: -kv[1][0])[:args.top]:
            print(f"   {us / 1e3:8.3f} ms  {count:5d} x  {us / max(count, 1):8.1f} us  {fam}")


if __name__ == "__main__":
    main()
