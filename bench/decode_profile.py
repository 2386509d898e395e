"""Where a decode step's time goes: the node's decode forward, kernel by kernel.

serving_bench.py says how far a step is from its floor; this script says which kernels make up
the gap. It builds the same decode step the engine replays (DecodeGraphs, padded static
buffers, one LoRA graph per bucket of distinct adapters) at one batch size and context length,
then for each configuration prints the CUDA-graph replay time of the forward and, from an
eager run under torch.profiler, the GPU time per kernel family per forward.

    python bench/decode_profile.py                       # CUDA: Llama-3.2-1B-shaped, batch 64
    python bench/decode_profile.py --configs base,c32    # a subset
    python bench/decode_profile.py --device cpu --layers 2 --batch 4   # CPU smoke (no graphs)
    python bench/decode_profile.py --modes overlap,serial --no-profile  # replay times only

LoRA modes, timed side by side (interleaved bursts of graph replays, GPU time): overlap (the
engine's default: LoRA on a side stream beside each base matmul, adapters/overlap.py, the
main stream at high CUDA priority, segments read from the segment table), overlap-gather (the
same, with the kernels gathering rows through sorted ids as before the table), overlap-equal (both streams at default priority),
overlap-side-high (the side stream high instead), overlap-carveN (the base matmuls of LoRA graphs
leave N SMs free for LoRA, N in 8, 16, 24, 32, 48), overlap-sidexN (steps of up to N distinct
adapters run the expands on the side stream too, into delta buffers, N in 0, 2, 4, 8, 64, 128,
and no group's own bound), overlap-sidedownN (down's own bound N in 0, 16, 64),
overlap-side{gate_up,o,qkv}32 (that group's expand beside its matmul up to 32 adapters too),
overlap-fold-G+G.. or overlap-fold-all (those groups' LoRA folded into their matmuls,
kernels/lora_gemm.py), overlap-sfold-G+G.. (their shrink only), overlap-x/key=value/...
(any mix: fold, sfold, sidedown, nsplit, nsplitg (the add + norms split), nshrink (the
shrinks in the add + norm before), tile=qkv:32.256.4+... for the folds' GEMM tilings,
btile=... for the plain TMA GEMM's (base graphs too), apf=N for the columns of A their
shrink programs ask of L2 before their wait in whole folds and in the shrink-only folds of
apfg=G+G.., silub=C.W for the columns and warps of a SiLU program expanding gate/up's
delta) and serial (LoRA added after each matmul).

Configurations: base (no LoRA), b (LoRA graphs exist, no adapter used: same as base),
c1/c2/c4/c8/c16/c32/c64 (N distinct rank-16 adapters on all seven projections), d32 (32 rank-8 q/v ones),
qkv32/o32/gu32/down32 (32 rank-16 ones on one fused group: that group's share of c32).
"""
from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from serving_bench import LLAMA_3_2_1B, write_random_checkpoint  # noqa: E402

CONFIGS = {  # name: (distinct adapters, rank, targets)
    "base": (0, 0, ()),
    "c1": (1, 16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    "c2": (2, 16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    "c4": (4, 16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    "c8": (8, 16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    "c16": (16, 16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    "c32": (32, 16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    "c64": (64, 16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    "d32": (32, 8, ("q_proj", "v_proj")),
    # 32 rank-16 adapters on one fused group each: what each group's LoRA adds to the step
    # (their graphs apply that group alone: SINGLE_GROUP_VARIANTS).
    "qkv32": (32, 16, ("q_proj", "k_proj", "v_proj")),
    "o32": (32, 16, ("o_proj",)),
    "gu32": (32, 16, ("gate_proj", "up_proj")),
    "down32": (32, 16, ("down_proj",)),
}
SINGLE_GROUP_CONFIGS = ("qkv32", "o32", "gu32", "down32")


def fill_slots(buffers, num: int, rank: int, targets: tuple[str, ...], first: int) -> list[int]:
    """Random A/B in slots first..first+num-1 for `targets`, rank `rank` (the rest zero)."""
    from inference_node.model.llama import FUSED_MODULES

    slots = list(range(first, first + num))
    for layer in buffers.layers:
        for group, modules in FUSED_MODULES.items():
            buf = layer[group]
            for i, module in enumerate(modules):
                for s in slots:
                    buf.a[i][s].zero_()
                    buf.b[i][s].zero_()
                    if module in targets:
                        buf.a[i][s, :rank].normal_(0, 0.02)
                        buf.b[i][s, :, :rank].normal_(0, 0.02)
    for s in slots:
        buffers.scaling[s] = 2.0
        buffers.set_ranks(s, rank, set(targets))
    return slots


def fake_chunks(batch: int, context: int, block_size: int, slots: list[int]) -> list:
    """Decode chunks of `batch` sequences at `context` tokens, request i on slots[i % n], in
    the engine's row order for graph steps (grouped by slot)."""
    from inference_node.engine.decode_graphs import ordered

    per_seq = -(-(context + 1) // block_size)
    chunks = []
    for i in range(batch):
        req = SimpleNamespace(num_computed=context, token_at=lambda index: 7,
                              block_ids=list(range(i * per_seq, (i + 1) * per_seq)),
                              lora_slot=slots[i % len(slots)] if slots else -1)
        chunks.append(SimpleNamespace(request=req, num_new_tokens=1, completes_prompt=True))
    return ordered(chunks)


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
    The eager profile above cannot show where the step's chain waits for the side stream."""
    import json
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
    kernels = [dict(name=e["name"], start=float(e["ts"]), end=float(e["ts"]) + float(e["dur"]))
               for e in trace.get("traceEvents", []) if e.get("cat") == "kernel"]
    return sorted(kernels, key=lambda k: k["start"])


SIDE_FAMILIES = ("lora_shrink", "lora_expand")  # what the side stream runs (adapters/overlap.py)


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


def random_model(device: torch.device, dtype: torch.dtype, layers: int | None, max_positions: int):
    """(config, LlamaModel) of Llama-3.2-1B's shapes with random weights (`layers` of them if
    given), through a checkpoint written to a temporary directory."""
    from inference_node.model.config import ModelConfig
    from inference_node.model.llama import LlamaModel

    config = dict(LLAMA_3_2_1B)
    if layers:
        config["num_hidden_layers"] = layers
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_random_checkpoint(Path(tmp) / "model", config, dtype, device)
        return (ModelConfig.from_checkpoint(ckpt),
                LlamaModel.load(ckpt, device, dtype, max_positions=max_positions))


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


def single_group_variants(names: list[str]) -> dict:
    """DecodeGraphs' group_variants with one variant per fused group added, where a config
    of adapters on one group is profiled (else the default variants)."""
    from inference_node.engine.decode_graphs import LORA_GROUP_VARIANTS
    from inference_node.model.llama import FUSED_MODULES

    if not set(names) & set(SINGLE_GROUP_CONFIGS):
        return {}
    singles = tuple(frozenset({g}) for g in FUSED_MODULES if frozenset({g}) not in LORA_GROUP_VARIANTS)
    return {"group_variants": singles + LORA_GROUP_VARIANTS}


def tilings_option(mode: str, option: str = "tile") -> dict[str, tuple[int, int, int]]:
    """An overlap-x mode's tile=group:block_n.block_k.stages+... (kernels/decode_gemm.py:
    FOLD_TILINGS entries replaced while its graphs are captured; option btile: the plain
    TMA GEMM's TMA_TILINGS, base graphs included)."""
    out = {}
    for item in mode.removeprefix("overlap-x/").split("/"):
        key, _, value = item.partition("=")
        for entry in value.split("+") if key == option else ():
            group, _, sizes = entry.partition(":")
            out[group] = tuple(int(v) for v in sizes.split("."))
    return out


def mode_option(mode: str, key: str) -> str | None:
    """The value of an overlap-x mode's key=value option, None where the mode has none (the
    model GEMM's options while its graphs are captured: apf=N, DecodeGemm.shrink_prefetch;
    silub=C.W,
    kernels/silu_mul_triton.py: ROW_TILE)."""
    for item in mode.removeprefix("overlap-x/").split("/"):
        name, _, value = item.partition("=")
        if name == key:
            return value
    return None


def group_set(value: str) -> frozenset[str]:
    """G+G.. or none, as a set of fused groups."""
    return frozenset() if value == "none" else frozenset(value.split("+"))


def overlap_options(mode: str) -> dict:
    """LoraOverlap's keyword arguments from an overlap-x/key=value/... mode name."""
    parse = {"fold": ("fold_groups", group_set), "sfold": ("shrink_fold_groups", group_set),
             "sidedown": ("side_expand_group_segments", lambda v: {"down": int(v)}),
             "nsplit": ("norm_split", int), "nsplitg": ("split_groups", group_set)}
    options = {}
    for item in mode.removeprefix("overlap-x/").split("/"):
        key, _, value = item.partition("=")
        if key in ("tile", "btile", "apf", "silub"):  # the model's kernels take these, below
            continue
        if key not in parse:
            raise SystemExit(f"{mode}: unknown option {key!r}, expected {', '.join(parse)}")
        name, convert = parse[key]
        options[name] = convert(value)
    return options


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=200, help="tokens already in each sequence's KV")
    p.add_argument("--configs", default="base,c1,c8,c32,c64,d32")
    p.add_argument("--layers", type=int, default=None, help="fewer layers (smoke runs)")
    p.add_argument("--reps", type=int, default=20, help="replays per burst, forwards per profile")
    p.add_argument("--rounds", type=int, default=15, help="interleaved bursts per mode and config")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--modes", default="overlap,serial",
                   help="LoRA modes: overlap, overlap-gather, overlap-equal, overlap-side-high, "
                        "overlap-carveN, overlap-sidexN, overlap-sidedownN, "
                        "overlap-side{gate_up,o,qkv}32, serial")
    p.add_argument("--no-profile", action="store_true", help="replay times only, no profiler")
    p.add_argument("--by-name", action="store_true", help="profile by kernel name, not family")
    p.add_argument("--timeline", action="store_true",
                   help="trace graph replays: where the step's chain of kernels idles, and why")
    args = p.parse_args()

    from inference_node.adapters.applier import StepLoraApplier
    from inference_node.adapters.overlap import SIDE_EXPAND_GROUP_SEGMENTS, LoraOverlap
    from inference_node.engine.decode_graphs import MAIN_STREAM_PRIORITY, DecodeGraphs
    from inference_node.engine.kv_cache import KVCache
    from inference_node.model.llama import FUSED_MODULES
    import kernels.silu_mul_triton as silu_kernel

    device, dtype = torch.device(args.device), torch.bfloat16
    cuda = device.type == "cuda"
    names = [c for c in args.configs.split(",") if c]
    block = 16
    max_len = args.context + 64
    cfg, model = random_model(device, dtype, args.layers, max_len)
    per_seq = -(-(max_len + 1) // block)
    kv = KVCache(cfg, args.batch * per_seq + 1, block, dtype, device)
    buffers, plan = config_slots(cfg, names, dtype, device)
    total_slots = buffers.max_loras
    high = MAIN_STREAM_PRIORITY  # CUDA stream priorities: lower is higher, 0 the default (lowest)
    ranks = buffers.module_ranks
    modes_setup = {  # mode: (applier factory, priority of the graph's main stream, segment table)
        "overlap": (LoraOverlap(buffers, args.batch).applier, high, ranks),
        "overlap-gather": (LoraOverlap(buffers, args.batch).applier, high, None),
        "serial": (lambda meta, groups: StepLoraApplier(buffers, meta, groups), high, ranks)}
    # The same as overlap, with steps of up to N distinct adapters expanding on the side stream
    # (adapters/overlap.py, side_expand_segments; the engine's default is overlap's).
    for n in (0, 2, 4, 8, 64, 128):
        modes_setup[f"overlap-sidex{n}"] = (
            LoraOverlap(buffers, args.batch, side_expand_segments=n,
                        side_expand_group_segments={}).applier, high, ranks)
    # The same as overlap, with one group's own bound changed (SIDE_EXPAND_GROUP_SEGMENTS):
    # down expanded beside its matmul up to N segments (0: only in overlap's few-adapter
    # steps), or gate/up, o, q/k/v up to 32.
    for n in (0, 16, 64):
        modes_setup[f"overlap-sidedown{n}"] = (
            LoraOverlap(buffers, args.batch, side_expand_group_segments={"down": n}).applier,
            high, ranks)
    for group in ("gate_up", "o", "qkv"):
        modes_setup[f"overlap-side{group}32"] = (
            LoraOverlap(buffers, args.batch, side_expand_group_segments={
                **SIDE_EXPAND_GROUP_SEGMENTS, group: 32}).applier, high, ranks)
    modes = [m for m in args.modes.split(",") if m]
    # The same as overlap, with the named groups' LoRA folded into their matmuls
    # (kernels/lora_gemm.py): overlap-fold-all, overlap-fold-gate_up+o, ...
    for mode in modes:
        if mode.startswith("overlap-fold-"):
            named = mode.removeprefix("overlap-fold-")
            fold = frozenset(FUSED_MODULES) if named == "all" else frozenset(named.split("+"))
            modes_setup[mode] = (LoraOverlap(buffers, args.batch, fold_groups=fold).applier,
                                 high, ranks)
    # The same as overlap, with the named groups' shrink folded into their matmuls and the
    # op after it expanding (GemmLora.expand False): overlap-sfold-qkv, overlap-sfold-none (every
    # shrink on the side stream), ...
    for mode in modes:
        if mode.startswith("overlap-sfold-"):
            named = mode.removeprefix("overlap-sfold-")
            named = frozenset() if named == "none" else frozenset(named.split("+"))
            modes_setup[mode] = (LoraOverlap(buffers, args.batch, shrink_fold_groups=named).applier,
                                 high, ranks)
    # Any mix of the above: overlap-x/fold=none/sfold=qkv+gate_up+o/sidedown=0/nsplit=512
    # (LoraOverlap's fold_groups, shrink_fold_groups, down's side-expand bound, norm_split).
    for mode in modes:
        if mode.startswith("overlap-x/"):
            modes_setup[mode] = (LoraOverlap(buffers, args.batch, **overlap_options(mode)).applier,
                                 high, ranks)
    all_graphs = {}
    for mode in modes:
        factory, main_priority, table_ranks = modes_setup[mode]
        graphs = DecodeGraphs(model, kv, scratch_block=args.batch * per_seq, max_model_len=max_len,
                              max_batch=args.batch, max_loras=total_slots,
                              lora_applier=factory,
                              groups_of=buffers.groups_of, module_ranks=table_ranks,
                              **single_group_variants(names))
        graphs.sizes = [args.batch]  # only the batch size profiled here
        t = time.perf_counter()
        gemm = model.gemm
        defaults = gemm.fold_tilings, gemm.shrink_prefetch
        tma_default = gemm.tma_tilings
        gemm.fold_tilings = {**defaults[0], **tilings_option(mode)}
        gemm.tma_tilings = {**tma_default, **tilings_option(mode, "btile")}
        apf = mode_option(mode, "apf")
        gemm.shrink_prefetch = defaults[1] if apf is None else int(apf)
        silub = mode_option(mode, "silub")
        silu_default = silu_kernel.ROW_TILE
        if silub is not None:
            silu_kernel.ROW_TILE = tuple(int(v) for v in silub.split("."))
        graphs.capture_all()
        gemm.fold_tilings, gemm.shrink_prefetch = defaults
        gemm.tma_tilings = tma_default
        silu_kernel.ROW_TILE = silu_default
        all_graphs[mode] = graphs
        print(f"[{mode}] device {torch.cuda.get_device_name(device) if cuda else 'CPU'}, batch "
              f"{args.batch}, context {args.context}, {cfg.num_layers} layers; graphs captured in "
              f"{time.perf_counter() - t:.1f}s")
    # The modes take turns (--rounds times, each a burst of replays) so that drift of the
    # machine lands on all of them alike; inputs are written once, so this is GPU time only.
    replays: dict[tuple[str, str], float] = {}
    for n in names:
        chunks = fake_chunks(args.batch, args.context, block, plan[n])
        distinct = len(set(plan[n]))
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
        print("config  " + "".join(f"{m:>20}" for m in modes))
        for n in names:
            cells = []
            for m in modes:
                ms = replays[(m, n)]
                extra = f" (+{ms - base[m]:.3f})" if base[m] is not None and n != "base" else ""
                cells.append(f"{ms:.3f}{extra}".rjust(20))
            print(f"{n:<8}" + "".join(cells))

if __name__ == "__main__":
    main()
