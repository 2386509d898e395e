"""Assembles a node from its settings: checkpoint, device, KV cache size, engine."""
from __future__ import annotations

import gc
import logging
import os
import time
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kernels.tuning import Tuning
from kernels.tuning_table import ModelShape, StepTunings, TuningTableError, device_name, find_table, load_table
from lora_common.tls import ClientTLS, ServerTLS
from lora_common.validation import DEFAULT_MAX_WEIGHT_ABS

from .adapters.direct_reads import DirectReadSettings
from .adapters.disk_tier import DiskTier
from .adapters.manager import AdapterManager
from .adapters.slots import SlotBuffers, rows_for_budget
from .adapters.sources import LocalDirSource
from .adapters.store_source import CatalogWatcher, StoreSource
from .engine.build import build_engine
from .engine.config import EngineConfig
from .engine.engine import Engine
from .engine.kv_cache import KVCache
from .limits import RequestLimits
from .model.checkpoint import validate_checkpoint_dir
from .model.embedded import default_checkpoint
from .model.config import ModelConfig
from .model.llama import LORA_MODULES, LlamaModel
from .parallel.group import TensorParallel, init_tensor_parallel, leave_tensor_parallel
from .parallel.shard import Shard, ShardingError, check_divisible, tensor_parallel_tuning
from .parallel.workers import Workers
from .runner.kv_budget import kv_blocks_for_memory
from .runner.launches import StepLaunches
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
    refill_wait_factor: float = 1.0    # after a burst of finishes, wait for its replacements (engine/scheduler.py)
    warmup: str = "auto"  # compile eager steps' kernels before serving (runner/warmup.py); auto: on CUDA
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
    adapter_direct_reads: bool = False   # read store adapters straight from S3 by the store's read plans
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
    # Per-step launch choices from a table kept as data (kernels/tuning_table.py): "auto" the
    # one filed for this GPU and shape, "off", or a file's path. The choices named in
    # tuning_fixed (the flags given) keep `tuning`'s values whatever the table says.
    tuning_table: str = "off"
    tuning_fixed: frozenset[str] = frozenset()
    tensor_parallel_size: int = 1      # ranks (one GPU each) the model is split over (inference_node/parallel)
    all_reduce: str = "nccl"           # decode-sized sums under TP: nccl or symm (parallel/symmetric.py)


@dataclass
class Node:
    settings: NodeSettings
    checkpoint: Path
    model: LlamaModel
    codec: TextCodec
    engine: Engine
    adapters: AdapterManager | None = None
    catalog: CatalogWatcher | None = None   # follows the adapter store's catalog events
    ranks: Workers | None = None            # a tensor-parallel node's ranks 1..N-1

    def close(self) -> None:
        """Stops the other tensor-parallel ranks (the engine loop has ended)."""
        if self.ranks is not None:
            started = time.monotonic()
            # The group goes too (this process may build another node), after the graphs
            # whose collectives would hold it.
            self.engine.release_graphs()
            gc.collect()
            self.ranks.stop(leave=leave_tensor_parallel)
            self.ranks = None
            log.info("tensor-parallel ranks and their process group stopped in %.1fs", time.monotonic() - started)

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
            snap["adapter_tier_hits"] = dict(self.adapters.tier_hits)
            source = self.adapters.source
            if isinstance(source, StoreSource) and source.direct is not None:
                snap["adapter_direct_reads"] = dict(source.direct_reads)
        return snap


def resolve_device(name: str | None) -> torch.device:
    if name is None or name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for but no CUDA device is available")
    return torch.device(name)


def cpu_threads(settings: NodeSettings) -> int:
    """A CPU engine's torch threads (per tensor-parallel rank). The front end needs a core of
    its own: an engine whose threads spin on every core stalls each op while the front end
    runs (OpenMP waits for its slowest thread), several times slower on a loaded machine."""
    if settings.cpu_threads > 0:
        return settings.cpu_threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max((cores - 1) // max(settings.tensor_parallel_size, 1), 1)


@dataclass
class RankParts:
    """What every tensor-parallel rank builds alike (rank 0 adds the engine around it)."""

    device: torch.device
    dtype: torch.dtype
    dtype_name: str
    checkpoint: Path
    model: LlamaModel
    slots: SlotBuffers | None
    num_kv_blocks: int
    max_num_seqs: int
    mixed_graphs: bool
    tp: TensorParallel | None
    launches: StepLaunches       # each step's launch choices (the node-wide ones, varied per bucket by a table)
    kv: KVCache | None = None    # ranks 1..N-1 only: rank 0's engine allocates its own


def check_tensor_parallel(settings: NodeSettings, checkpoint: Path) -> None:
    """Fails before any process starts when the node cannot be split as asked."""
    size = settings.tensor_parallel_size
    if size < 1:
        raise ShardingError("--tensor-parallel-size must be at least 1")
    if size == 1:
        return
    check_divisible(ModelConfig.from_checkpoint(checkpoint), size)
    device = resolve_device(settings.device)
    if device.type == "cuda" and torch.cuda.device_count() < size:
        raise ShardingError(f"--tensor-parallel-size {size} needs {size} GPUs (one per rank); "
                            f"{torch.cuda.device_count()} are visible")
    if settings.all_reduce == "symm" and device.type != "cuda":
        raise ShardingError("--all-reduce symm needs CUDA GPUs (symmetric memory); on CPU the ranks sum "
                            "through gloo: leave --all-reduce at nccl")


def resolve_tuning_table(settings: NodeSettings, checkpoint: Path) -> NodeSettings:
    """settings with --tuning-table auto made the file filed for rank 0's GPU and shard
    shape ("off" where none is), and a file given checked against that shape, before any
    rank starts. Every rank then reads that one file and checks it against its own shard's
    shape (the same on every rank: tensor parallelism divides heads, KV heads and the MLP
    width evenly), so all ranks launch the same choices for a step even where a rank's GPU
    reports another name."""
    if settings.tuning_table == "off":
        return settings
    device = resolve_device(settings.device)
    if device.type == "cuda" and settings.tensor_parallel_size > 1:
        device = torch.device("cuda", 0)  # load_rank's device of rank 0
    shard = Shard(0, settings.tensor_parallel_size)
    shape, name = ModelShape.of(shard.local_config(ModelConfig.from_checkpoint(checkpoint))), device_name(device)
    if settings.tuning_table != "auto":
        try:
            load_table(settings.tuning_table, name, shape)
        except TuningTableError as exc:
            raise ValueError(f"--tuning-table: {exc}") from None
        return settings
    path = find_table(name, shape)
    if path is None:
        log.info("no tuning table for %s at shape %s: default launch choices", name, shape.key)
        return dataclasses.replace(settings, tuning_table="off")
    return dataclasses.replace(settings, tuning_table=str(path))


def step_tunings(settings: NodeSettings, device: torch.device, config: ModelConfig) -> StepTunings:
    """Each step's launch choices: the tuning table settings.tuning_table names for this
    device and (shard's) shape, over settings.tuning, the flags given kept; settings.tuning
    for every step where no table applies."""
    shape, name = ModelShape.of(config), device_name(device)
    try:
        table = load_table(settings.tuning_table, name, shape)
    except TuningTableError as exc:
        raise ValueError(f"--tuning-table: {exc}") from None
    if table is None:
        if settings.tuning_table == "auto":
            log.info("no tuning table for %s at shape %s: default launch choices", name, shape.key)
        return StepTunings.fixed(settings.tuning)
    if table.device != name:
        log.warning("tuning table %s was tuned on %s, not this %s", table.path, table.device, name)
    log.info("tuning table %s: %d buckets%s", table.path, len(table.buckets),
             f" (flags kept: {', '.join(sorted(settings.tuning_fixed))})" if settings.tuning_fixed else "")
    return table.tunings(settings.tuning, settings.tuning_fixed)


def load_rank(settings: NodeSettings, shard: Shard, rendezvous: str | None) -> RankParts:
    """One rank's device, model shard, adapter slots and KV block count (the least over all
    ranks, so every rank can hold every block rank 0's allocator hands out)."""
    device = resolve_device(settings.device)
    if shard.size > 1 and device.type == "cuda":
        device = torch.device("cuda", shard.rank)
        torch.cuda.set_device(device)
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads(settings))
    dtype_name = settings.dtype if settings.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    dtype = DTYPES[dtype_name]
    tp = (init_tensor_parallel(shard, device, rendezvous, all_reduce=settings.all_reduce, dtype=dtype)
          if shard.size > 1 else None)
    checkpoint = Path(settings.model) if settings.model else default_checkpoint()
    tunings = step_tunings(settings, device, shard.local_config(ModelConfig.from_checkpoint(checkpoint)))
    if tp is not None:  # over every bucket's tuning: no table's node-wide choice undoes it
        tunings = tunings.map(tensor_parallel_tuning)
    model = LlamaModel.load(checkpoint, device, dtype, max_positions=None, gemm_groups=tunings.base.gemm_groups,
                            load_format=settings.load_format, tp=tp)
    launches = StepLaunches(device, tunings, model.gemm_groups)
    max_num_seqs = settings.max_num_seqs or (256 if device.type == "cuda" else 64)
    mixed_graphs = settings.mixed_graphs == "on" or (settings.mixed_graphs == "auto" and device.type == "cuda")
    slots = None
    if settings.max_loras > 0:
        slots = adapter_memory(settings, model.config, dtype, device, shard)
    per_block = KVCache.bytes_per_block(model.config, settings.block_size, dtype)
    if settings.num_kv_blocks:
        blocks = settings.num_kv_blocks
    elif settings.kv_cache_gb or device.type != "cuda":
        blocks = max(int((settings.kv_cache_gb or 0.5) * (1 << 30)) // per_block, 1)
    else:  # every rank runs the same measuring forward: its collectives meet
        blocks = kv_blocks_for_memory(model, launches.base, settings.gpu_memory_utilization, settings.block_size,
                                      settings.max_num_batched_tokens, max_num_seqs, mixed_graphs)
    if tp is not None:
        blocks = tp.min_int(blocks)
    return RankParts(device, dtype, dtype_name, checkpoint, model, slots, blocks, max_num_seqs, mixed_graphs, tp,
                     launches)


def build_rank(settings: NodeSettings, shard: Shard, rendezvous: str) -> RankParts:
    """A tensor-parallel rank other than 0: its parts and its KV cache (parallel/workers.py)."""
    parts = load_rank(settings, shard, rendezvous)
    parts.kv = KVCache(parts.model.config, parts.num_kv_blocks + 1, settings.block_size, parts.dtype, parts.device)
    return parts


def build_node(settings: NodeSettings) -> Node:
    checkpoint = Path(settings.model) if settings.model else default_checkpoint()
    validate_checkpoint_dir(checkpoint, settings.load_format)
    check_tensor_parallel(settings, checkpoint)
    settings = resolve_tuning_table(settings, checkpoint)  # before the other ranks start: one file for all
    started = time.monotonic()
    ranks = None
    if settings.tensor_parallel_size > 1:
        # Ranks 1..N-1 load their shards while this process loads rank 0's.
        ranks = Workers(settings, settings.tensor_parallel_size, build_rank,
                        logging.getLevelName(logging.getLogger().getEffectiveLevel()))
    try:
        parts = load_rank(settings, Shard(0, settings.tensor_parallel_size),
                          ranks.rendezvous if ranks is not None else None)
        if ranks is not None:
            ranks.wait_ready()
            if parts.slots is not None:
                ranks.attach(parts.slots)
        return _assemble(settings, parts, ranks, started)
    except BaseException:
        if ranks is not None:
            # A process group left behind with its peers gone can hang this process's exit
            # (NCCL's teardown): the node must fail at start, not hang there.
            ranks.stop(leave=leave_tensor_parallel)
        raise


def _assemble(settings: NodeSettings, parts: RankParts, ranks: Workers | None, started: float) -> Node:
    model, device, dtype, checkpoint = parts.model, parts.device, parts.dtype, parts.checkpoint
    model_len = min(settings.max_model_len, model.config.max_position_embeddings)
    codec = TextCodec(checkpoint)
    decode_graphs = settings.decode_graphs == "on" or (settings.decode_graphs == "auto" and device.type == "cuda")
    warmup = settings.warmup
    if ranks is not None:
        if device.type == "cuda" and settings.warmup != "off":
            log.info("tensor parallelism: the warm-up is off (the graphs' captures compile their "
                     "kernels; other eager steps compile theirs on all %d ranks at their first launch)",
                     ranks.size)
        warmup = "off"
    adapters = build_adapter_manager(settings, model, device, dtype, buffers=parts.slots)
    blocks = parts.num_kv_blocks
    engine = build_engine(model, lora=adapters, launches=parts.launches, ranks=ranks, config=EngineConfig(
        num_kv_blocks=blocks, block_size=settings.block_size, max_num_seqs=parts.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens, max_queue=settings.max_queue,
        max_model_len=model_len, prefix_caching=settings.prefix_caching,
        decode_graphs=decode_graphs, piecewise_graphs=parts.mixed_graphs,
        max_graph_batch=settings.max_graph_batch or parts.max_num_seqs,
        prefill_delay_factor=settings.prefill_delay_factor, refill_wait_factor=settings.refill_wait_factor,
        warmup=warmup,
        debug_checks=settings.debug_checks))
    cfg = model.full_config
    per_block = KVCache.bytes_per_block(model.config, settings.block_size, dtype)
    log.info("loaded %s (%s, %d layers, hidden %d, %d/%d heads, vocab %d, %.1fM parameters%s) on %s as %s "
             "in %.1fs; KV cache: %d blocks x %d tokens (%.2f GiB%s), max model length %d",
             checkpoint, cfg.model_type, cfg.num_layers, cfg.hidden_size, cfg.num_heads,
             cfg.num_kv_heads, cfg.vocab_size, model.num_parameters() / 1e6,
             f" on rank 0 of {ranks.size}" if ranks else "", device, parts.dtype_name,
             time.monotonic() - started, blocks, settings.block_size, blocks * per_block / (1 << 30),
             " per rank" if ranks else "", model_len)
    if adapters is not None:
        buffers = adapters.buffers
        log.info("LoRA: %.1f MB of GPU adapter memory%s (%d rank rows per module of %s: e.g. %d "
                 "adapters of rank %d on them), up to %d distinct adapters in a step, ranks up to %d, "
                 "%s eviction, %d in host memory, source: %s",
                 buffers.nbytes() / 1e6, " per rank" if ranks else "", buffers.rows,
                 ",".join(settings.lora_modules), buffers.rows // settings.max_lora_rank,
                 settings.max_lora_rank, settings.max_loras, settings.max_lora_rank,
                 settings.adapter_eviction, settings.max_cpu_loras,
                 settings.adapter_store or settings.adapter_dir or "none")
    catalog = None
    if adapters is not None and isinstance(adapters.source, StoreSource):
        catalog = CatalogWatcher(adapters.source.client, engine.call, adapters.on_catalog_update,
                                 adapters.on_catalog_delete, disk=adapters.source.disk)
    return Node(settings, checkpoint, model, codec, engine, adapters, catalog, ranks)


def adapter_memory(settings: NodeSettings, config: ModelConfig, dtype: torch.dtype,
                   device: torch.device, shard: Shard = Shard()) -> SlotBuffers:
    """The GPU adapter memory of one rank: arenas sized by --lora-memory-mb over the shapes
    this rank computes with (`config`: its shard's; every rank's shard has the same shapes,
    so every rank gets the same rows and rank 0's placements fit them all)."""
    rows = (rows_for_budget(config, dtype, settings.lora_memory_bytes, settings.lora_modules)
            if settings.lora_memory_bytes > 0 else None)
    return SlotBuffers(config, settings.max_loras, settings.max_lora_rank, dtype, device,
                       rows=rows, modules=settings.lora_modules, shard=shard)


def build_adapter_manager(settings: NodeSettings, model: LlamaModel, device: torch.device,
                          dtype: torch.dtype, buffers: SlotBuffers | None = None) -> AdapterManager | None:
    """The adapter tiers over `buffers` (new ones when None). Adapters are checked against the
    whole model's shapes; the slots keep this rank's shard of each (parallel/shard.py)."""
    if settings.max_loras <= 0:
        return None
    source: StoreSource | LocalDirSource | None = None
    pin = device.type == "cuda"  # adapters land in page-locked memory: slot copies run asynchronously
    if settings.adapter_store:
        disk = (DiskTier(settings.adapter_disk_dir, settings.adapter_disk_bytes)
                if settings.adapter_disk_dir else None)
        source = StoreSource(settings.adapter_store, model.full_config, settings.max_lora_rank, tls=settings.store_tls,
                             token=settings.store_token, max_adapter_bytes=settings.max_adapter_bytes,
                             fetch_deadline_s=settings.adapter_fetch_timeout_s, pin_memory=pin, disk=disk,
                             max_weight_abs=settings.max_weight_abs, dtype=dtype,
                             direct_reads=DirectReadSettings() if settings.adapter_direct_reads else None)
    elif settings.adapter_dir:
        source = LocalDirSource(Path(settings.adapter_dir), model.full_config, settings.max_lora_rank,
                                max_bytes=settings.max_adapter_bytes, pin_memory=pin,
                                max_weight_abs=settings.max_weight_abs, dtype=dtype)
    if settings.adapter_disk_dir and not settings.adapter_store:
        log.warning("--adapter-disk-dir keeps adapters from --adapter-store; without a store it is unused")
    if buffers is None:
        buffers = adapter_memory(settings, model.config, dtype, device)
    return AdapterManager(buffers, source, settings.max_cpu_loras, pin_host_memory=pin,
                          disk_copies=source.disk_copies if source is not None else None,
                          eviction=settings.adapter_eviction)
