"""The kernel profiles' and sweeps' helpers (bench/tune_kernels.py, decode_profile.py,
prefill_profile.py and the sweeps use them; they leave bench/ together): the profiled adapter
configurations in slots, a random model built without a node, kernel families from
torch.profiler. The benchmarks' own helpers are in bench/harness.py."""
from __future__ import annotations

import json
import re
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable

import torch

from bench.harness import RANDOM_MODELS, copy_bandwidth, write_random_checkpoint  # noqa: F401 (the profiles')
from bench.harness import model_config as bench_model_config  # noqa: F401 (the profiles')
from bench.shapes import TINY_LLAMA  # noqa: F401 (the profiles' tests)


def time_call(fn: Callable[[], object], device: torch.device) -> float:
    """Median seconds per call."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3
    fn()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# -- the profiles' model and adapter configurations -------------------------------------------------
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
    """Random adapters of rank `rank` on `targets` in slots first..first+num-1, placed and
    written as the adapter manager does (SlotBuffers.place, write)."""
    from inference_node.adapters.weights import AdapterWeights
    from inference_node.model.llama import LORA_MODULES

    shapes = {m: (layer[group].a[i].shape[1], layer[group].b[i].shape[1])
              for layer in buffers.layers[:1] for group in layer
              for i, m in enumerate(m for m in LORA_MODULES if m in _group_modules(group))}
    dtype = buffers.layers[0]["qkv"].a_all.dtype
    slots = list(range(first, first + num))
    for s in slots:
        tensors = {(layer, m): (torch.randn(rank, shapes[m][0], dtype=dtype) * 0.02,
                                torch.randn(shapes[m][1], rank, dtype=dtype) * 0.02)
                   for layer in range(len(buffers.layers)) for m in LORA_MODULES if m in targets}
        weights = AdapterWeights(f"bench-{s}", "v", rank, 2.0,
                                 tuple(m for m in LORA_MODULES if m in targets), tensors)
        assert buffers.place(s, buffers.ranks_of(weights)), "the bench's adapters outgrow the arenas"
        event = buffers.write(s, weights)
        if event is not None:
            event.synchronize()
    return slots


def _group_modules(group: str) -> tuple[str, ...]:
    from inference_node.model.llama import FUSED_MODULES

    return FUSED_MODULES[group]


def rank_config(config: dict, tp: int) -> dict:
    """An HF config of one tensor-parallel rank's shapes (parallel/shard.py): its heads, KV
    heads and MLP width, the head size kept, and its block of the vocabulary (the LM head's).
    A model of it on one GPU runs the kernels a rank runs, with its adapters' shards (A whole
    and B split for q/k/v and gate/up, the reverse for o and down), but no collectives."""
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


def random_model(device: torch.device, dtype: torch.dtype, layers: int | None, max_positions: int,
                 gemm_groups=None, tiny: bool = False, model: str = "llama-1b-random", tp: int = 1):
    """(config, LlamaModel) of a RANDOM_MODELS shape (Llama-3.2-1B's by default, TINY_LLAMA's
    with `tiny`: smoke runs) with random weights (`layers` of them if given): made on the
    device where the shape's weights are made at load (8B, 70B), else through a checkpoint
    written to a temporary directory; `gemm_groups`: the projections laid out for the decode
    GEMM (None: the node's defaults); `tp` > 1: one tensor-parallel rank's shapes (rank_config)."""
    from inference_node.model.config import ModelConfig
    from inference_node.model.llama import LlamaModel
    from kernels.tuning import DEFAULT_TUNING

    shape, made_at_load, _ = RANDOM_MODELS["tiny" if tiny else model]
    config = dict(shape) if tp == 1 else rank_config(dict(shape), tp)
    if layers:
        config["num_hidden_layers"] = layers
    with tempfile.TemporaryDirectory() as tmp:
        if made_at_load:
            ckpt = Path(tmp) / "model"
            ckpt.mkdir()
            (ckpt / "config.json").write_text(json.dumps({**config, "torch_dtype": str(dtype).removeprefix("torch.")}))
        else:
            ckpt = write_random_checkpoint(Path(tmp) / "model", config, dtype, device)
        return (ModelConfig.from_checkpoint(ckpt),
                LlamaModel.load(ckpt, device, dtype, max_positions=max_positions,
                                gemm_groups=gemm_groups or DEFAULT_TUNING.gemm_groups,
                                load_format="dummy" if made_at_load else "safetensors"))


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
