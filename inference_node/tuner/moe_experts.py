"""The routed experts' grouped GEMMs (kernels/moe/triton_kernel.py) per tiling: what a
mixture-of-experts decode step's MLP costs against the bytes it must read, and which
`moe_tilings` (kernels/tuning.py) reads them fastest on this GPU.

For a MoE model's shapes (Qwen3-30B-A3B's widths unless --model says) and each batch size:
each grouped GEMM's tilings as the node's own sweep tries them (expert_trials.py: the cases
experts.gate_up and experts.down: every tiling checked through the node's dispatch against the
PyTorch reference, then its one launch timed from a CUDA graph over routings whose experts
overflow L2). The floor is the bytes of the experts the batch hits and of the activations over
the device's copy bandwidth. The last line is the `--tune` flag of the best pair, for
`inference-node serve` and `bench.serving`.

    python -m inference_node.tuner.moe_experts                       # 30B-A3B widths, 1, 16, 64 rows
    python -m inference_node.tuner.moe_experts --model DIR --rows 64
    python -m inference_node.tuner.moe_experts --lora 8 --rows 64    # expert LoRA beside them
    TRITON_INTERPRET=1 python -m inference_node.tuner.moe_experts --device cpu --hidden 64 --inter 32 \\
        --experts 4 --top-k 2 --rows 4                           # CPU smoke (numbers meaningless)
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable, Sequence

import torch

from kernels.host import interpreting
from kernels.moe import experts_reference, route
from kernels.tuning import DEFAULT_TUNING, Tiling
from kernels.tuning_table import ModelShape

from . import expert_trials
from .trial import Case, copy_bandwidth, cpu_timer, cuda_timer, graph_us

# Qwen3-30B-A3B: 128 experts of 768 columns, 8 routed a token, hidden 2048.
QWEN3_30B_A3B = {"hidden": 2048, "inter": 768, "experts": 128, "top_k": 8}


def shape_of(model: str | None, args: argparse.Namespace) -> dict[str, int]:
    """(hidden, inter, experts, top_k) of --model's config.json, else the flags (30B-A3B's)."""
    if model is None:
        return {name: getattr(args, name) for name in ("hidden", "inter", "experts", "top_k")}
    raw = json.loads((Path(model) / "config.json").read_text())
    inter = raw.get("moe_intermediate_size") or raw["intermediate_size"]
    experts = raw.get("num_experts") or raw.get("num_local_experts")
    if not experts:
        raise SystemExit(f"--model {model}: not a mixture of experts (no num_experts / num_local_experts)")
    return {"hidden": raw["hidden_size"], "inter": inter, "experts": experts, "top_k": raw["num_experts_per_tok"]}


def timer_for(device: torch.device) -> Callable[[Callable[[], object]], float]:
    """Microseconds per call: from a CUDA graph, or the CPU smoke's wall clock (trial.py's)."""
    if device.type != "cuda":
        return lambda call: cpu_timer(lambda _: call, [None])
    return lambda call: graph_us([call, call])  # a layer's experts overflow L2 by themselves


def hit_bytes(picks: torch.Tensor, hidden: int, inter: int, esize: int) -> int:
    """Bytes of the experts `picks` routes to (gate, up and down of each distinct one)."""
    return int(picks.unique().numel()) * 3 * hidden * inter * esize


def sweep_rows(rows: int, shape: dict[str, int], device: torch.device, dtype: torch.dtype) -> dict:
    """One batch size as the node's sweep runs it (expert_trials.py): each group's grouped GEMM
    per tiling, checked through the node's dispatch against the reference, then timed alone;
    the default is each group's first option."""
    model = ModelShape(shape["hidden"], shape["inter"], 1, 1, 1, shape["experts"], shape["top_k"])
    timer = cuda_timer if device.type == "cuda" else cpu_timer
    experts = expert_trials.weights(model, device, dtype)
    times: dict[str, dict[Tiling, float]] = {}
    moved = 0
    for group in ("experts.gate_up", "experts.down"):
        options = expert_trials.options(model, group, dtype)
        trials, nbytes = expert_trials.trials(model, device, dtype, experts, Case(group, rows), options)
        for option, trial in zip(options, trials):
            bad = trial.check()
            if bad:
                raise AssertionError(f"{group} tiling {option}: {', '.join(bad)}")
        times[group.removeprefix("experts.")] = {o: trial.time(timer) for o, trial in zip(options, trials)}
        moved += nbytes
    best = {group: min(t, key=t.get) for group, t in times.items()}
    return {"rows": rows, "times": times, "best": best, "bytes": moved,
            "default_us": sum(next(iter(t.values())) for t in times.values()),
            "best_us": sum(times[g][best[g]] for g in times)}


# -- the experts' LoRA beside the grouped GEMMs (--lora N) -------------------------------------------

def lora_rows(rows: int, shape: dict[str, int], adapters: int, device: torch.device, dtype: torch.dtype,
              timer: Callable[[Callable[[], object]], float], rank: int = 16) -> dict:
    """One batch size at the default tilings and launches: the experts alone and with every
    token's adapter's LoRA on gate/up and down (checked against the reference), then each
    group's pair LoRA launches alone, as the node's sweep checks and times them."""
    from kernels.moe.reference import pair_lora_hook
    from kernels.moe.triton_kernel import fused_experts_lora_triton, fused_experts_triton

    gen = torch.Generator(device="cpu").manual_seed(rows)
    hidden, inter, experts, top_k = shape["hidden"], shape["inter"], shape["experts"], shape["top_k"]
    x = torch.randn(rows, hidden, generator=gen).to(device, dtype)
    router = torch.randn(experts, hidden, generator=gen).to(device, dtype)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5).to(device, dtype)
    down = (torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5).to(device, dtype)
    weights, picks = route(x, router, top_k, renormalise=True, weights_in_model_dtype=False)
    gu_lora, down_lora = expert_trials.lora_arenas(shape, adapters, rank, rows, device, dtype, rows)
    tilings = dict(DEFAULT_TUNING.moe_tilings)
    truth = experts_reference(x.float(), weights, picks, gate_up.float(), down.float(),
                              lora=pair_lora_hook(gu_lora, down_lora))
    with_lora = lambda: fused_experts_lora_triton(x, weights, picks, gate_up, down, tilings,  # noqa: E731
                                                  gu_lora, down_lora, DEFAULT_TUNING.moe_lora_launches)
    err = (with_lora().float() - truth).abs().max().item()
    bound = 2e-2 * max(1.0, truth.abs().max().item())
    if not err <= bound:
        raise AssertionError(f"experts with LoRA: max error {err:.3g} against the reference (bound {bound:.3g})")
    model = ModelShape(hidden, inter, 1, 1, 1, experts, top_k)
    launch_timer = cuda_timer if device.type == "cuda" else cpu_timer
    launches: dict[str, dict[Tiling, float]] = {}
    for group in ("experts.gate_up", "experts.down"):
        options = expert_trials.lora_options(group)
        trials, _ = expert_trials.lora_trials(model, device, dtype, rank, Case(group, rows, adapters), options)
        for option, trial in zip(options, trials):
            bad = trial.check()
            if bad:
                raise AssertionError(f"{group} pair LoRA launch {option}: {', '.join(bad)}")
        launches[group.removeprefix("experts.")] = {o: trial.time(launch_timer) for o, trial in zip(options, trials)}
    kernels = {}
    if device.type == "cuda":
        from .profile import kernel_families

        kernels = kernel_families(with_lora, 20, by_name=True)
    return {"rows": rows, "kernels": kernels, "launches": launches,
            "base_us": timer(lambda: fused_experts_triton(x, weights, picks, gate_up, down, tilings)),
            "lora_us": timer(with_lora),
            "lora_bytes": expert_trials.lora_bytes(picks, adapters, rank, hidden, inter, x.element_size()),
            "bytes": hit_bytes(picks, hidden, inter, x.element_size())}


def print_lora(result: dict, bandwidth: float | None) -> dict:
    us = lambda key: f"{result[key]:8.1f}"  # noqa: E731
    floor = lambda b: f"{b / bandwidth * 1e6:8.1f}" if bandwidth else "       -"  # noqa: E731
    extra = result["lora_us"] - result["base_us"]
    result["best_launches"] = {group: min(times, key=times.get) for group, times in result["launches"].items()}
    ratio = f"{extra / (result['lora_bytes'] / bandwidth * 1e6):5.2f}x" if bandwidth else "    -"
    print(f"rows {result['rows']:4d}: experts {us('base_us')} us (floor {floor(result['bytes'])}), with LoRA "
          f"{us('lora_us')} us: extra {extra:8.1f} us against its LoRA's read {floor(result['lora_bytes'])} us "
          f"({result['lora_bytes'] / 1e6:.1f} MB) = {ratio} (the default launches); each launch alone:", flush=True)
    for group, times in result["launches"].items():
        for (launches, width, warps), launch_us in times.items():
            how = {0: "two launches", 1: "one launch", 2: "one if full"}[launches]
            print(f"   {group:8} {how:12}, tiles of {width:3d} columns, {warps} warps: {launch_us:7.1f} us")
    for name, (kernel_us, count) in sorted(result["kernels"].items(), key=lambda kv: -kv[1][0]):
        print(f"   {kernel_us:8.1f} us  {count:3d} x  {name}")  # eager launches, profiled
    return result


def main(argv: Sequence[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a checkpoint folder: only its config.json is read")
    p.add_argument("--hidden", type=int, default=QWEN3_30B_A3B["hidden"])
    p.add_argument("--inter", type=int, default=QWEN3_30B_A3B["inter"], help="each expert's intermediate width")
    p.add_argument("--experts", type=int, default=QWEN3_30B_A3B["experts"])
    p.add_argument("--top-k", type=int, default=QWEN3_30B_A3B["top_k"])
    p.add_argument("--rows", default="1,16,64", help="decode batch sizes (--lora: the most used first)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--lora", type=int, default=0, metavar="N",
                   help="instead of the sweep: the default tilings with N rank-16 adapters' LoRA on every "
                        "expert (token t on adapter t mod N), each pair kernel alone, against their bytes")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if args.lora and device.type != "cuda" and not interpreting():
        p.error("--lora times the Triton kernels themselves: on the CPU, run it with TRITON_INTERPRET=1")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = shape_of(args.model, args)
    bandwidth = None
    if device.type == "cuda":
        bandwidth = copy_bandwidth(device)
    print(f"routed experts: hidden {shape['hidden']}, {shape['experts']} experts of {shape['inter']}, top "
          f"{shape['top_k']}, {dtype}" + (
              f"; copy bandwidth {bandwidth / 1e12:.2f} TB/s" if bandwidth else " (CPU smoke: numbers meaningless)"),
          flush=True)
    results = []
    if args.lora:
        results = [print_lora(lora_rows(int(r), shape, args.lora, device, dtype, timer_for(device)), bandwidth)
                   for r in args.rows.split(",")]
        best = results[0]["best_launches"]  # the first batch size's: the most used first
        print("--tune moe_lora_launches=" + ",".join(f"{g}={'.'.join(map(str, t))}" for g, t in best.items()))
        return results
    for rows in (int(r) for r in args.rows.split(",")):
        result = sweep_rows(rows, shape, device, dtype)
        results.append(result)
        floor = f"{result['bytes'] / bandwidth * 1e6:8.1f}" if bandwidth else "       -"
        ratio = f"{result['best_us'] / (result['bytes'] / bandwidth * 1e6):6.2f}x" if bandwidth else "      -"
        print(f"rows {rows:4d}: default {result['default_us']:9.1f} us, best {result['best_us']:9.1f} us "
              f"{result['best']}; floor {floor} us ({result['bytes'] / 1e6:.1f} MB of experts hit and "
              f"activations), best/floor {ratio}", flush=True)
        for group, times in result["times"].items():
            for tiling, us in times.items():
                print(f"   {group:8} {'.'.join(map(str, tiling)):>10}: {us:8.1f} us")
    last = results[-1]["best"]
    print("--tune moe_tilings=" + ",".join(f"{g}={'.'.join(map(str, t))}" for g, t in last.items()))
    return results


if __name__ == "__main__":
    main()
