"""Prometheus metrics of the node, served on their own HTTP port (`--metrics-port`).

Counters and histograms are updated where things happen (the gRPC handlers); gauges that
describe engine state (queue depth, KV blocks, adapter tiers) are read from the engine
when Prometheus scrapes, through `Engine.call`, so the engine thread stays the only owner.
"""
from __future__ import annotations

import logging
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class NodeMetrics:
    def __init__(self, snapshot: Callable[[], dict[str, float]] | None = None) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("lora_node_requests", "Generate requests by outcome and adapter kind",
                                ["outcome", "kind"], registry=self.registry)
        self.prompt_tokens = Counter("lora_node_prompt_tokens", "prompt tokens of finished requests",
                                     registry=self.registry)
        self.generated_tokens = Counter("lora_node_generated_tokens", "tokens streamed to clients",
                                        registry=self.registry)
        self.ttft = Histogram("lora_node_time_to_first_token_seconds", "time to the first token",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.token_latency = Histogram("lora_node_time_per_output_token_seconds",
                                       "time between streamed tokens", buckets=LATENCY_BUCKETS,
                                       registry=self.registry)
        self.cut_short = Counter("lora_node_requests_cut_short",
                                 "answers ended part-way because the node shut down (drain deadline)",
                                 registry=self.registry)
        self.admin_calls = Counter("lora_node_admin_calls", "adapter admin RPCs by method and outcome",
                                   ["method", "outcome"], registry=self.registry)
        self.engine_collector = _EngineCollector(snapshot) if snapshot is not None else None
        if self.engine_collector is not None:
            self.registry.register(self.engine_collector)

    def serve(self, port: int, host: str = "0.0.0.0", multiprocess_dir: str | None = None) -> None:
        """With several front-end processes (`multiprocess_dir`, prometheus_client's
        multiprocess mode), the counters and histograms of all of them are summed."""
        registry = self.registry
        if multiprocess_dir:
            from prometheus_client import multiprocess

            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry, path=multiprocess_dir)
            if self.engine_collector is not None:
                registry.register(self.engine_collector)
        start_http_server(port, addr=host, registry=registry)
        log.info("Prometheus metrics on http://%s:%d/metrics", host, port)


class _EngineCollector:
    """Engine gauges read at scrape time."""

    GAUGES = {
        "kv_blocks_total": "KV cache blocks",
        "kv_blocks_free": "free KV cache blocks",
        "running": "requests running",
        "waiting": "requests waiting (queue depth)",
        "adapters_gpu": "adapters in GPU slots",
        "adapters_host": "adapters in host memory",
        "adapter_loads": "adapters fetched and installed (total)",
        "adapter_evictions": "adapter slots evicted (total)",
        "adapter_fetch_errors": "adapter fetches that failed (total)",
        "preemptions": "requests preempted (total)",
        "kv_blocks_cached": "KV blocks indexed by the prefix cache (in use or idle)",
        "cached_prompt_tokens": "prompt tokens served from the prefix cache (total)",
    }

    def __init__(self, snapshot: Callable[[], dict[str, float]]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[GaugeMetricFamily]:
        try:
            values = self.snapshot()
        except Exception:  # a busy or stopping engine must not break the scrape
            log.warning("engine metrics unavailable for this scrape")
            return
        for key, text in self.GAUGES.items():
            if key in values:
                yield GaugeMetricFamily(f"lora_node_{key}", text, value=float(values[key]))
        yield from self._prefix_cache(values.get("prefix_cache", {}))

    @staticmethod
    def _prefix_cache(rows: dict[str, dict[str, int]]) -> Iterator[GaugeMetricFamily]:
        """Per adapter name (all its live versions; "" is the base model), so the label set
        stays as small as the adapter catalog."""
        for field, text in (("hit_tokens", "prompt tokens whose prefill the prefix cache skipped"),
                            ("hits", "admissions that reused a cached prefix"),
                            ("lookups", "admissions that looked for a cached prefix"),
                            ("blocks", "KV blocks the prefix cache indexes")):
            family = GaugeMetricFamily(f"lora_node_prefix_cache_{field}",
                                       f"{text}, per adapter, over its live versions", labels=["adapter"])
            for adapter, counters in sorted(rows.items()):
                family.add_metric([adapter], float(counters[field]))
            yield family
