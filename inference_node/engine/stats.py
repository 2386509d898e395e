"""The engine's counters, read by GetStats and the metrics."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from ..runner.runner import ForwardMode
from .prefix_cache import NamespaceStats, PrefixCache, split_namespace

if TYPE_CHECKING:
    from .engine import Engine


@dataclass
class EngineStats:
    steps: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    preemptions: int = 0
    max_adapters_in_step: int = 0
    graph_steps: int = 0             # decode steps replayed from CUDA graphs (static buffers)
    eager_decode_steps: int = 0      # decode-only steps that ran eagerly (larger than the graphs)
    eager_prefill_steps: int = 0     # steps with prompt tokens (prefill chunks, maybe beside decodes) run eagerly
    piecewise_graph_steps: int = 0   # other steps than decode graphs', replayed piece by piece (piecewise_graphs.py)
    cut_short: int = 0               # answers ended part-way by shutdown
    non_finite_rows: int = 0         # sampled rows whose logits held NaN or Inf (their requests failed)

    def count(self, mode: ForwardMode, prefill: bool) -> None:
        """One more step, by how it ran (prefill: it carries prompt tokens)."""
        self.steps += 1
        if mode is ForwardMode.DECODE_GRAPHS:
            self.graph_steps += 1
        elif mode is ForwardMode.PIECEWISE_GRAPHS:
            self.piecewise_graph_steps += 1
        elif prefill:
            self.eager_prefill_steps += 1
        else:
            self.eager_decode_steps += 1


def engine_snapshot(engine: Engine) -> dict[str, int]:
    """The counters with the KV cache's and the queues' gauges, for GetStats and the metrics."""
    return {
        **asdict(engine.stats),
        "kv_blocks_total": engine.allocator.num_blocks,
        "kv_blocks_free": engine.allocator.num_free,
        "kv_blocks_cached": engine.prefix_cache.num_blocks if engine.prefix_cache is not None else 0,
        "running": len(engine.scheduler.running),
        "waiting": len(engine.scheduler.waiting),
        "preemptions": engine.scheduler.num_preemptions,
        "live_requests": len(engine.live_requests()),
        "tensor_parallel_size": engine.runner.tensor_parallel_size,
        "slot_table_checks": engine.runner.slot_table_checks,
    }


def prefix_cache_rows(cache: PrefixCache | None) -> list[tuple[tuple[str, str], NamespaceStats]]:
    """((adapter, version), counters) per live KV namespace; "" adapter = the base model."""
    return [] if cache is None else [(split_namespace(ns), s) for ns, s in sorted(cache.stats.items())]
