"""What the benchmarks share: the named models (shapes with random weights: nothing is
downloaded), random checkpoints and adapters, nodes built one way (a NodeConfig, in process
through `LLM` or served as `inference-node serve` with the same flags), the synthetic
workload, one timer, percentiles, tables, the floors (the bytes a decode step must read over
the device's copy bandwidth) and JIT-compile counting."""
from __future__ import annotations

import argparse
import bisect
import contextlib
import dataclasses
import gc
import itertools
import json
import logging
import math
import os
import random
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence

import torch

from bench.shapes import FAMILY_SHAPES, LLAMA_3_1_70B, LLAMA_3_1_8B, LLAMA_3_2_1B, MOE_SHAPES, TINY_LLAMA

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION_MODULES = ALL_MODULES[:4]
QV = ("q_proj", "v_proj")
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


# -- models ----------------------------------------------------------------------------------------
class RandomModel(NamedTuple):
    config: dict         # the Hugging Face config.json
    made_at_load: bool   # weights made on the device by the node (--load-format dummy), else written once
    description: str


# The named shapes (bench/shapes.py), each with random weights.
RANDOM_MODELS: dict[str, RandomModel] = {
    "llama-1b-random": RandomModel(LLAMA_3_2_1B, False, "Llama-3.2-1B-shaped, random weights"),
    "llama-8b-random": RandomModel(LLAMA_3_1_8B, True, "Llama-3.1-8B-shaped (vocab 49,152), random weights"),
    "llama-70b-random": RandomModel(LLAMA_3_1_70B, True, "Llama-3.1-70B-shaped (vocab 49,152), random weights"),
    "tiny": RandomModel(TINY_LLAMA, False, "tiny Llama-shaped, random weights"),
    # The served families' real widths (bench/shapes.py: vocabulary 49,152), weights made at load.
    **{f"{name}-random": RandomModel(config, True, f"{config['architectures'][0]} {name.split('-', 1)[1]}-shaped "
                                                   f"(vocab {config['vocab_size']:,}), random weights")
       for name, config in {**FAMILY_SHAPES, **MOE_SHAPES}.items()},
}
MODEL_HELP = ("a named shape with random weights (" + ", ".join(RANDOM_MODELS) + "), 'embedded' (SmolLM2-135M) "
              "or an HF safetensors checkpoint folder")


@dataclass(frozen=True)
class BenchModel:
    """A benchmark's model: its checkpoint folder (with a tokenizer: a node needs one), how the
    node loads it, what to print."""

    checkpoint: Path
    load_format: str   # "dummy": random weights of config.json's shapes, made on the device
    description: str


def embedded_checkpoint() -> Path:
    from inference_node.model.embedded import default_checkpoint

    return default_checkpoint()


def tokenizer_source() -> Path:
    """Where a random checkpoint's tokenizer comes from: the folder LORA_TEST_TOKENIZER_DIR
    names (a GPU machine without the embedded model's package, tools/gpu_machine_kit.py), else
    the embedded model's."""
    folder = os.environ.get("LORA_TEST_TOKENIZER_DIR")
    return Path(folder) if folder else embedded_checkpoint()


def bench_model(name: str, work: Path, dtype: torch.dtype, device: torch.device, seed: int = 0) -> BenchModel:
    """A RANDOM_MODELS shape (its config and the embedded model's tokenizer in `work`, the
    weights written once unless the node makes them at load: every tensor the node's loader
    reads, norms 1, the rest random), 'embedded' or a folder."""
    from inference_node.model.loader import checkpoint_shapes

    if name not in RANDOM_MODELS:
        folder = embedded_checkpoint() if name == "embedded" else Path(name)
        return BenchModel(folder, "safetensors", "embedded SmolLM2-135M" if name == "embedded" else folder.name)
    config, made_at_load, description = RANDOM_MODELS[name]
    folder = work / (name.replace("-random", "-dummy") if made_at_load else f"{name}-{dtype_name(dtype)}")
    folder.mkdir(parents=True, exist_ok=True)
    if not made_at_load and not (folder / "model.safetensors").exists():
        gen = torch.Generator(device=device).manual_seed(seed)
        shapes = {("" if n.startswith("lm_head") else "model.") + n: s
                  for n, s in checkpoint_shapes(model_config(name)).items()}
        save_streamed(folder / "model.safetensors", shapes, dtype, lambda n, s: torch.ones(s) if n.endswith(
            "norm.weight") else torch.randn(*s, generator=gen, device=device) * 0.02)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    copy_tokenizer(tokenizer_source(), folder)
    return BenchModel(folder, "dummy" if made_at_load else "safetensors", description)


def model_config(name: str):
    """The ModelConfig of bench_model(name) without making or writing anything."""
    from inference_node.model.config import ModelConfig

    if name in RANDOM_MODELS:
        return ModelConfig.from_dict(RANDOM_MODELS[name].config)
    return ModelConfig.from_checkpoint(embedded_checkpoint() if name == "embedded" else Path(name))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def copy_tokenizer(source: Path, dest: Path) -> None:
    for name in TOKENIZER_FILES:
        if (source / name).exists() and not (dest / name).exists():
            shutil.copy(source / name, dest / name)


def save_streamed(path: Path, shapes: Mapping[str, Sequence[int]], dtype: torch.dtype,
                  make: Callable[[str, Sequence[int]], torch.Tensor]) -> None:
    """A safetensors file of `shapes`' tensors, each as make(name, shape) gives it: one in memory at a time."""
    ends = [0, *itertools.accumulate(math.prod(shape) * dtype.itemsize for shape in shapes.values())]
    header = json.dumps({"__metadata__": {"format": "pt"}} | {name: {
        "dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": ends[k:k + 2]}
        for k, (name, shape) in enumerate(shapes.items())}).encode()
    header += b" " * (-len(header) % 8)  # the data 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        for name, shape in shapes.items():
            f.write(make(name, shape).to(dtype).cpu().contiguous().view(torch.uint8).numpy())


def write_random_adapter(folder: Path, model_cfg, rank: int, targets: Sequence[str], seed: int,
                         device: torch.device, dtype: torch.dtype = torch.bfloat16, std: float = 0.02,
                         experts: bool = False) -> Path:
    """A PEFT-format adapter folder (adapter_config.json + adapter_model.safetensors) of random, non-zero A
    and B, named as PEFT saves the family's LoRA: `targets` are the node's modules (q_proj, ...), a fused
    projection (Phi-3's qkv_proj) taken where any of its modules is; experts: every routed expert's too, as
    PEFT saves it over transformers 5's fused experts (target_parameters gate_up_proj at twice the rank and
    alpha, the inner wrapper "experts.base_layer"; down_proj, "experts"). Written a tensor at a time."""
    from adapter_store.samples import adapter_config
    from inference_node.model.families import FAMILIES
    from lora_common.validation import LAYER_PARENT

    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device=device).manual_seed(seed)
    shapes, (gate_up, down) = model_cfg.module_shapes(), model_cfg.expert_shapes().values()
    peft_modules = {peft: held for peft, held in FAMILIES[model_cfg.family].adapter_modules.items()
                    if set(held) & set(targets)}
    tensors: dict[str, tuple[int, int]] = {}
    for layer in range(model_cfg.num_layers):
        pairs = {f"{LAYER_PARENT[m]}.{m}": (rank, shapes[held[0]][0], sum(shapes[h][1] for h in held))
                 for m, held in peft_modules.items()}
        if experts and model_cfg.is_moe_layer(layer):
            pairs |= {"mlp.experts.base_layer": (2 * rank * model_cfg.num_experts, *gate_up),
                      "mlp.experts": (rank * model_cfg.num_experts, *down)}
        for module, (r, fan_in, fan_out) in pairs.items():
            base = f"base_model.model.model.layers.{layer}.{module}"
            tensors |= {f"{base}.lora_A.weight": (r, fan_in), f"{base}.lora_B.weight": (fan_out, r)}
    save_streamed(folder / "adapter_model.safetensors", tensors, dtype,
                  lambda _, shape: torch.randn(*shape, generator=gen, device=device) * std)
    alpha, pattern = 2 * rank, r".*\.gate_up_proj"
    config = adapter_config(rank, list(peft_modules), alpha, base_model="bench-random", **(dict(
        target_parameters=["down_proj", "gate_up_proj"], rank_pattern={pattern: 2 * rank},
        alpha_pattern={pattern: 2 * alpha}) if experts else {}))
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return folder


def write_adapters(root: Path, model_cfg, names: Sequence[str], ranks: Sequence[int], targets: Sequence[str],
                   device: torch.device, dtype: torch.dtype, seed: int = 1000, experts: bool = False) -> dict[str, int]:
    """Adapter k of `names` (rank ranks[k mod len]) into root/<name>, kept where it exists (a
    --workdir reuses them); each one's rank."""
    rank_of = {}
    for k, name in enumerate(names):
        rank_of[name] = ranks[k % len(ranks)]
        if not (root / name / "adapter_model.safetensors").exists():
            write_random_adapter(root / name, model_cfg, rank_of[name], targets, seed + k, device, dtype,
                                 experts=experts)
    return rank_of


# -- command lines and nodes -----------------------------------------------------------------------
def add_by_device(p: argparse.ArgumentParser, flag: str, on_cuda: Any, on_cpu: Any, help: str, **kw: Any) -> None:
    """An option whose default depends on the device, said once: in its help, and to runtime()
    that fills it in where left unset."""
    p.add_argument(flag, help=f"{help} (CUDA {on_cuda}, CPU {on_cpu})", **kw)
    p.set_defaults(by_device={**(p.get_default("by_device") or {}), flag[2:].replace("-", "_"): (on_cuda, on_cpu)})


def add_common_args(p: argparse.ArgumentParser, model: tuple[str, str]) -> None:
    """The flags every engine benchmark takes; `model`: the default on CUDA and on the CPU."""
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    add_by_device(p, "--model", *model, MODEL_HELP)
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"], default="auto",
                   help="bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: the node's choice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", type=Path, default=None, help="keep the checkpoint and adapters here")
    p.add_argument("--json", type=Path, default=None, help="also write the results as JSON")
    p.add_argument("-v", "--verbose", action="store_true")


def add_node_args(p: argparse.ArgumentParser) -> None:
    """The flags of the node a serving-style benchmark builds (engine_options reads them)."""
    add_by_device(p, "--max-batched-tokens", 2048, 256, "token budget per step", type=int)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--decode-graphs", choices=["auto", "on", "off"], default="auto")
    p.add_argument("--mixed-graphs", choices=["auto", "on", "off"], default="auto",
                   help="replay prompt and mixed steps piece by piece from CUDA graphs (auto: on CUDA)")


def runtime(args: argparse.Namespace) -> tuple[torch.device, torch.dtype]:
    """Logging, the device and dtype a run takes from --device and --dtype, and the device's
    defaults of the options left unset (add_by_device)."""
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    for name, (on_cuda, on_cpu) in getattr(args, "by_device", {}).items():
        if getattr(args, name) is None:
            setattr(args, name, on_cuda if cuda else on_cpu)
    dtype = {"auto": torch.bfloat16 if cuda else torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16, "float32": torch.float32}[args.dtype]
    return torch.device("cuda" if cuda else "cpu"), dtype


def device_line(device: torch.device, dtype: torch.dtype) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    return f"device: {name}  torch {torch.__version__}  dtype {dtype_name(dtype)}"


def engine_options(args: argparse.Namespace, max_model_len: int, seqs: int, requests: int, **options: Any) -> dict:
    """The node settings of add_node_args' flags for `seqs` sequences of up to max_model_len
    tokens (KV blocks for all of them) and a queue of `requests`; `options` add to them."""
    return dict(num_kv_blocks=seqs * -(-(max_model_len + 1) // args.block_size) + seqs + 8, block_size=args.block_size,
                max_num_seqs=seqs, max_num_batched_tokens=args.max_batched_tokens, max_queue=requests + seqs,
                max_model_len=max_model_len, decode_graphs=args.decode_graphs, mixed_graphs=args.mixed_graphs,
                max_graph_batch=seqs, cpu_threads=args.threads, **options)


def node_config(model: BenchModel, device: torch.device, dtype: torch.dtype, **options: Any):
    """The NodeConfig of a node serving `model`: each benchmark's nodes come from one, in
    process (`LLM`) or served (`NodeProcess`, its flags). Unless asked (tune_budget), a node
    does not tune its kernels at start: it takes the repository's or this host's table for its
    GPU and shape, else the defaults, so a run times serving and not a sweep."""
    from inference_node.config import NodeConfig

    return NodeConfig.of(checkpoint=str(model.checkpoint), load_format=model.load_format, device=device.type,
                         dtype=dtype_name(dtype), **{"tune_budget": 0.0, **options})


def build_llm(config, adapters: Sequence[str] = ()):
    """The node in this process, prepared (warm-up and graph captures as `serve` runs them),
    `adapters` pinned in GPU adapter memory."""
    from inference_node.llm import LLM

    llm = LLM(config)
    try:
        llm.prepare()
        if adapters:
            llm.pin_adapters(list(adapters))
            sync(llm.node.model.device)
    except BaseException:
        llm.close()
        raise
    return llm


def release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# The engine's step counters (EngineStats, the Stats RPC) by the kind of step.
STEP_KINDS = {"graph": "graph_steps", "piecewise": "piecewise_graph_steps", "eager_decode": "eager_decode_steps",
              "eager_prefill": "eager_prefill_steps"}


class NodeProcess:
    """`inference-node serve` of a NodeConfig as a subprocess, gRPC and HTTP on free ports."""

    def __init__(self, config, log_path: Path, timeout_s: float = 1800.0) -> None:
        from inference_node.config import to_flags
        from lora_client.processes import Child, free_port, wait_healthy

        self.port, self.http_port = free_port(), free_port()
        self.target = f"127.0.0.1:{self.port}"
        self.http_url = f"http://127.0.0.1:{self.http_port}/v1"
        flags = to_flags(config.replace(port=self.port, http_port=self.http_port))
        self.child = Child("inference-node", [sys.executable, "-m", "inference_node.cli", "serve", *flags], log_path)
        self.pid = self.child.proc.pid
        try:
            wait_healthy(self.target, timeout_s, self.child)
        except BaseException:
            self.stop()
            raise

    def client(self):
        from lora_client.node_client import NodeClient

        return NodeClient(self.target)

    def steps(self) -> dict[str, int]:
        """The engine's steps so far, by kind."""
        with self.client() as client:
            stats = client.stats()
        return {kind: getattr(stats, name) for kind, name in STEP_KINDS.items()}

    def pin(self, names: Sequence[str]) -> None:
        from lora.v1 import inference_pb2 as pb

        with self.client() as client:
            for name in names:
                client.stub.LoadAdapter(pb.LoadAdapterRequest(name=name, pin=True), timeout=600)

    def stop(self) -> None:
        self.child.stop(120)


# -- workload ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Spec:
    """One request of a synthetic workload."""

    index: int
    prompt: list[int]
    max_tokens: int
    arrival: float      # seconds after the start (Poisson); 0 in closed loop
    pick: float         # uniform [0, 1): the adapter drawn under Zipf popularity
    adapter: str = ""   # "": the base model (assign_adapters)


def parse_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def make_specs(n: int, prompt_len: tuple[int, int], output_len: tuple[int, int], vocab: int,
               poisson_rate: float | None, seed: int) -> list[Spec]:
    """Random prompt tokens clear of the special ones at the vocabulary's start, uniform
    lengths, Poisson arrival times when a rate is given."""
    rng, low = random.Random(seed), min(1000, vocab // 2)
    specs, t = [], 0.0
    for i in range(n):
        if poisson_rate:
            t += rng.expovariate(poisson_rate)
        length = rng.randint(*prompt_len)
        specs.append(Spec(i, [rng.randrange(low, vocab) for _ in range(length)], rng.randint(*output_len),
                          t if poisson_rate else 0.0, rng.random()))
    return specs


def assign_adapters(specs: list[Spec], pool: Sequence[str], zipf_alpha: float | None = None) -> list[Spec]:
    """The specs, each on an adapter of `pool`: request i on adapter i mod N, or by Zipf(alpha)
    popularity of its `pick`; on the base model where the pool is empty."""
    if not pool:
        return specs
    return [dataclasses.replace(s, adapter=pool[s.index % len(pool) if zipf_alpha is None else
                                                zipf_index(s.pick, len(pool), zipf_alpha)]) for s in specs]


def zipf_index(u: float, n: int, alpha: float) -> int:
    """Inverse CDF of P(k) ~ 1/(k+1)^alpha over k < n."""
    cdf = list(itertools.accumulate(1.0 / (k + 1) ** alpha for k in range(n)))
    return min(bisect.bisect_right(cdf, u * cdf[-1]), n - 1)


# -- measurement ---------------------------------------------------------------------------------------
def pct(values: Sequence[float], q: float) -> float:
    """The q-th percentile, linearly interpolated (NaN of nothing)."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_runs(run: Callable[[], object], runs: int, before: Callable[[], object] | None = None) -> list[float]:
    """Wall seconds of each of `runs` calls of `run`; `before` runs untimed ahead of each."""
    times = []
    for _ in range(runs):
        if before is not None:
            before()
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return times


def copy_bandwidth(device: torch.device, nbytes: int | None = None) -> float:
    """Bytes/s of a device-to-device copy (read + write counted): the practical ceiling of the
    memory-bound decode step, against which every floor is computed."""
    if device.type == "cuda":
        from inference_node.tuner.trial import copy_bandwidth as device_copy_bandwidth

        return device_copy_bandwidth(device, nbytes or (1 << 30))
    nbytes = nbytes or (64 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / statistics.median(timed_runs(lambda: dst.copy_(src), 5, None))


@contextlib.contextmanager
def timed_region(what: str, log: logging.Logger) -> Iterator[list[str]]:
    """A timed run: set-up objects frozen out of the garbage collector, as Engine.prepare
    freezes the node's start-up objects (a full collection of them stalls steps); the list it
    gives fills with the JIT compiles that landed in the run (CompileWatch), each logged."""
    compiles, mark = [], COMPILES.install().mark()
    gc.collect()
    gc.freeze()
    try:
        yield compiles
    finally:
        gc.unfreeze()
    compiles += COMPILES.since(mark)
    for name in compiles:
        log.warning("%s: compiled during the timed run: %s", what, name[:300])


def error_text(exc: BaseException) -> str:
    """A failed row's error, as its table line shows it."""
    return f"{type(exc).__name__}: {exc}"[:200]


def verdict(value: float, good: bool) -> str:
    """A target's line: met, NOT met, or n/a where nothing was measured."""
    return "n/a" if math.isnan(value) else ("met" if good else "NOT met")


# -- tables ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Col:
    """A table column: its title, unit line, width and how a value prints (text left-aligned;
    a number by `fmt` after `scale`, e.g. seconds as ms; None or NaN as '-')."""

    title: str
    width: int
    fmt: str = ""
    unit: str = ""
    scale: float = 1.0
    suffix: str = ""

    def cell(self, value: Any) -> str:
        if not self.fmt:
            return f"{'' if value is None else value!s:<{self.width}}"
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return f"{'-':>{self.width}}"
        text = f"{value if self.scale == 1 else value * self.scale:{self.fmt}}{self.suffix}"
        return f"{text:>{self.width}}"


class Table:
    def __init__(self, *columns: Col) -> None:
        self.columns = columns

    def head(self) -> list[str]:
        align = lambda c, text: f"{text:<{c.width}}" if not c.fmt else f"{text:>{c.width}}"  # noqa: E731
        titles = " ".join(align(c, c.title) for c in self.columns)
        units = " ".join(align(c, c.unit) for c in self.columns).rstrip()
        return [titles, units, "-" * len(titles)] if units.strip() else [titles, "-" * len(titles)]

    def row(self, *values: Any) -> str:
        return " ".join(c.cell(v) for c, v in zip(self.columns, values)).rstrip()

    def print(self, rows: Sequence[Sequence[Any] | str], out=None) -> None:
        """The head, then each row (a string: a line as it is)."""
        for line in self.head():
            print(line, file=out)
        for r in rows:
            print(r if isinstance(r, str) else self.row(*r), file=out)


def medians(rounds: Sequence[Mapping[str, Any]]) -> dict:
    """Each number's median over the rounds (an int stays an int); anything else as in the first."""
    def median(values: list) -> Any:
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            return values[0]
        return type(values[0])(statistics.median(values)) if isinstance(values[0], int) else statistics.median(values)

    return {key: median([r[key] for r in rounds]) for key in rounds[0]}


def json_safe(value: Any) -> Any:
    """JSON has no NaN: a value not measured is null."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def write_json(path: Path | None, data: Any) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(json_safe(data), indent=2, default=str))


# -- floors: the bytes a decode step must read ---------------------------------------------------
# A decode step is memory-bound: each rank reads its shard of the weights (the embedding only
# at the batch's rows unless tied to the LM head), the KV its heads attend over and A and B of
# every distinct adapter in the batch. Layout as the node's (parallel/shard.py, Megatron's):
# q/k/v and gate/up keep a block of output columns, o and down of input rows, the LM head a
# block of ceil(vocab / TP) rows; norms are whole. LoRA follows: B split on column-parallel
# projections, A on row-parallel ones. Bytes over `copy_bandwidth` (read + write counted: DRAM
# serves both from one budget and a decode step writes next to nothing) give the floor.
def _check_tp(cfg, tp: int) -> None:
    from inference_node.parallel.shard import check_divisible

    if tp < 1:
        raise ValueError(f"tensor-parallel size must be at least 1, not {tp}")
    if tp > 1:
        check_divisible(cfg, tp)


def norm_bytes(cfg, itemsize: int) -> int:
    return (2 * cfg.num_layers + 1) * cfg.hidden_size * itemsize


def projection_shapes_per_rank(cfg, tp: int = 1, mlp: bool = True) -> list[tuple[int, int]]:
    """(out, in) of one layer's fused projections (q/k/v, o, and gate/up, down where `mlp`: a
    routed layer's MLP is its experts) on one rank."""
    h, inter = cfg.hidden_size, cfg.intermediate_size // tp
    shapes = [((cfg.q_size + 2 * cfg.kv_size) // tp, h), (h, cfg.q_size // tp)]
    return shapes + [(2 * inter, h), (h, inter)] if mlp else shapes


def fp8_block(cfg, fp8: bool) -> tuple[int, int] | None | bool:
    """The projections' FP8 scale tiles: the checkpoint's (quantization_config), per channel
    (None) where `fp8` quantizes a plain checkpoint at load, False where they stay plain."""
    if cfg.weight_quant is not None:
        return cfg.weight_quant.block
    return None if fp8 else False


def weight_bytes_per_rank(cfg, itemsize: int, tp: int = 1, fp8: bool = False) -> int:
    """The weights one rank reads every decode step: all of them but a mixture-of-experts
    model's experts (expert_bytes_per_rank: a step reads those its tokens are routed to); FP8
    projections (an FP8 checkpoint, or `fp8`: --quantization fp8) at one byte a weight plus
    their float32 scales (one per output channel, or per block of the checkpoint's tiles)."""
    _check_tp(cfg, tp)
    h, block = cfg.hidden_size, fp8_block(cfg, fp8)

    def projection(out: int, fan_in: int) -> int:
        if block is False:
            return out * fan_in * itemsize
        scales = out if block is None else -(-out // block[0]) * -(-fan_in // block[1])
        return out * fan_in + 4 * scales

    total = 0
    for i in range(cfg.num_layers):
        routed = cfg.is_moe_layer(i)
        total += sum(projection(out, fan_in) for out, fan_in in projection_shapes_per_rank(cfg, tp, not routed))
        total += cfg.num_experts * h * itemsize if routed else 0   # the router
    if cfg.attention_bias:
        total += cfg.num_layers * (cfg.q_size + 2 * cfg.kv_size) // tp * itemsize
    return total + -(-cfg.vocab_size // tp) * h * itemsize + norm_bytes(cfg, itemsize)


def expert_bytes_per_rank(cfg, itemsize: int, tp: int = 1) -> int:
    """One expert's gate, up and down in every routed layer, as one rank holds them."""
    routed = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    return routed * 3 * cfg.hidden_size * (cfg.moe_intermediate_size // tp) * itemsize


def expert_lora_bytes_per_rank(cfg, rank: int, itemsize: int, tp: int = 1) -> int:
    """One expert's LoRA in every routed layer as one rank holds it (its block of intermediate
    columns: gate/up's B, down's A), gate_up at twice the rank as PEFT saves it; an adapter has E."""
    routed = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    h, inter = cfg.hidden_size, cfg.moe_intermediate_size // tp
    return routed * rank * (2 * (h + 2 * inter) + inter + h) * itemsize


def expected_experts(num_experts: int, top_k: int, batch: int) -> float:
    """Distinct experts a layer's step reads for `batch` tokens each routed to top_k distinct
    experts, routing assumed uniform and independent across tokens: an expert is missed by
    a token with probability 1 - k / E, so E (1 - (1 - k / E)^batch) are hit (Qwen3-30B-A3B:
    8 of 128 a token, 125.9 of 128 at batch 64; trained routers are skewed, touching fewer)."""
    if num_experts == 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


def kv_bytes_per_token(cfg, itemsize: int, tp: int = 1) -> int:
    _check_tp(cfg, tp)
    return cfg.num_layers * 2 * (cfg.kv_size // tp) * itemsize


def adapter_bytes_per_rank(cfg, rank: int, targets: Sequence[str], itemsize: int, tp: int = 1) -> int:
    """One adapter's A [r, in] and B [out, r] over all layers, as one rank holds them."""
    from inference_node.parallel.shard import COLUMN_PARALLEL

    _check_tp(cfg, tp)
    shapes = cfg.module_shapes()
    per_layer = 0
    for module in targets:
        fan_in, fan_out = shapes[module]
        split_b = module in COLUMN_PARALLEL
        per_layer += rank * (fan_in if split_b else fan_in // tp) + (fan_out // tp if split_b else fan_out) * rank
    return cfg.num_layers * per_layer * itemsize


@dataclass(frozen=True)
class StepBytes:
    """What one rank's decode step reads at least, for steps of varying batch, adapters and
    attended KV (the serving benchmark's per-step floor)."""

    weights: int
    embed_row: int
    kv_token: int
    adapter: Mapping[str, int] = field(default_factory=dict)  # adapter name -> its bytes per rank
    # A mixture of experts: one expert's bytes over the routed layers, experts, picks a token
    expert: int = 0
    num_experts: int = 0
    top_k: int = 0
    expert_lora: Mapping[str, int] = field(default_factory=dict)  # adapter name -> one expert's LoRA bytes

    @classmethod
    def of(cls, cfg, itemsize: int, adapter_bytes: Mapping[str, int], tp: int = 1, fp8: bool = False,
           expert_lora: Mapping[str, int] = {}) -> "StepBytes":
        return cls(weight_bytes_per_rank(cfg, itemsize, tp, fp8), cfg.hidden_size * itemsize,
                   kv_bytes_per_token(cfg, itemsize, tp), dict(adapter_bytes), expert_bytes_per_rank(cfg, itemsize, tp),
                   cfg.num_experts, cfg.num_experts_per_tok, dict(expert_lora))

    def step(self, batch: int, adapters: frozenset[str], kv_tokens: int) -> int:
        experts = expected_experts(self.num_experts, self.top_k, batch) * self.expert
        return (self.weights + round(experts) + batch * self.embed_row + kv_tokens * self.kv_token
                + self.adapter_read(batch, adapters))

    def adapter_read(self, batch: int, adapters: frozenset[str]) -> int:
        """A and B of the step's adapters; of one with expert LoRA, the experts its even share of the batch hits."""
        hit = expected_experts(self.num_experts, self.top_k, batch / max(len(adapters), 1))
        return sum(self.adapter[a] + round(hit * self.expert_lora.get(a, 0)) for a in adapters)


# -- JIT compiles ------------------------------------------------------------------------------------
class CompileWatch:
    """Counts JIT compiles while a region runs: Triton kernels (a new specialisation compiles on
    its first launch, 0.3-2 s) and torch.compile graphs. A step that compiles stalls every
    request in flight, so the benchmarks report the compiles in their timed runs (none, if the
    warm-up did its job)."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self._installed = False

    def install(self) -> "CompileWatch":
        """Hooks Triton's post-compile callback (triton >= 3.3's knobs); idempotent."""
        if self._installed:
            return self
        try:
            from triton import knobs
        except ImportError:
            return self
        previous = knobs.runtime.jit_post_compile_hook

        def hook(*args, **kwargs):
            self.events.append(str(kwargs.get("repr", "triton kernel")))
            return previous(*args, **kwargs) if previous else None

        knobs.runtime.jit_post_compile_hook = hook
        self._installed = True
        return self

    def mark(self) -> tuple[int, int]:
        return len(self.events), _dynamo_graphs()

    def since(self, mark: tuple[int, int]) -> list[str]:
        """What compiled after `mark`: Triton kernels by name, one entry per torch.compile graph."""
        return self.events[mark[0]:] + ["torch.compile graph"] * max(0, _dynamo_graphs() - mark[1])


def _dynamo_graphs() -> int:
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return int(counters["stats"].get("unique_graphs", 0))


COMPILES = CompileWatch()
