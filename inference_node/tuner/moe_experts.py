"""The routed experts' grouped GEMMs (kernels/moe/triton_kernel.py) per tiling: what a
mixture-of-experts decode step's MLP costs against the bytes it must read, and which
`moe_tilings` (kernels/tuning.py) reads them fastest on this GPU.

For a MoE model's shapes (Qwen3-30B-A3B's widths unless --model says) and each batch size:
each grouped GEMM's tilings as the node's own sweep tries them (sweep.py's cases
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
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from kernels.moe import experts_reference, route
from kernels.tuning import DEFAULT_TUNING, Tiling
from kernels.tuning_table import ModelShape

if TYPE_CHECKING:
    from .sweep import Case, Sweep, Trial

# Qwen3-30B-A3B: 128 experts of 768 columns, 8 routed a token, hidden 2048.
QWEN3_30B_A3B = {"hidden": 2048, "inter": 768, "experts": 128, "top_k": 8}
GRID: tuple[Tiling, ...] = tuple((n, k, s) for n in (32, 64, 128) for k in (32, 64, 128) for s in (3, 4))


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


def wall_us(call: Callable[[], object], rounds: int = 3) -> float:
    """CPU smoke: wall microseconds per call (median of `rounds`)."""
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def timer_for(device: torch.device) -> Callable[[Callable[[], object]], float]:
    if device.type != "cuda":
        return wall_us
    from .sweep import graph_us

    return lambda call: graph_us([call, call])  # a layer's experts overflow L2 by themselves


def hit_bytes(picks: torch.Tensor, hidden: int, inter: int, esize: int) -> int:
    """Bytes of the experts `picks` routes to (gate, up and down of each distinct one)."""
    return int(picks.unique().numel()) * 3 * hidden * inter * esize


def sweep_rows(rows: int, shape: dict[str, int], device: torch.device, dtype: torch.dtype) -> dict:
    """One batch size as the node's sweep runs it (expert_options, expert_trials): each group's
    grouped GEMM per tiling, checked through the node's dispatch against the reference, then
    timed alone; the default is each group's first option."""
    from .sweep import Case, Sweep, cpu_timer, cuda_timer

    sweep = Sweep(ModelShape(shape["hidden"], shape["inter"], 1, 1, 1, shape["experts"], shape["top_k"]), device,
                  dtype, "gemm_tilings", cuda_timer if device.type == "cuda" else cpu_timer, [rows])
    times: dict[str, dict[Tiling, float]] = {}
    moved = 0
    for group in ("experts.gate_up", "experts.down"):
        options = expert_options(sweep.shape, group, dtype)
        trials, nbytes = expert_trials(sweep, Case(group, rows), options)
        for option, trial in zip(options, trials):
            bad = trial.check()
            if bad:
                raise AssertionError(f"{group} tiling {option}: {', '.join(bad)}")
        times[group.removeprefix("experts.")] = {o: trial.time(sweep.timer) for o, trial in zip(options, trials)}
        moved += nbytes
    best = {group: min(t, key=t.get) for group, t in times.items()}
    return {"rows": rows, "times": times, "best": best, "bytes": moved,
            "default_us": sum(next(iter(t.values())) for t in times.values()),
            "best_us": sum(times[g][best[g]] for g in times)}


# -- the experts' LoRA beside the grouped GEMMs (--lora N) -------------------------------------------

def lora_arenas(shape: dict[str, int], adapters: int, rank: int, tokens: int, device: torch.device,
                dtype: torch.dtype, seed: int):
    """One layer's gate/up and down PairLora of `adapters` slots of rank `rank` (gate/up's at
    twice it, as PEFT writes it), token t on slot t % adapters, as the node's arenas hold them
    (made on the device: 30B-A3B's for 32 adapters are 1.3 GB)."""
    from kernels.moe.reference import PairLora

    hidden, inter, experts = shape["hidden"], shape["inter"], shape["experts"]
    slots = torch.arange(tokens, dtype=torch.int32) % adapters
    gen = torch.Generator(device=device).manual_seed(seed)

    def pair(r: int, inp: int, out: int) -> PairLora:
        make = lambda *size: (torch.randn(*size, generator=gen, device=device) * size[-1] ** -0.5  # noqa: E731
                              ).to(dtype)
        first = torch.arange(adapters, dtype=torch.int32) * r
        return PairLora(make(experts, adapters * r, inp), make(experts, adapters * r, out).mul_(0.1),
                        slots.to(device), first.to(device), torch.full((adapters,), r, dtype=torch.int32, device=device),
                        torch.full((adapters,), 2.0, dtype=torch.float32, device=device), max_rank=r)

    return pair(2 * rank, hidden, 2 * inter), pair(rank, inter, hidden)


def lora_bytes(picks: torch.Tensor, adapters: int, rank: int, hidden: int, inter: int, esize: int,
               groups: Sequence[str] = ("gate_up", "down")) -> int:
    """Bytes of the expert LoRA a step must read: A and B of each distinct (expert, adapter)
    the routing hits (token t on adapter t mod N), gate/up's at twice the rank."""
    slots = torch.arange(picks.shape[0], device=picks.device) % adapters
    hit = (picks * adapters + slots[:, None]).unique().numel()
    per_pair = {"gate_up": 2 * rank * (hidden + 2 * inter), "down": rank * (inter + hidden)}
    return hit * esize * sum(per_pair[g] for g in groups)


def lora_rows(rows: int, shape: dict[str, int], adapters: int, device: torch.device, dtype: torch.dtype,
              timer: Callable[[Callable[[], object]], float], rank: int = 16) -> dict:
    """One batch size at the default tilings and launches: the experts alone and with every
    token's adapter's LoRA on gate/up and down (checked against the reference), then each
    group's pair LoRA launches alone, as the node's sweep checks and times them."""
    from kernels.moe.reference import pair_lora_hook
    from kernels.moe.triton_kernel import fused_experts_lora_triton, fused_experts_triton

    from .sweep import Case, Sweep, cpu_timer, cuda_timer

    gen = torch.Generator(device="cpu").manual_seed(rows)
    hidden, inter, experts, top_k = shape["hidden"], shape["inter"], shape["experts"], shape["top_k"]
    x = torch.randn(rows, hidden, generator=gen).to(device, dtype)
    router = torch.randn(experts, hidden, generator=gen).to(device, dtype)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5).to(device, dtype)
    down = (torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5).to(device, dtype)
    weights, picks = route(x, router, top_k, renormalise=True, weights_in_model_dtype=False)
    gu_lora, down_lora = lora_arenas(shape, adapters, rank, rows, device, dtype, rows)
    tilings = dict(DEFAULT_TUNING.moe_tilings)
    truth = experts_reference(x.float(), weights, picks, gate_up.float(), down.float(),
                              lora=pair_lora_hook(gu_lora, down_lora))
    with_lora = lambda: fused_experts_lora_triton(x, weights, picks, gate_up, down, tilings,  # noqa: E731
                                                  gu_lora, down_lora, DEFAULT_TUNING.moe_lora_launches)
    err = (with_lora().float() - truth).abs().max().item()
    bound = 2e-2 * max(1.0, truth.abs().max().item())
    if not err <= bound:
        raise AssertionError(f"experts with LoRA: max error {err:.3g} against the reference (bound {bound:.3g})")
    sweep = Sweep(ModelShape(hidden, inter, 1, 1, 1, experts, top_k), device, dtype, "gemm_tilings",
                  cuda_timer if device.type == "cuda" else cpu_timer, [rows], rank=rank)
    launches: dict[str, dict[Tiling, float]] = {}
    for group in ("experts.gate_up", "experts.down"):
        options = expert_lora_options(group)
        trials, _ = expert_lora_trials(sweep, Case(group, rows, adapters), options)
        for option, trial in zip(options, trials):
            bad = trial.check()
            if bad:
                raise AssertionError(f"{group} pair LoRA launch {option}: {', '.join(bad)}")
        launches[group.removeprefix("experts.")] = {o: trial.time(sweep.timer) for o, trial in zip(options, trials)}
    kernels = {}
    if device.type == "cuda":
        from .profile import kernel_families

        kernels = kernel_families(with_lora, 20, by_name=True)
    return {"rows": rows, "kernels": kernels, "launches": launches,
            "base_us": timer(lambda: fused_experts_triton(x, weights, picks, gate_up, down, tilings)),
            "lora_us": timer(with_lora),
            "lora_bytes": lora_bytes(picks, adapters, rank, hidden, inter, x.element_size()),
            "bytes": hit_bytes(picks, hidden, inter, x.element_size())}


# -- the node's sweep (sweep.py): the cases experts.gate_up and experts.down at each batch -------

def expert_options(shape: ModelShape, case_group: str, dtype: torch.dtype) -> list[Tiling]:
    """The distinct tilings of a grouped GEMM the node would launch (fitted to K and to shared
    memory), the default first."""
    from kernels.moe.triton_kernel import fitted

    group = case_group.removeprefix("experts.")
    k = shape.hidden if group == "gate_up" else shape.intermediate
    esize = torch.finfo(dtype).bits // 8
    options: list[Tiling] = []
    for tiling in (DEFAULT_TUNING.moe_tilings[group], *GRID):
        fit = fitted(tiling, k, esize, gated=group == "gate_up")
        if fit not in options:
            options.append(fit)
    return options


def expert_trials(sweep: "Sweep", case: "Case", options: Sequence[Tiling]) -> tuple[list["Trial"], int]:
    """(a trial per option, the bytes one launch must move): each option checked through the
    node's dispatch (routed_experts, both GEMMs, the other group at its default) against the
    float32 reference, and timed as its one grouped GEMM over routings of its own copies
    (random routers), enough that the experts they hit overflow L2 together."""
    from kernels.dispatch import use_triton
    from kernels.moe.dispatch import routed_experts

    from .sweep import Trial, copies_for, rel_err, MAX_REL_ERR

    group = case.group.removeprefix("experts.")
    shape, device, dtype = sweep.shape, sweep.device, sweep.dtype
    hidden, inter = shape.hidden, shape.intermediate
    gate_up, down = expert_weights(sweep)
    gen = torch.Generator(device="cpu").manual_seed(case.batch)

    def routing() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = torch.randn(case.batch, hidden, generator=gen).to(device, dtype)
        router = torch.randn(shape.experts, hidden, generator=gen).to(device, dtype)
        weights, picks = route(x, router, shape.top_k, renormalise=True, weights_in_model_dtype=False)
        return x, weights, picks

    first = routing()
    per_expert = (2 * inter * hidden if group == "gate_up" else hidden * inter) * gate_up.element_size()
    hit = int(first[2].unique().numel()) * per_expert
    copies = [first] + [routing() for _ in range(copies_for(hit) - 1)] if device.type == "cuda" else [first]
    x, weights, picks = first
    truth = experts_reference(x.float(), weights, picks, gate_up.float(), down.float())
    pairs = case.batch * shape.top_k
    act_rows = x.new_empty(pairs, inter).normal_()
    out_rows = x.new_empty(pairs, hidden if group == "down" else inter)

    def launch(copy: tuple[torch.Tensor, torch.Tensor, torch.Tensor], tilings: dict[str, Tiling]):
        cx, cweights, cpicks = copy
        if not use_triton(cx):  # the CPU smoke without the interpreter: what the node runs there
            return lambda: routed_experts(cx, cweights, cpicks, gate_up, down, tilings)
        from kernels.moe.triton_kernel import _Grouped

        grouped = _Grouped(cx, cpicks, shape.experts, tilings)
        if group == "gate_up":
            return lambda: grouped.gemm(cx, gate_up, out_rows, "gate_up", per_token=True, gated=True)
        flat = cweights.reshape(-1).contiguous()
        return lambda: grouped.gemm(act_rows, down, out_rows, "down", per_token=False, weights=flat)

    trials = []
    for option in options:
        tilings = {**DEFAULT_TUNING.moe_tilings, group: option}

        def check(t=tilings) -> list[str]:
            err = rel_err(routed_experts(x, weights, picks, gate_up, down, t), truth)
            return [] if err <= MAX_REL_ERR else [f"rel err {err:.1e} at {case.batch} rows"]

        def timed(timer, t=tilings) -> float:
            return timer(lambda copy: launch(copy, t), copies)

        trials.append(Trial(check, timed))
    activations = pairs * (2 * inter if group == "gate_up" else inter + hidden) * gate_up.element_size()
    return trials, hit + activations


# (one launch or two, columns a tile, warps): what the node's sweep tries for each pair's LoRA.
LORA_LAUNCHES: tuple[Tiling, ...] = tuple((one, width, warps) for one in (0, 1) for width in (128, 256)
                                          for warps in (2, 4))


def expert_lora_options(case_group: str) -> list[Tiling]:
    """The pair LoRA launches (Tuning.moe_lora_launches) a sweep tries for a group, the
    default first."""
    default = DEFAULT_TUNING.moe_lora_launches[case_group.removeprefix("experts.")]
    return [default] + [launch for launch in LORA_LAUNCHES if launch != default]


def expert_lora_trials(sweep: "Sweep", case: "Case", options: Sequence[Tiling]) -> tuple[list["Trial"], int]:
    """(a trial per launch option, the bytes one launch must move) for the LoRA of
    `case.adapters` adapters of the sweep's rank on every expert of one group, token t on
    adapter t mod N: each option checked against pair_lora_reference, and timed as the pair
    launches alone over routings of their own, enough that the LoRA rows they hit overflow
    L2 together."""
    from kernels.dispatch import use_triton
    from kernels.moe.reference import pair_lora_reference

    from .sweep import MAX_REL_ERR, Trial, copies_for, rel_err

    group = case.group.removeprefix("experts.")
    shape, device, dtype = sweep.shape, sweep.device, sweep.dtype
    dims = {"hidden": shape.hidden, "inter": shape.intermediate, "experts": shape.experts}
    gen = torch.Generator(device="cpu").manual_seed(case.batch * 1000 + case.adapters)
    gate_up_lora, down_lora = lora_arenas(dims, case.adapters, sweep.rank, case.batch, device, dtype,
                                          case.batch * 1000 + case.adapters)
    lora = gate_up_lora if group == "gate_up" else down_lora
    width_in = shape.hidden if group == "gate_up" else shape.intermediate
    width_out = 2 * shape.intermediate if group == "gate_up" else shape.hidden
    rows = case.batch if group == "gate_up" else case.batch * shape.top_k  # down's input: a row a pair

    def routing() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = torch.randn(case.batch, shape.hidden, generator=gen).to(device, dtype)
        router = torch.randn(shape.experts, shape.hidden, generator=gen).to(device, dtype)
        weights, picks = route(x, router, shape.top_k, renormalise=True, weights_in_model_dtype=False)
        a = x if group == "gate_up" else torch.randn(rows, width_in, generator=gen).to(device, dtype)
        return a, weights.reshape(-1).contiguous(), picks

    first = routing()
    hit = lora_bytes(first[2], case.adapters, sweep.rank, shape.hidden, shape.intermediate,
                     torch.finfo(dtype).bits // 8, (group,))
    copies = [first] + [routing() for _ in range(copies_for(hit) - 1)] if device.type == "cuda" else [first]
    a, flat, picks = first
    pairs = picks.numel()
    truth = torch.zeros(pairs, width_out, device=device)
    pair_lora_reference(a, picks, lora, truth, x_per_pair=group == "down")
    if group == "down":
        truth.mul_(flat[:, None])
    out = a.new_zeros(pairs, width_out)

    def launch(copy, option: Tiling):
        ca, cflat, cpicks = copy
        weights = cflat if group == "down" else None
        if not use_triton(ca):  # the CPU smoke without the interpreter: what the node runs there
            return lambda: pair_lora_reference(ca, cpicks, lora, out, x_per_pair=group == "down")
        from kernels.moe.triton_kernel import one_launch, pair_lora_triton

        launches, width, warps = option
        return lambda: pair_lora_triton(ca, cpicks, lora, out, group == "down", weights, num_warps=warps,
                                        fused=one_launch(launches, cpicks.numel(), device), width=width)

    trials = []
    for option in options:
        def check(o=option) -> list[str]:
            out.zero_()
            launch(first, o)()
            got = out.float() * (1 if use_triton(a) or group == "gate_up" else flat[:, None])
            err = rel_err(got, truth)
            return [] if err <= MAX_REL_ERR else [f"rel err {err:.1e} at {case.batch} rows"]

        def timed(timer, o=option) -> float:
            return timer(lambda copy: launch(copy, o), copies)

        trials.append(Trial(check, timed))
    return trials, hit + pairs * (width_in + 2 * width_out) * torch.finfo(dtype).bits // 8


def expert_weights(sweep: "Sweep") -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's gate/up [E, 2 * inter, hidden] and down [E, hidden, inter], random, made on
    the device once per sweep (30B-A3B's: 1.2 GB; one layer's experts overflow L2 by far)."""
    if "experts" not in sweep._weights:
        shape = sweep.shape
        gen = torch.Generator(device=sweep.device).manual_seed(0)
        make = lambda *size: (torch.randn(*size, generator=gen, device=sweep.device) * size[-1] ** -0.5  # noqa: E731
                              ).to(sweep.dtype)
        sweep._weights["experts"] = [make(shape.experts, 2 * shape.intermediate, shape.hidden),
                                     make(shape.experts, shape.hidden, shape.intermediate)]
    gate_up, down = sweep._weights["experts"]
    return gate_up, down


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
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = shape_of(args.model, args)
    bandwidth = None
    if device.type == "cuda":
        from .sweep import copy_bandwidth

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
