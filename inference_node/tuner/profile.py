"""Where a decode step's time goes: the node's decode forward, kernel by kernel, for maintainers
weighing a launch choice the tuner does not sweep.

It builds the same decode step the engine replays (DecodeGraphs, padded static buffers, one
LoRA graph per bucket of distinct adapters) at one batch size and context length over a model
of the checkpoint's shapes (random weights made on the device: only config.json is read), then
for each configuration prints the CUDA-graph replay time of the forward and, from an eager run
under torch.profiler, the GPU time per kernel family per forward.

    python -m inference_node.tuner.profile --model DIR                     # batch 64, every config
    python -m inference_node.tuner.profile --model DIR --configs base,c32 --timeline --no-profile
    python -m inference_node.tuner.profile --model DIR --tp 4 --layers 8 --configs base,c32   # one TP rank
    python -m inference_node.tuner.profile --model DIR --mode default --mode serial --no-profile
    python -m inference_node.tuner.profile --model DIR --configs base,gu32,c32 --no-profile \\
        --mode default --mode "fold_tilings=gate_up=32.128.4/silu_row_tile=512.2"
    python -m inference_node.tuner.profile --model DIR --device cpu --batch 4   # CPU smoke (no graphs)

Modes, timed side by side (interleaved bursts of graph replays, GPU time): default (the node's
defaults, kernels/tuning.py), serial (LoRA added after each matmul: inference_node/runner/lora/
eager.py), or launch choices other than the defaults, NAME=VALUE joined by "/", each NAME a
Tuning field and VALUE in the form of `inference-node serve --tune NAME=VALUE` (gemm_groups
sets the weights' layout and stays). Every mode runs over the node's tuning table for the
shape (--tuning-table, as the node resolves it, never tuning), its own choices kept; a tiling
table's groups it names replace only those groups of each bucket's tilings (mode_steps).
A mode `table=PATH` runs the defaults over that tuning table instead (tables side by side).

Configurations: base (no LoRA), b (LoRA graphs exist, no adapter used: same as base),
c1/c2/c4/c8/c16/c32/c64 (N distinct rank-16 adapters on all seven projections), d32 (32 rank-8
q/v ones), qkv32/o32/gu32/down32 (32 rank-16 ones on one fused group: that group's share of c32).
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import torch

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIGS = {  # name: (distinct adapters, rank, targets)
    "base": (0, 0, ()), "b": (0, 0, ()),
    **{f"c{n}": (n, 16, ALL) for n in (1, 2, 4, 8, 16, 32, 64)},
    "d32": (32, 8, ("q_proj", "v_proj")),
    # 32 rank-16 adapters on one fused group each: what each group's LoRA adds to the step
    # (their graphs apply that group alone: single_group_variants).
    "qkv32": (32, 16, ("q_proj", "k_proj", "v_proj")), "o32": (32, 16, ("o_proj",)),
    "gu32": (32, 16, ("gate_proj", "up_proj")), "down32": (32, 16, ("down_proj",)),
}
SINGLE_GROUP_CONFIGS = ("qkv32", "o32", "gu32", "down32")
SIDE_FAMILIES = ("lora_shrink", "lora_expand")  # what the side stream runs (runner/lora/overlap.py)


# -- the model and its adapters --------------------------------------------------------------------

def rank_config(config: dict, tp: int) -> dict:
    """An HF config of one tensor-parallel rank's shapes (parallel/shard.py): its heads, KV
    heads and MLP width, the head size kept, and its block of the vocabulary (the LM head's).
    A model of it on one GPU runs the kernels a rank runs, with its adapters' shards, but no
    collectives."""
    from inference_node.model.config import ModelConfig
    from inference_node.parallel.shard import ShardingError, check_divisible

    try:
        check_divisible(ModelConfig.from_dict(config), tp)
    except ShardingError as exc:
        raise SystemExit(f"--tp {tp}: {exc}") from None
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    return {**config, "num_attention_heads": heads // tp, "num_key_value_heads": kv_heads // tp,
            "head_dim": config.get("head_dim") or config["hidden_size"] // heads,
            "intermediate_size": config["intermediate_size"] // tp, "vocab_size": -(-config["vocab_size"] // tp)}


def random_model(checkpoint: Path, device: torch.device, dtype: torch.dtype, layers: int | None,
                 max_positions: int, tp: int = 1, quantization: str = "none"):
    """(config, LlamaModel) of the checkpoint's shapes with random weights made on the device
    (`layers` of them if given; `tp` > 1: one tensor-parallel rank's shapes, rank_config;
    quantization as `inference-node serve --quantization`)."""
    from inference_node.model.config import ModelConfig
    from inference_node.model.loader import load_model

    config = json.loads((checkpoint / "config.json").read_text())
    config = config if tp == 1 else rank_config(config, tp)
    if layers:
        config["num_hidden_layers"] = layers
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        return (ModelConfig.from_checkpoint(Path(tmp)),
                load_model(Path(tmp), device, dtype, max_positions=max_positions, load_format="dummy",
                           quantization=quantization, fp8_w8a8=quantization == "fp8-w8a8"))


def fill_slots(buffers, num: int, rank: int, targets: tuple[str, ...], first: int) -> list[int]:
    """Random adapters of rank `rank` on `targets` in slots first..first+num-1, placed and
    written as the adapter manager does (SlotBuffers.place, write)."""
    from inference_node.adapters.weights import AdapterWeights
    from inference_node.model.llama import FUSED_MODULES, LORA_MODULES

    shapes = {m: (layer[group].a[i].shape[1], layer[group].b[i].shape[1])
              for layer in buffers.layers[:1] for group in layer
              for i, m in enumerate(m for m in LORA_MODULES if m in FUSED_MODULES[group])}
    dtype = buffers.layers[0]["qkv"].a_all.dtype
    slots = list(range(first, first + num))
    for s in slots:
        tensors = {(layer, m): (torch.randn(rank, shapes[m][0], dtype=dtype) * 0.02,
                                torch.randn(shapes[m][1], rank, dtype=dtype) * 0.02)
                   for layer in range(len(buffers.layers)) for m in LORA_MODULES if m in targets}
        weights = AdapterWeights(f"profile-{s}", "v", rank, 2.0,
                                 tuple(m for m in LORA_MODULES if m in targets), tensors)
        assert buffers.place(s, buffers.ranks_of(weights)), "the profile's adapters outgrow the arenas"
        event = buffers.write(s, weights)
        if event is not None:
            event.synchronize()
    return slots


def config_slots(cfg, names: list[str], dtype: torch.dtype, device: torch.device):
    """(SlotBuffers, {config: its slots}): each named configuration's adapters (CONFIGS) in
    slots of their own, rank-16 slot buffers."""
    from inference_node.adapters.slots import SlotBuffers

    buffers = SlotBuffers(cfg, sum(CONFIGS[n][0] for n in names) or 1, 16, dtype, device)
    first, plan = 0, {}
    for n in names:
        num, rank, targets = CONFIGS[n]
        plan[n] = fill_slots(buffers, num, rank, targets, first) if num else []
        first += num
    return buffers, plan


def fake_chunks(batch: int, context: int, block_size: int, slots: list[int]) -> list:
    """Decode chunks of `batch` sequences at `context` tokens, request i on slots[i % n], in
    the engine's row order for graph steps (grouped by slot)."""
    from inference_node.runner.decode_graphs import ordered

    per_seq = -(-(context + 1) // block_size)
    chunks = []
    for i in range(batch):
        req = SimpleNamespace(num_computed=context, token_at=lambda index: 7,
                              block_ids=list(range(i * per_seq, (i + 1) * per_seq)),
                              lora_slot=slots[i % len(slots)] if slots else -1)
        chunks.append(SimpleNamespace(request=req, num_new_tokens=1, completes_prompt=True))
    return ordered(chunks)


def single_group_variants(names: list[str]) -> dict:
    """DecodeGraphs' group_variants with one variant per fused group added, where a config
    of adapters on one group is profiled (else the default variants)."""
    from inference_node.model.llama import FUSED_MODULES
    from inference_node.runner.decode_graphs import LORA_GROUP_VARIANTS

    if not set(names) & set(SINGLE_GROUP_CONFIGS):
        return {}
    singles = tuple(frozenset({g}) for g in FUSED_MODULES if frozenset({g}) not in LORA_GROUP_VARIANTS)
    return {"group_variants": singles + LORA_GROUP_VARIANTS}


# -- kernels by family -----------------------------------------------------------------------------

def family(name: str) -> str:
    """Groups kernel names: cuBLAS GEMMs, our Triton kernels by name, torch.compile fusions."""
    if re.search(r"gemm|cutlass|sm90_|nvjet|cublas", name, re.I):
        return "GEMM (cuBLAS or the Triton decode GEMM)"
    m = re.match(r"_?(lora_\w+?|paged_attention\w*?|merge_splits\w*?|add_rms_norm|silu_mul|rope_cache)_kernel", name)
    if m:
        return m.group(1)
    if name.startswith("triton_"):
        return "fused elementwise (torch.compile)"
    if "index" in name.lower() or "scatter" in name.lower():
        return "index_copy (KV write)"
    return name[:60]


def kernel_families(run, reps: int, by_name: bool = False) -> dict[str, tuple[float, int]]:
    """GPU microseconds and launches per call of `run`, by kernel family (by kernel name:
    by_name), from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            run()
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            fam = evt.name[:90] if by_name else family(evt.name)
            totals[fam][0] += evt.device_time / reps
            totals[fam][1] += 1 / reps
    return {k: (v[0], round(v[1])) for k, v in totals.items()}


def graph_timeline(graph, reps: int) -> list[dict]:
    """The kernels of `reps` replays of one captured graph, from a torch.profiler trace (CUPTI
    records a graph's kernel nodes): dicts with name, start and end in us, sorted by start.
    The eager profile cannot show where the step's chain waits for the side stream."""
    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.loads(Path(f.name).read_text())
    kernels = [dict(name=e["name"], start=float(e["ts"]), end=float(e["ts"]) + float(e["dur"]),
                    grid=tuple(e.get("args", {}).get("grid", ())))
               for e in trace.get("traceEvents", []) if e.get("cat") == "kernel"]
    return sorted(kernels, key=lambda k: k["start"])


def print_timeline(label: str, kernels: list[dict], reps: int) -> None:
    """Per replay: the time the step's chain (every kernel but the side stream's shrinks and
    expands) has nothing running, summed by the kernel that ends the gap, and the side work
    that runs while it waits. CUPTI gives a graph's branches stream ids of their own, so the
    chain is told apart by kernel, not by stream."""
    if not kernels:
        print(f"\n== {label}: the trace holds no kernels (CUPTI did not record the graph's)")
        return
    side = [k for k in kernels if family(k["name"]) in SIDE_FAMILIES]
    chain = [k for k in kernels if family(k["name"]) not in SIDE_FAMILIES]
    span = (kernels[-1]["end"] - kernels[0]["start"]) / reps
    busy = sum(k["end"] - k["start"] for k in chain) / reps
    side_busy = sum(k["end"] - k["start"] for k in side) / reps
    print(f"\n== {label}: {len(kernels) / reps:.0f} kernels a replay ({len(side) / reps:.0f} side), "
          f"{span / 1e3:.3f} ms a replay (traced, first start to last end); chain kernels' own "
          f"time {busy / 1e3:.3f} ms, side kernels' {side_busy / 1e3:.3f} ms")
    gaps: dict[str, list[float]] = defaultdict(lambda: [0.0, 0, 0.0])
    prev_end = None
    for k in chain:
        if prev_end is not None and k["start"] > prev_end:
            g = gaps[family(k["name"])]
            g[0] += k["start"] - prev_end
            g[1] += 1
            g[2] += sum(max(0.0, min(s["end"], k["start"]) - max(s["start"], prev_end))
                        for s in side)
        prev_end = k["end"] if prev_end is None else max(prev_end, k["end"])
    total = sum(g[0] for g in gaps.values()) / reps
    print(f"   chain idle {total / 1e3:.3f} ms a replay; by the kernel that ends the gap "
          f"(us a replay, gaps a replay, side kernels' time inside the gaps):")
    for fam, (us, n, side_us) in sorted(gaps.items(), key=lambda kv: -kv[1][0]):
        print(f"      {us / reps:8.1f} us  {n / reps:5.1f}  {side_us / reps:8.1f} us  {fam}")
    spans: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for k in chain:
        f = spans[family(k["name"])]
        f[0] += k["end"] - k["start"]
        f[1] += 1
    print("   chain kernels in the graph (us a replay, launches, us each):")
    for fam, (us, n) in sorted(spans.items(), key=lambda kv: -kv[1][0]):
        print(f"      {us / reps:8.1f} us  {n / reps:5.0f}  {us / n:6.1f}  {fam}")
    print("   the replay's span by the chain kernel that ends each part of it (from the end of the "
          "kernel before; with PDL a kernel's own time overlaps the one ahead, so this split sums "
          "to the span):")
    for label, (us, n) in sorted(span_shares(chain).items(), key=lambda kv: -kv[1][0]):
        print(f"      {us / reps:8.1f} us  {n / reps:5.0f}  {us / n:6.1f}  {label}")


def span_shares(chain: list[dict]) -> dict[str, list[float]]:
    """Each chain kernel's share of the span: from the latest end before it to its own end
    (the first from the first start), summed by (family, family of the kernel before it): the
    decode GEMMs share a name and are told apart by their grids and what they follow."""
    shares: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    prev_end, prev_family = min((k["start"] for k in chain), default=0.0), "start"
    for k in sorted(chain, key=lambda k: k["end"]):
        fam = family(k["name"])
        grid = f" grid {k['grid'][0]}" if k.get("grid") and fam.startswith("GEMM") else ""
        share = shares[f"{fam}{grid} (after {prev_family})"]
        share[0] += k["end"] - prev_end
        share[1] += 1
        prev_end, prev_family = k["end"], fam
    return shares


def burst_ms(graph, reps: int) -> float:
    """Mean time of `reps` back-to-back replays of one captured graph (GPU time: the inputs
    are already in place, nothing runs on the host between replays)."""
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


# -- the profile ------------------------------------------------------------------------------------

def mode_steps(table, given: dict[str, str]):
    """A mode's step tunings over the node's table (None: no table): its choices (text, as
    `serve --tune`) fixed for every bucket, except tiling tables, whose groups named in the
    mode are laid over each bucket's own (`gemm_tma_tilings=down=64.128.4` changes down and
    keeps the table's q/k/v, o and gate/up, not the defaults')."""
    from kernels.tuning import DEFAULT_TUNING, tuning_from_text
    from kernels.tuning_table import StepTunings, is_tiling_table

    tuning = tuning_from_text(given) if given else DEFAULT_TUNING
    if table is None:
        return StepTunings.fixed(tuning)
    overlays = {name: {group: getattr(tuning, name)[group] for group in _named_groups(text)}
                for name, text in given.items() if is_tiling_table(name)}
    steps = table.tunings(tuning, fixed=[name for name in given if name not in overlays])
    if not overlays:
        return steps
    return steps.map(lambda t: t.replace(**{name: {**getattr(t, name), **over} for name, over in overlays.items()}))


def _named_groups(text: str) -> list[str]:
    """The groups a tiling table's text (`qkv=32.256.4,o=16.128.4`) names."""
    return [item.partition("=")[0] for item in text.split(",") if item and item != "none"]


def applier_factory(mode: str, buffers, batch: int, tuning):
    """The decode graphs' LoRA applier factory of a mode: serial, LoRA after each matmul;
    any other, the node's own (runner/lora/plan.py: beside the matmuls up to the decode GEMM's
    rows, after them in larger batches, whose matmuls are cuBLAS's)."""
    from inference_node.runner.lora.eager import StepLoraApplier
    from inference_node.runner.lora.plan import GraphAppliers

    if mode == "serial":
        return lambda meta, groups: StepLoraApplier(buffers, meta, groups)
    return GraphAppliers(buffers, batch, tuning).applier


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, type=Path,
                   help="a checkpoint folder: only its config.json is read (random weights made on the device)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=200, help="tokens already in each sequence's KV")
    p.add_argument("--configs", default="base,c1,c8,c32,c64,d32")
    p.add_argument("--layers", type=int, default=None, help="fewer layers (a 70B rank on one GPU, smoke runs)")
    p.add_argument("--tp", type=int, default=1,
                   help="one tensor-parallel rank of this many on one GPU: its shard's shapes, its "
                        "adapters' shards, its tuning table and the LoRA choices TP forces (o and "
                        "down expand before their all-reduce); no collectives, and o's and down's "
                        "delta added in the add + norm instead of before an all-reduce")
    p.add_argument("--quantization", default="none", choices=("none", "fp8", "fp8-w8a8"),
                   help="the projections in FP8, as `inference-node serve --quantization`")
    p.add_argument("--reps", type=int, default=20, help="replays per burst, forwards per profile")
    p.add_argument("--rounds", type=int, default=15, help="interleaved bursts per mode and config")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--mode", dest="modes", action="append", default=None,
                   help="repeatable: default, serial, or NAME=VALUE/NAME=VALUE... (kernels/tuning.py "
                        "choices other than the defaults); default: --mode default --mode serial")
    p.add_argument("--no-profile", action="store_true", help="replay times only, no profiler")
    p.add_argument("--by-name", action="store_true", help="profile by kernel name, not family")
    p.add_argument("--tuning-table", default="auto",
                   help="per-bucket launch choices, as `inference-node serve --tuning-table` resolves them "
                        "(auto: the seed or this host's cached table; never tuned here), off, or a path")
    p.add_argument("--timeline", action="store_true",
                   help="trace graph replays: where the step's chain of kernels idles, and why")
    args = p.parse_args(argv)
    modes = args.modes or ["default", "serial"]
    names = [c for c in args.configs.split(",") if c]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"--configs: unknown {unknown}; expected some of {', '.join(CONFIGS)}")

    from inference_node.engine.kv_cache import KVCache
    from inference_node.parallel.shard import tensor_parallel_tuning
    from inference_node.runner.decode_graphs import DecodeGraphs, GraphLora
    from inference_node.runner.launches import StepLaunches
    from kernels.tuning_table import ModelShape, load_table

    from .tune import node_table

    device, dtype = torch.device(args.device), torch.bfloat16
    cuda = device.type == "cuda"
    block = 16
    max_len = args.context + 64
    cfg, model = random_model(args.model, device, dtype, args.layers, max_len, tp=args.tp,
                              quantization=args.quantization)
    per_seq = -(-(max_len + 1) // block)
    kv = KVCache(cfg, args.batch * per_seq + 1, block, dtype, device)
    buffers, plan = config_slots(cfg, names, dtype, device)
    found = node_table(args.tuning_table, device, ModelShape.of(cfg), dtype, budget_s=0,
                       quantization=args.quantization)
    table = found.table
    print(f"tuning table: {found.describe()}")
    all_graphs = {}
    effective: dict[str, object] = {}  # each mode's step tunings as the model maps them
    for mode in modes:
        own = mode.removeprefix("table=") if mode.startswith("table=") else None
        given = ({} if mode in ("default", "serial") or own is not None
                 else dict(item.split("=", 1) for item in mode.split("/")))
        steps = mode_steps(table if own is None else load_table(own, ModelShape.of(cfg)), given)
        if args.tp > 1:  # as a tensor-parallel node maps every bucket's tuning
            steps = steps.map(tensor_parallel_tuning)
        steps = steps.map(model.step_tuning)  # as the node maps it
        unfoldable = model.unfoldable_groups()
        same = next((m for m, s in effective.items() if s == steps and (m == "serial") == (mode == "serial")), None)
        if same is not None:  # e.g. fold choices on a model whose matmuls fold nothing (FP8)
            print(f"[{mode}] note: the same launches as [{same}] once mapped for this model "
                  f"(groups folding no LoRA: {', '.join(sorted(unfoldable)) or 'none'}; --tp rules)")
        effective[mode] = steps
        lora = GraphLora(applier_factory(mode, buffers, args.batch, steps.base), buffers.max_loras,
                         buffers.groups_of, buffers.module_rows)
        graphs = DecodeGraphs(model, StepLaunches(device, steps, model.gemm_groups), kv,
                              scratch_block=args.batch * per_seq,
                              max_model_len=max_len, max_batch=args.batch, lora=lora,
                              **single_group_variants(names))
        graphs.sizes = [args.batch]  # only the batch size profiled here
        t = time.perf_counter()
        graphs.capture_all()
        all_graphs[mode] = graphs
        print(f"[{mode}] device {torch.cuda.get_device_name(device) if cuda else 'CPU'}, batch "
              f"{args.batch}, context {args.context}, {cfg.num_layers} layers; graphs captured in "
              f"{time.perf_counter() - t:.1f}s")
    # The modes take turns (--rounds times, each a burst of replays) so that drift of the
    # machine lands on all of them alike; inputs are written once, so this is GPU time only.
    replays: dict[tuple[str, str], float] = {}
    for n in names:
        chunks = fake_chunks(args.batch, args.context, block, plan[n])
        distinct = len(set(plan[n][:args.batch]))  # a batch of fewer rows than adapters uses fewer
        keys = {}
        for mode, graphs in all_graphs.items():
            segments = next((b for b in graphs.segment_buckets(args.batch) if b >= distinct), 0) if distinct else 0
            graphs._fill(chunks, args.batch, segments)
            keys[mode] = (args.batch, segments, graphs.variant_for(set(plan[n])) if distinct else 0)
            if not cuda:
                graphs._forward(*keys[mode])
                print(f"[{mode}] {n}: eager forward ran (CPU: no timings)")
        if not cuda:
            continue
        bursts = {mode: [] for mode in modes}
        for _ in range(args.rounds):
            for mode, graphs in all_graphs.items():
                bursts[mode].append(burst_ms(graphs._graphs[keys[mode]][0], args.reps))
        for mode in modes:
            replays[(mode, n)] = statistics.median(bursts[mode])
        if args.timeline:
            for mode, graphs in all_graphs.items():
                print_timeline(f"[{mode}] {n} graph", graph_timeline(
                    graphs._graphs[keys[mode]][0], args.reps), args.reps)
        if args.no_profile:
            continue
        for mode, graphs in all_graphs.items():
            fams = kernel_families(lambda g=graphs, k=keys[mode]: g._forward(*k), args.reps,
                                   args.by_name)
            gpu_total = sum(v[0] for v in fams.values())
            launches = sum(v[1] for v in fams.values())
            print(f"\n== [{mode}] {n}: graph replay {replays[(mode, n)]:.3f} ms; eager kernels "
                  f"{gpu_total / 1e3:.3f} ms GPU time in {launches} launches")
            for fam, (us, count) in sorted(fams.items(), key=lambda kv: -kv[1][0])[:args.top]:
                print(f"   {us / 1e3:8.3f} ms  {count:5d} x  {us / max(count, 1):7.1f} us  {fam}")
    if replays:
        base = {m: replays.get((m, "base")) for m in modes}
        print(f"\ngraph replay of one decode forward, GPU time, ms (extra over base in brackets); "
              f"median of {args.rounds} interleaved bursts of {args.reps} replays")
        print("modes:", ", ".join(f"[{i}] {m}" for i, m in enumerate(modes)))
        print("config  " + "".join(f"{'[' + str(i) + ']':>20}" for i in range(len(modes))))
        for n in names:
            cells = []
            for m in modes:
                ms = replays[(m, n)]
                extra = f" (+{ms - base[m]:.3f})" if base[m] is not None and n != "base" else ""
                cells.append(f"{ms:.3f}{extra}".rjust(20))
            print(f"{n:<8}" + "".join(cells))


if __name__ == "__main__":
    main()
