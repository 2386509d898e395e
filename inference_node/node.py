"""Assembles a node from its settings: checkpoint, device, KV cache size, engine."""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kernels.tuning import Tuning
from lora_common.tls import ClientTLS, ServerTLS
from lora_common.validation import DEFAULT_MAX_WEIGHT_ABS

from .adapters.disk_tier import DiskTier
from .adapters.manager import AdapterManager
from .adapters.slots import SlotBuffers, rows_for_budget
from .adapters.sources import LocalDirSource
from .adapters.store_source import CatalogWatcher, StoreSource
from .engine.engine import Engine, EngineConfig
from .engine.kv_budget import kv_blocks_for_memory
from .engine.kv_cache import KVCache
from .limits import RequestLimits
from .lora_step.plan import LoraStepPlan
from .model.checkpoint import validate_checkpoint_dir
from .model.embedded import default_checkpoint
from .model.llama import LORA_MODULES, LlamaModel
from .tokenizer import TextCodec

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class NodeSettings:
    model: str | None = None           # checkpoint directory; None = the embedded SmolLM2
    device: str | None = None          # None = cuda when available
    dtype: str = "auto"                # auto = bfloat16 on cuda, float32 on cpu
    load_format: str = "safetensors"   # dummy: random weights of config.json's shapes (benchmarks)
    kv_cache_gb: float = 0.0           # 0: CUDA sizes it by gpu_memory_utilization, CPU takes 0.5 GB
    gpu_memory_utilization: float = 0.9  # CUDA: the share of the device's memory the node may use
    num_kv_blocks: int = 0             # overrides kv_cache_gb when > 0
    block_size: int = 16
    max_num_seqs: int = 0              # 0: 256 on CUDA, 64 on CPU
    max_num_batched_tokens: int = 512
    max_queue: int = 1024
    max_model_len: int = 4096
    default_max_tokens: int = 256
    prefix_caching: bool = True        # reuse KV of cached prefixes, per adapter namespace
    decode_graphs: str = "auto"        # auto: CUDA graphs for decode on CUDA; on: also on CPU (tests)
    mixed_graphs: str = "auto"         # auto: piecewise CUDA graphs for other steps on CUDA; on: also on CPU
    max_graph_batch: int = 0           # largest decode batch replayed from a graph; 0: max_num_seqs
    prefill_delay_factor: float = 0.0  # hold new prompts while others decode (engine/scheduler.py)
    warmup: str = "auto"  # compile eager steps' kernels before serving (engine/warmup.py); auto: on CUDA
    debug_checks: bool = False
    max_loras: int = 8                 # the most distinct adapters in one step; 0 disables LoRA
    max_lora_rank: int = 16
    lora_memory_bytes: int = 0         # GPU adapter memory (0: max_loras adapters of max_lora_rank)
    lora_modules: tuple[str, ...] = LORA_MODULES  # what adapters may target: the memory's arenas
    adapter_eviction: str = "lru"      # GPU eviction policy (adapters/eviction.py)
    max_cpu_loras: int = 32
    adapter_dir: str | None = None     # local adapters: <dir>/<name>/adapter_config.json ...
    adapter_store: str | None = None   # HOST:PORT of the adapter store
    adapter_disk_dir: str | None = None  # the node's disk tier of store adapters (off when unset)
    adapter_disk_bytes: int = 20 << 30   # its bound (least recently used evicted first)
    admin_token: str | None = field(default=None, repr=False)     # secrets: never in logs
    generate_token: str | None = field(default=None, repr=False)
    metrics_port: int = 0
    metrics_max_adapters: int = 32     # adapters with their own metric labels; the rest share "_other"
    tls: ServerTLS = field(default_factory=ServerTLS)                # the gRPC server's TLS / mTLS
    store_tls: ClientTLS = field(default_factory=lambda: ClientTLS(flag="--store-tls"))  # to the store
    store_token: str | None = field(default=None, repr=False)       # bearer token sent to the store
    adapter_fetch_timeout_s: float = 60.0  # a load retries the store this long, then UNAVAILABLE
    limits: RequestLimits = field(default_factory=RequestLimits)
    max_adapter_bytes: int = 1 << 30   # adapters fetched from the store or read from --adapter-dir
    cpu_threads: int = 0               # torch threads of a CPU engine; 0: the cores less one for the front end
    max_weight_abs: float = DEFAULT_MAX_WEIGHT_ABS  # larger LoRA weights are refused (0: no bound)
    tuning: Tuning = field(default_factory=Tuning)  # the decode step's launch choices (kernels/tuning.py)


@dataclass
class Node:
    settings: NodeSettings
    checkpoint: Path
    model: LlamaModel
    codec: TextCodec
    engine: Engine
    adapters: AdapterManager | None = None
    catalog: CatalogWatcher | None = None   # follows the adapter store's catalog events

    @property
    def model_name(self) -> str:
        return self.checkpoint.name

    def snapshot(self) -> dict[str, object]:
        """Engine, adapter and prefix-cache counters; runs on the engine thread (Engine.call)."""
        snap: dict = self.engine.snapshot()
        per_adapter: dict[str, dict[str, int]] = {}
        for (adapter, _), stats in self.engine.prefix_cache_rows():
            row = per_adapter.setdefault(adapter, {"hit_tokens": 0, "hits": 0, "lookups": 0, "blocks": 0})
            for key in row:
                row[key] += getattr(stats, key)
        snap["prefix_cache"] = per_adapter
        if self.adapters is not None:
            entries = self.adapters.entries()
            snap["adapters_gpu"] = sum(1 for e in entries if e.resident)
            snap["adapters_host"] = sum(1 for e in entries if e.weights is not None)
            snap["adapter_loads"] = self.adapters.stats["loads"]
            snap["adapter_evictions"] = self.adapters.stats["evictions"]
            snap["adapter_fetch_errors"] = self.adapters.stats["fetch_errors"]
            snap["adapter_counters"] = {name: c.as_dict() for name, c in self.adapters.per_adapter.items()}
        return snap


def resolve_device(name: str | None) -> torch.device:
    if name is None or name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for but no CUDA device is available")
    return torch.device(name)


def cpu_threads(settings: NodeSettings) -> int:
    """A CPU engine's torch threads. The front end needs a core of its own: an engine whose
    threads spin on every core stalls each op while the front end runs (OpenMP waits for
    its slowest thread), several times slower on a loaded machine."""
    if settings.cpu_threads > 0:
        return settings.cpu_threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(cores - 1, 1)


def build_node(settings: NodeSettings) -> Node:
    device = resolve_device(settings.device)
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads(settings))
    dtype_name = settings.dtype if settings.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    dtype = DTYPES[dtype_name]
    checkpoint = Path(settings.model) if settings.model else default_checkpoint()
    validate_checkpoint_dir(checkpoint, settings.load_format)
    started = time.monotonic()
    model_len = settings.max_model_len
    model = LlamaModel.load(checkpoint, device, dtype, max_positions=None, tuning=settings.tuning,
                            load_format=settings.load_format)
    model_len = min(model_len, model.config.max_position_embeddings)
    codec = TextCodec(checkpoint)
    max_num_seqs = settings.max_num_seqs or (256 if device.type == "cuda" else 64)
    per_block = KVCache.bytes_per_block(model.config, settings.block_size, dtype)
    mixed_graphs = settings.mixed_graphs == "on" or (settings.mixed_graphs == "auto" and device.type == "cuda")
    adapters = build_adapter_manager(settings, model, device, dtype)
    if settings.num_kv_blocks:
        blocks = settings.num_kv_blocks
    elif settings.kv_cache_gb or device.type != "cuda":
        blocks = max(int((settings.kv_cache_gb or 0.5) * (1 << 30)) // per_block, 1)
    else:
        blocks = kv_blocks_for_memory(model, settings.gpu_memory_utilization, settings.block_size,
                                      settings.max_num_batched_tokens, max_num_seqs, mixed_graphs)
    lora_plan = LoraStepPlan(adapters.buffers, settings.tuning) if adapters is not None else None
    engine = Engine(model, lora=adapters, lora_plan=lora_plan, config=EngineConfig(
        num_kv_blocks=blocks, block_size=settings.block_size, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens, max_queue=settings.max_queue,
        max_model_len=model_len, prefix_caching=settings.prefix_caching,
        decode_graphs=settings.decode_graphs == "on" or (settings.decode_graphs == "auto" and device.type == "cuda"),
        mixed_graphs=mixed_graphs,
        max_graph_batch=settings.max_graph_batch or max_num_seqs, prefill_delay_factor=settings.prefill_delay_factor,
        warmup=settings.warmup,
        debug_checks=settings.debug_checks))
    cfg = model.config
    log.info("loaded %s (%s, %d layers, hidden %d, %d/%d heads, vocab %d, %.1fM parameters) on %s as %s "
             "in %.1fs; KV cache: %d blocks x %d tokens (%.2f GiB), max model length %d",
             checkpoint, cfg.model_type, cfg.num_layers, cfg.hidden_size, cfg.num_heads,
             cfg.num_kv_heads, cfg.vocab_size, model.num_parameters() / 1e6, device, dtype_name,
             time.monotonic() - started, blocks, settings.block_size, blocks * per_block / (1 << 30),
             model_len)
    if adapters is not None:
        buffers = adapters.buffers
        log.info("LoRA: %.1f MB of GPU adapter memory (%d rank rows per module of %s: e.g. %d "
                 "adapters of rank %d on them), up to %d distinct adapters in a step, ranks up to %d, "
                 "%s eviction, %d in host memory, source: %s",
                 buffers.nbytes() / 1e6, buffers.rows, ",".join(settings.lora_modules),
                 buffers.rows // settings.max_lora_rank,
                 settings.max_lora_rank, settings.max_loras, settings.max_lora_rank,
                 settings.adapter_eviction, settings.max_cpu_loras,
                 settings.adapter_store or settings.adapter_dir or "none")
    catalog = None
    if adapters is not None and isinstance(adapters.source, StoreSource):
        catalog = CatalogWatcher(adapters.source.client, engine.call, adapters.on_catalog_update,
                                 adapters.on_catalog_delete, disk=adapters.source.disk)
    return Node(settings, checkpoint, model, codec, engine, adapters, catalog)


def build_adapter_manager(settings: NodeSettings, model: LlamaModel, device: torch.device,
                          dtype: torch.dtype) -> AdapterManager | None:
    if settings.max_loras <= 0:
        return None
    source: StoreSource | LocalDirSource | None = None
    pin = device.type == "cuda"  # adapters land in page-locked memory: slot copies run asynchronously
    if settings.adapter_store:
        disk = (DiskTier(settings.adapter_disk_dir, settings.adapter_disk_bytes)
                if settings.adapter_disk_dir else None)
        source = StoreSource(settings.adapter_store, model.config, settings.max_lora_rank, tls=settings.store_tls,
                             token=settings.store_token, max_adapter_bytes=settings.max_adapter_bytes,
                             fetch_deadline_s=settings.adapter_fetch_timeout_s, pin_memory=pin, disk=disk,
                             max_weight_abs=settings.max_weight_abs, dtype=dtype)
    elif settings.adapter_dir:
        source = LocalDirSource(Path(settings.adapter_dir), model.config, settings.max_lora_rank,
                                max_bytes=settings.max_adapter_bytes, pin_memory=pin,
                                max_weight_abs=settings.max_weight_abs, dtype=dtype)
    if settings.adapter_disk_dir and not settings.adapter_store:
        log.warning("--adapter-disk-dir keeps adapters from --adapter-store; without a store it is unused")
    rows = (rows_for_budget(model.config, dtype, settings.lora_memory_bytes, settings.lora_modules)
            if settings.lora_memory_bytes > 0 else None)
    buffers = SlotBuffers(model.config, settings.max_loras, settings.max_lora_rank, dtype, device,
                          rows=rows, modules=settings.lora_modules)
    return AdapterManager(buffers, source, settings.max_cpu_loras, pin_host_memory=pin,
                          disk_copies=source.disk_copies if source is not None else None,
                          eviction=settings.adapter_eviction)
