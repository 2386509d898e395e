"""Assembles a node from its NodeConfig: checkpoint, device, KV cache size, adapter tiers, engine."""
from __future__ import annotations

import gc
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.tuning_table import ModelShape, StepTunings, TuningTableError, device_name, load_table

from .adapters.direct_reads import DirectReadSettings
from .adapters.disk_tier import DiskTier, DiskTierInUse
from .adapters.manager import AdapterManager
from .adapters.slots import SlotBuffers, rows_for_budget
from .adapters.sources import LocalDirSource
from .adapters.store_source import CatalogWatcher, StoreSource
from .config import ConfigError, NodeConfig
from .engine.build import build_engine
from .engine.config import EngineConfig
from .engine.engine import Engine
from .engine.grammar import GrammarCompiler
from .engine.kv_cache import KVCache
from .engine.stats import prefix_cache_rows
from .model.checkpoint import CheckpointError, validate_checkpoint_dir
from .model.embedded import cache_root, default_checkpoint
from .model.config import ModelConfig
from .model.llama import LlamaModel
from .model.loader import load_model
from .parallel.group import TensorParallel, init_tensor_parallel, leave_tensor_parallel
from .parallel.shard import Shard, ShardingError, check_divisible, tensor_parallel_tuning
from .parallel.workers import Workers
from .runner.kv_budget import kv_blocks_for_memory
from .runner.launches import StepLaunches
from .tokenizer import TextCodec

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Node:
    config: NodeConfig
    checkpoint: Path
    model: LlamaModel
    codec: TextCodec
    engine: Engine
    adapters: AdapterManager | None = None
    catalog: CatalogWatcher | None = None   # follows the adapter store's catalog events
    ranks: Workers | None = None            # a tensor-parallel node's ranks 1..N-1
    disk: DiskTier | None = None            # the store adapters' disk tier, its folder locked to this node

    def close(self) -> None:
        """Stops the other tensor-parallel ranks and lets the disk tier's directory go (the
        engine loop has ended)."""
        if self.disk is not None:
            self.disk.close()
            self.disk = None
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
        for (adapter, _), stats in prefix_cache_rows(self.engine.prefix_cache):
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
        raise ConfigError("--device cuda was asked for but no CUDA device is available")
    return torch.device(name)


def cpu_threads(config: NodeConfig) -> int:
    """A CPU engine's torch threads (per tensor-parallel rank). The front end needs a core of
    its own: an engine whose threads spin on every core stalls each op while the front end
    runs (OpenMP waits for its slowest thread), several times slower on a loaded machine."""
    if config.runner.cpu_threads > 0:
        return config.runner.cpu_threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max((cores - 1) // max(config.model.tensor_parallel_size, 1), 1)


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


def check_tensor_parallel(config: NodeConfig, checkpoint: Path) -> None:
    """Fails before any process starts when the node cannot be split as asked."""
    size, all_reduce = config.model.tensor_parallel_size, config.model.all_reduce
    if size < 1:
        raise ShardingError("--tensor-parallel-size must be at least 1")
    if size == 1:
        return
    check_divisible(ModelConfig.from_checkpoint(checkpoint), size)
    device = resolve_device(config.model.device)
    if device.type == "cuda" and torch.cuda.device_count() < size:
        raise ShardingError(f"--tensor-parallel-size {size} needs {size} GPUs (one per rank); "
                            f"{torch.cuda.device_count()} are visible")
    if all_reduce != "nccl" and device.type != "cuda":
        raise ShardingError(f"--all-reduce {all_reduce} needs CUDA GPUs (symmetric memory); on CPU the ranks "
                            "sum through gloo: leave --all-reduce at nccl")


def dtype_name(config: NodeConfig, device: torch.device) -> str:
    """The model's dtype on `device` (--dtype auto: bfloat16 on CUDA, float32 elsewhere)."""
    if config.model.dtype != "auto":
        return config.model.dtype
    return "bfloat16" if device.type == "cuda" else "float32"


def tuning_cache(config: NodeConfig) -> Path:
    """Where the tables this host tunes are kept (--tuning-cache-dir, else under the cache
    directory, beside the embedded model)."""
    from .tuner.tune import default_cache

    folder = config.kernels.tuning_cache_dir
    return Path(folder) if folder else default_cache()


def resolve_tuning_table(config: NodeConfig, checkpoint: Path) -> NodeConfig:
    """config with --tuning-table auto made the file of rank 0's GPU, shard shape and dtype
    (the repository's seed, else this host's cached table, else one tuned now within
    --tune-budget: inference_node/tuner) or "off" where there is none, and a file given
    checked against that shape, before any rank starts. Every rank then reads that one file
    and checks it against its own shard's shape (the same on every rank: tensor parallelism
    divides heads, KV heads and the MLP width evenly), so all ranks launch the same choices
    for a step even where a rank's GPU reports another name."""
    from .tuner.tune import node_table

    table, size = config.kernels.tuning_table, config.model.tensor_parallel_size
    if table == "off":
        return config
    device = resolve_device(config.model.device)
    if device.type == "cuda" and size > 1:
        device = torch.device("cuda", 0)  # load_rank's device of rank 0
    model_config = ModelConfig.from_checkpoint(checkpoint)
    shape = ModelShape.of(Shard(0, size).local_config(model_config))
    try:
        found = node_table(table, device, shape, DTYPES[dtype_name(config, device)],
                           budget_s=config.kernels.tune_budget, tp=size, cache=tuning_cache(config),
                           quantization=fp8_kind(config, model_config))
    except TuningTableError as exc:
        raise ConfigError(f"--tuning-table: {exc}") from None
    if table != "auto":
        return config
    log.info("tuning table: %s", found.describe())
    return config.replace(tuning_table=str(found.table.path) if found.table is not None else "off")


def fp8_kind(config: NodeConfig, model_config: ModelConfig) -> str:
    """The node's projections' weights as a tuning table names them: "none" (plain), "fp8"
    (FP8 widened to multiply: --quantization fp8, or an FP8 checkpoint without
    --quantization) or "fp8-w8a8"; their GEMMs are other kernels, tuned in tables of their own."""
    fp8 = config.model.quantize_fp8 or model_config.weight_quant is not None
    return ("fp8-w8a8" if config.model.fp8_w8a8 else "fp8") if fp8 else "none"


def step_tunings(config: NodeConfig, device: torch.device, model_config: ModelConfig) -> StepTunings:
    """Each step's launch choices: the tuning table config names (resolved: a path or off)
    over the node's tuning, the choices given (--tune) kept; the node's tuning for every step
    where no table applies."""
    kernels = config.kernels
    shape, name = ModelShape.of(model_config), device_name(device)
    try:
        table = load_table(kernels.tuning_table, shape)
    except TuningTableError as exc:
        raise ConfigError(f"--tuning-table: {exc}") from None
    if table is None:
        return StepTunings.fixed(kernels.tuning)
    if table.device != name:
        log.warning("tuning table %s was tuned on %s, not this %s", table.path, table.device, name)
    kind = fp8_kind(config, model_config)
    if table.quantization != kind:
        log.warning("tuning table %s was tuned over %s projection weights, not this node's %s: its launch "
                    "choices for these GEMMs are defaults", table.path, table.quantization, kind)
    log.info("tuning table %s: %d buckets%s", table.path, len(table.buckets),
             f" (--tune kept: {', '.join(sorted(kernels.tuning_fixed))})" if kernels.tuning_fixed else "")
    return table.tunings(kernels.tuning, kernels.tuning_fixed)


def load_rank(config: NodeConfig, shard: Shard, rendezvous: str | None) -> RankParts:
    """One rank's device, model shard, adapter slots and KV block count (the least over all
    ranks, so every rank can hold every block rank 0's allocator hands out)."""
    model_options, cache = config.model, config.cache
    device = resolve_device(model_options.device)
    if shard.size > 1 and device.type == "cuda":
        device = torch.device("cuda", shard.rank)
        torch.cuda.set_device(device)
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads(config))
    dtype = DTYPES[dtype_name(config, device)]
    tp = (init_tensor_parallel(shard, device, rendezvous, all_reduce=model_options.all_reduce, dtype=dtype)
          if shard.size > 1 else None)
    checkpoint = Path(model_options.checkpoint) if model_options.checkpoint else default_checkpoint()
    tunings = step_tunings(config, device, shard.local_config(ModelConfig.from_checkpoint(checkpoint)))
    if tp is not None:  # over every bucket's tuning: no table's node-wide choice undoes it
        tunings = tunings.map(tensor_parallel_tuning)
    model = load_model(checkpoint, device, dtype, max_positions=None, gemm_groups=tunings.base.gemm_groups,
                            load_format=model_options.load_format, tp=tp, quantization=model_options.quantization,
                            fp8_w8a8=model_options.fp8_w8a8)
    tunings = tunings.map(model.step_tuning)  # FP8 GEMMs only shrink; biased groups fold nothing
    launches = StepLaunches(device, tunings, model.gemm_groups)
    max_num_seqs = config.scheduler.max_num_seqs or (256 if device.type == "cuda" else 64)
    mixed_graphs = config.runner.mixed_graphs_on(device.type)
    slots = None
    if config.lora.max_loras > 0:
        slots = adapter_memory(config, model.config, dtype, device, shard)
    per_block = KVCache.bytes_per_block(model.config, cache.block_size, dtype)
    if cache.num_kv_blocks:
        blocks = cache.num_kv_blocks
    elif cache.kv_cache_gb or device.type != "cuda":
        blocks = max(int((cache.kv_cache_gb or 0.5) * (1 << 30)) // per_block, 1)
    else:  # every rank runs the same measuring forward: its collectives meet
        blocks = kv_blocks_for_memory(model, launches.base, cache.gpu_memory_utilization, cache.block_size,
                                      config.scheduler.max_num_batched_tokens, max_num_seqs, mixed_graphs)
    if tp is not None:
        blocks = tp.min_int(blocks)
    return RankParts(device, dtype, dtype_name(config, device), checkpoint, model, slots, blocks, max_num_seqs, mixed_graphs, tp,
                     launches)


def build_rank(config: NodeConfig, shard: Shard, rendezvous: str) -> RankParts:
    """A tensor-parallel rank other than 0: its parts and its KV cache (parallel/workers.py)."""
    parts = load_rank(config, shard, rendezvous)
    parts.kv = KVCache(parts.model.config, parts.num_kv_blocks + 1, config.cache.block_size, parts.dtype,
                       parts.device)
    return parts


def checked_config(config: NodeConfig) -> tuple[NodeConfig, Path]:
    """The config with its tuning table resolved, and the checkpoint directory (the embedded
    model converted on first use), once every setting that depends on the model or the
    host is known to work: ConfigError, naming the flag, before any weight loads."""
    checkpoint = Path(config.model.checkpoint) if config.model.checkpoint else default_checkpoint()
    try:
        validate_checkpoint_dir(checkpoint, config.model.load_format)
        check_tensor_parallel(config, checkpoint)
    except (CheckpointError, ShardingError) as exc:
        raise ConfigError(str(exc)) from None
    return resolve_tuning_table(config, checkpoint), checkpoint


def build_node(config: NodeConfig) -> Node:
    config, checkpoint = checked_config(config)  # before the other ranks start: one table file for all
    disk = open_disk_tier(config, checkpoint)
    started = time.monotonic()
    ranks = None
    size = config.model.tensor_parallel_size
    try:
        if size > 1:
            # Ranks 1..N-1 load their shards while this process loads rank 0's.
            ranks = Workers(config, size, build_rank, logging.getLevelName(logging.getLogger().getEffectiveLevel()))
        parts = load_rank(config, Shard(0, size), ranks.rendezvous if ranks is not None else None)
        if ranks is not None:
            ranks.wait_ready()
            if parts.slots is not None:
                ranks.attach(parts.slots)
        return _assemble(config, parts, ranks, started, disk)
    except BaseException:
        if ranks is not None:
            # A process group left behind with its peers gone can hang this process's exit
            # (NCCL's teardown): the node must fail at start, not hang there.
            ranks.stop(leave=leave_tensor_parallel)
        if disk is not None:
            disk.close()
        raise


def _assemble(config: NodeConfig, parts: RankParts, ranks: Workers | None, started: float,
              disk: DiskTier | None) -> Node:
    model, device, dtype, checkpoint = parts.model, parts.device, parts.dtype, parts.checkpoint
    cache, scheduler, runner, lora = config.cache, config.scheduler, config.runner, config.lora
    model_len = min(config.model.max_model_len, model.config.max_position_embeddings)
    codec = TextCodec(checkpoint)
    warmup = runner.warmup_setting()
    if ranks is not None:
        if device.type == "cuda" and warmup != "off":
            log.info("tensor parallelism: the warm-up is off (the graphs' captures compile their "
                     "kernels; other eager steps compile theirs on all %d ranks at their first launch)",
                     ranks.size)
        warmup = "off"
    adapters = build_adapter_manager(config, model, device, dtype, buffers=parts.slots, disk=disk)
    blocks = parts.num_kv_blocks
    grammars = GrammarCompiler(checkpoint / "tokenizer.json", model.full_config.vocab_size,
                               model.full_config.eos_token_ids, parallel_masks=device.type == "cuda")
    engine = build_engine(model, lora=adapters, launches=parts.launches, ranks=ranks, grammars=grammars, config=EngineConfig(
        num_kv_blocks=blocks, block_size=cache.block_size, max_num_seqs=parts.max_num_seqs,
        max_num_batched_tokens=scheduler.max_num_batched_tokens, max_queue=scheduler.max_queue,
        max_model_len=model_len, prefix_caching=cache.prefix_caching,
        decode_graphs=runner.decode_graphs_on(device.type), piecewise_graphs=parts.mixed_graphs,
        max_graph_batch=runner.max_graph_batch or parts.max_num_seqs,
        prefill_delay_factor=scheduler.prefill_delay_factor, refill_wait_factor=scheduler.refill_wait_factor,
        warmup=warmup, debug_checks=runner.debug_checks))
    cfg = model.full_config
    per_block = KVCache.bytes_per_block(model.config, cache.block_size, dtype)
    log.info("loaded %s (%s, %d layers, hidden %d, %d/%d heads, vocab %d, %.1fM parameters%s) on %s as %s%s "
             "in %.1fs: %.2f GiB of weights%s; KV cache: %d blocks x %d tokens (%.2f GiB%s), max model length %d",
             checkpoint, cfg.model_type, cfg.num_layers, cfg.hidden_size, cfg.num_heads,
             cfg.num_kv_heads, cfg.vocab_size, model.num_parameters() / 1e6,
             f" on rank 0 of {ranks.size}" if ranks else "", device, parts.dtype_name,
             " with FP8 projections" if model.fp8_projections else "", time.monotonic() - started, model.weight_bytes() / (1 << 30),
             " per rank" if ranks else "", blocks, cache.block_size, blocks * per_block / (1 << 30),
             " per rank" if ranks else "", model_len)
    if adapters is not None:
        buffers, sources = adapters.buffers, config.sources
        log.info("LoRA: %.1f MB of GPU adapter memory%s (%d rank rows per module of %s: e.g. %d "
                 "adapters of rank %d on them), up to %d distinct adapters in a step, ranks up to %d, "
                 "%s eviction, %d in host memory, source: %s%s",
                 buffers.nbytes() / 1e6, " per rank" if ranks else "", buffers.rows,
                 ",".join(lora.lora_modules), buffers.rows // lora.max_lora_rank,
                 lora.max_lora_rank, lora.max_loras, lora.max_lora_rank,
                 lora.adapter_eviction, lora.max_cpu_loras,
                 sources.adapter_store or sources.adapter_dir or "none",
                 f", disk tier {disk.root} (up to {disk.max_bytes / (1 << 30):.1f} GiB)" if disk is not None else "")
    catalog = None
    if adapters is not None and isinstance(adapters.source, StoreSource):
        catalog = CatalogWatcher(adapters.source.client, engine.call, adapters.on_catalog_update,
                                 adapters.on_catalog_delete, disk=adapters.source.disk)
    return Node(config, checkpoint, model, codec, engine, adapters, catalog, ranks, disk)


def adapter_memory(config: NodeConfig, model_config: ModelConfig, dtype: torch.dtype,
                   device: torch.device, shard: Shard = Shard()) -> SlotBuffers:
    """The GPU adapter memory of one rank: arenas sized by --lora-memory-mb over the shapes
    this rank computes with (`model_config`: its shard's; every rank's shard has the same
    shapes, so every rank gets the same rows and rank 0's placements fit them all)."""
    lora = config.lora
    rows = (rows_for_budget(model_config, dtype, lora.lora_memory_bytes, lora.lora_modules)
            if lora.lora_memory_bytes > 0 else None)
    return SlotBuffers(model_config, lora.max_loras, lora.max_lora_rank, dtype, device,
                       rows=rows, modules=lora.lora_modules, shard=shard)


def default_disk_parent(checkpoint: Path) -> Path:
    """Where the disk tiers of nodes serving this model live by default: under the cache
    directory, in a folder named by the checkpoint's, so a restarted node finds its adapters
    again and nodes of other models keep theirs apart. (A copy whose store no longer has it,
    or has another version of it, is dropped or replaced at its first load.)"""
    return cache_root() / "adapter-disk" / checkpoint.name


def open_disk_tier(config: NodeConfig, checkpoint: Path) -> DiskTier | None:
    """The node's disk tier of store adapters: --adapter-disk-dir, else a free slot of the
    default folder (a restarted node takes the slot it had; nodes running beside it take
    others); None without a store or with --no-adapter-disk-tier."""
    sources = config.sources
    if sources.adapter_disk_dir and not sources.adapter_store:
        log.warning("--adapter-disk-dir keeps adapters from --adapter-store; without a store it is unused")
    if not sources.adapter_store or not sources.adapter_disk_tier or config.lora.max_loras <= 0:
        return None
    if sources.adapter_disk_dir:
        try:
            return DiskTier(sources.adapter_disk_dir, sources.adapter_disk_bytes)
        except DiskTierInUse as exc:
            raise ConfigError(f"--adapter-disk-dir: {exc}") from None
    return DiskTier.first_free(default_disk_parent(checkpoint), sources.adapter_disk_bytes)


def build_adapter_manager(config: NodeConfig, model: LlamaModel, device: torch.device, dtype: torch.dtype,
                          buffers: SlotBuffers | None = None, disk: DiskTier | None = None) -> AdapterManager | None:
    """The adapter tiers over `buffers` (new ones when None), the store's behind `disk`.
    Adapters are checked against the whole model's shapes; the slots keep this rank's shard
    of each (parallel/shard.py)."""
    lora, sources = config.lora, config.sources
    if lora.max_loras <= 0:
        return None
    source: StoreSource | LocalDirSource | None = None
    pin = device.type == "cuda"  # adapters land in page-locked memory: slot copies run asynchronously
    if sources.adapter_store:
        source = StoreSource(sources.adapter_store, model.full_config, lora.max_lora_rank, tls=sources.store_tls,
                             token=sources.store_token, max_adapter_bytes=lora.max_adapter_bytes,
                             fetch_deadline_s=sources.adapter_fetch_timeout_s, pin_memory=pin, disk=disk,
                             max_weight_abs=lora.max_weight_abs, dtype=dtype,
                             direct_reads=DirectReadSettings() if sources.adapter_direct_reads else None,
                             modules=lora.lora_modules)
    elif sources.adapter_dir:
        source = LocalDirSource(Path(sources.adapter_dir), model.full_config, lora.max_lora_rank,
                                max_bytes=lora.max_adapter_bytes, pin_memory=pin,
                                max_weight_abs=lora.max_weight_abs, dtype=dtype, modules=lora.lora_modules)
    if buffers is None:
        buffers = adapter_memory(config, model.config, dtype, device)
    return AdapterManager(buffers, source, lora.max_cpu_loras, pin_host_memory=pin,
                          disk_copies=source.disk_copies if source is not None else None,
                          eviction=lora.adapter_eviction)
