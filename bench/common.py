"""Helpers the benchmarks share: random checkpoints and adapters (nothing is downloaded),
timing and the device's copy bandwidth (every floor is bytes over it), JIT-compile counting."""
from __future__ import annotations

import json
import logging
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from bench.shapes import LLAMA_3_1_70B, LLAMA_3_1_8B, LLAMA_3_2_1B, TINY_LLAMA  # noqa: F401 (re-exported)

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
QV = ("q_proj", "v_proj")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")


# -- synthetic weights ---------------------------------------------------------------------------
def write_random_checkpoint(out: Path, config: dict, dtype: torch.dtype, device: torch.device,
                            seed: int = 0, std: float = 0.02) -> Path:
    """An HF-format safetensors checkpoint (config.json + model.safetensors) of random weights."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device=device).manual_seed(seed)
    h, inter = config["hidden_size"], config["intermediate_size"]
    hd = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) * std).to(dtype).cpu()

    tensors = {"model.embed_tokens.weight": rnd(config["vocab_size"], h),
               "model.norm.weight": torch.ones(h, dtype=dtype)}
    if not config.get("tie_word_embeddings", False):
        tensors["lm_head.weight"] = rnd(config["vocab_size"], h)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {p + "input_layernorm.weight": torch.ones(h, dtype=dtype),
                    p + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype),
                    p + "self_attn.q_proj.weight": rnd(q, h), p + "self_attn.k_proj.weight": rnd(kv, h),
                    p + "self_attn.v_proj.weight": rnd(kv, h), p + "self_attn.o_proj.weight": rnd(h, q),
                    p + "mlp.gate_proj.weight": rnd(inter, h), p + "mlp.up_proj.weight": rnd(inter, h),
                    p + "mlp.down_proj.weight": rnd(h, inter)}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


@dataclass(frozen=True)
class BenchModel:
    """A benchmark's model: its checkpoint folder, how the node loads it, what to print."""

    checkpoint: Path
    load_format: str   # "dummy": random weights of config.json's shapes, made on the device
    description: str


# The named random-weight models: (config, whether its weights are made at load rather than
# written as a checkpoint once, what to print).
RANDOM_MODELS = {
    "llama-1b-random": (LLAMA_3_2_1B, False, "Llama-3.2-1B-shaped, random weights"),
    "llama-8b-random": (LLAMA_3_1_8B, True, "Llama-3.1-8B-shaped (vocab 49,152), random weights"),
    "llama-70b-random": (LLAMA_3_1_70B, True, "Llama-3.1-70B-shaped (vocab 49,152), random weights"),
    "tiny": (TINY_LLAMA, False, "tiny Llama-shaped, random weights"),
}


def bench_model(name: str, work: Path, dtype: torch.dtype, device: torch.device, seed: int) -> BenchModel:
    """The named shapes with random weights (RANDOM_MODELS: 'llama-8b-random' and
    'llama-70b-random' config only, weights made at load; 'llama-1b-random', 'tiny': a
    checkpoint written once into `work`), the embedded SmolLM2 ('embedded'), or a checkpoint
    folder."""
    if name in RANDOM_MODELS:
        config, made_at_load, description = RANDOM_MODELS[name]
        if made_at_load:
            checkpoint = work / name.replace("-random", "-dummy")
            checkpoint.mkdir(parents=True, exist_ok=True)
            (checkpoint / "config.json").write_text(json.dumps(config, indent=2))
            return BenchModel(checkpoint, "dummy", description)
        checkpoint = work / f"{name}-{str(dtype).removeprefix('torch.')}"
        if not (checkpoint / "model.safetensors").exists():
            write_random_checkpoint(checkpoint, config, dtype, device, seed=seed)
        return BenchModel(checkpoint, "safetensors", description)
    return BenchModel(_checkpoint_of(name), "safetensors",
                      "embedded SmolLM2-135M" if name == "embedded" else Path(name).name)


def _checkpoint_of(name: str) -> Path:
    """The checkpoint folder of 'embedded' or a folder's path."""
    if name == "embedded":
        from inference_node.model.embedded import default_checkpoint

        return default_checkpoint()
    return Path(name)


def bench_runtime(args, log: logging.Logger, log_level: int = logging.INFO) -> tuple[torch.device, torch.dtype]:
    """What every engine benchmark sets up from its common flags (--verbose, --threads,
    --device, --dtype): logging, torch's CPU threads, and the device and dtype it runs in
    (bfloat16 on CUDA, float32 on CPU, unless --dtype names one)."""
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    log.setLevel(log_level)
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    dtype = {"auto": torch.bfloat16 if cuda else torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16, "float32": torch.float32}[args.dtype]
    return torch.device("cuda" if cuda else "cpu"), dtype


def copy_tokenizer(source: Path, dest: Path) -> None:
    """The tokenizer files of checkpoint `source` into `dest` (a random checkpoint that a node
    serves by text)."""
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, dest / name)


def write_random_adapter(folder: Path, model_cfg, rank: int, targets: Sequence[str], seed: int,
                         device: torch.device, dtype: torch.dtype = torch.bfloat16,
                         std: float = 0.02) -> Path:
    """A PEFT-format adapter folder (adapter_config.json + adapter_model.safetensors) with
    random, non-zero A and B, named as PEFT saves a Llama-family model's LoRA."""
    from safetensors.torch import save_file

    from adapter_store.samples import adapter_config
    from lora_common.validation import MODULE_PARENT

    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device=device).manual_seed(seed)
    shapes = model_cfg.module_shapes()
    tensors = {}
    for layer in range(model_cfg.num_layers):
        for module in targets:
            fan_in, fan_out = shapes[module]
            base = f"base_model.model.model.layers.{layer}.{MODULE_PARENT[module]}.{module}"
            for kind, shape in (("A", (rank, fan_in)), ("B", (fan_out, rank))):
                t = torch.randn(*shape, generator=gen, device=device) * std
                tensors[f"{base}.lora_{kind}.weight"] = t.to(dtype).cpu()
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = adapter_config(rank, list(targets), base_model="serving-bench-random")
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return folder


# -- timing --------------------------------------------------------------------------------------
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


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes/s of a device-to-device copy (read + write counted): the practical ceiling of the
    memory-bound kernels, against which every floor is computed."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = time_call(lambda: dst.copy_(src), device)
    return 2 * nbytes / t


# -- JIT compiles --------------------------------------------------------------------------------
# Counts the JIT compiles that happen while a region runs: Triton kernels (a new specialisation
# of a kernel compiles on its first launch, 0.3-2 s each) and torch.compile graphs. A serving
# step that compiles stalls every request in flight, so the serving benchmark reports the
# compiles that land in its timed runs (there should be none).
@dataclass
class CompileEvent:
    at: float          # time.perf_counter() when the compile finished
    what: str          # kernel name and specialisation (Triton), or "torch.compile graph"


@dataclass
class CompileWatch:
    events: list[CompileEvent] = field(default_factory=list)
    _installed: bool = False

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
            self.events.append(CompileEvent(time.perf_counter(), str(kwargs.get("repr", "triton kernel"))))
            return previous(*args, **kwargs) if previous else None

        knobs.runtime.jit_post_compile_hook = hook
        self._installed = True
        return self

    def mark(self) -> tuple[int, int]:
        """A position to count from: (Triton compiles so far, torch.compile graphs so far)."""
        return len(self.events), _dynamo_graphs()

    def since(self, mark: tuple[int, int]) -> list[str]:
        """What compiled after `mark`: each Triton kernel's name and specialisation, then one
        entry per new torch.compile graph."""
        triton_events = [e.what for e in self.events[mark[0]:]]
        return triton_events + ["torch.compile graph"] * max(0, _dynamo_graphs() - mark[1])


def _dynamo_graphs() -> int:
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return int(counters["stats"].get("unique_graphs", 0))


RANDOM_MODELS_HELP = ("'llama-1b-random' (CUDA default), 'llama-8b-random', 'tiny' (CPU default) or "
                      "an HF safetensors checkpoint dir")


def add_model_args(parser, model_help: str = RANDOM_MODELS_HELP) -> None:
    """--device, --model and --dtype, as every in-process engine benchmark takes them."""
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--model", default=None, help=model_help)
    parser.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"], default="auto")
