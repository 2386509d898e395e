"""Prometheus metrics of the node, served on their own HTTP port (`--metrics-port`).

Request metrics are labelled per adapter, as each adapter is usually a customer or a
product. The front end that handles a request reports it through three calls:

    metrics.first_token(adapter, ttft_s, count)      # the first streamed tokens
    metrics.tokens_streamed(adapter, count, gap_s)   # each later message of tokens
    metrics.request_finished(adapter, status, prompt_tokens, output_tokens)  # once, however it ended

Engine state (queue depth, KV blocks, adapter tiers, per-adapter loads, evictions, load time
and numerical faults) is read from a snapshot of the engine when Prometheus scrapes
(`Node.snapshot()`, through the call the front end has to the engine), so the engine stays
the only owner of its state.

Label cardinality is bounded: at most `max_adapter_labels` adapters have their own `adapter`
label value, chosen by traffic; the others share OTHER. The base model is adapter="".
"""
from __future__ import annotations

import logging
import threading
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# The label of adapters without their own: no adapter name can start with "_" (ADAPTER_NAME).
OTHER = "_other"
BASE = ""
DEFAULT_MAX_ADAPTER_LABELS = 32
# Statuses of requests that never reached their adapter (it may not even exist): they count
# under their adapter's label if it has one, but never win it one.
UNRESOLVED = frozenset({"not_found", "invalid_argument", "unauthenticated", "permission_denied",
                        "resource_exhausted", "unavailable"})


class AdapterLabels:
    """Which adapters get their own label value: at most `limit` of them, by traffic.

    An adapter is admitted while there is room; once full, an adapter with more than twice
    the finished requests of the least busy labelled one takes its place, and that one's
    series are removed (`on_evict`), so every series stays monotonic and their number
    bounded. Only adapters that a request reached are admitted, so names that clients
    invent (unknown adapters) never take a label. Thread-safe: handlers of several threads
    or loops may report."""

    def __init__(self, limit: int, on_evict: Callable[[str], None] = lambda name: None) -> None:
        self.limit = max(limit, 0)
        self.on_evict = on_evict
        self.labelled: set[str] = set()
        self.traffic: dict[str, int] = {}  # finished requests per name, bounded (_track)
        self._lock = threading.Lock()

    def label(self, adapter: str, admit: bool = False) -> str:
        if adapter == BASE:
            return BASE
        with self._lock:
            if adapter in self.labelled:
                return adapter
            if admit and self._admit(adapter):
                return adapter
            return OTHER

    def count(self, adapter: str) -> None:
        """One finished request of this adapter (its traffic rank)."""
        if adapter == BASE:
            return
        with self._lock:
            self.traffic[adapter] = self.traffic.get(adapter, 0) + 1
            if len(self.traffic) > 8 * max(self.limit, 1):  # forget the quietest unlabelled name
                quiet = min((n for n in self.traffic if n not in self.labelled), key=self.traffic.__getitem__)
                del self.traffic[quiet]

    def current(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self.labelled)

    def _admit(self, adapter: str) -> bool:
        if len(self.labelled) < self.limit:
            self.labelled.add(adapter)
            return True
        if not self.labelled:
            return False
        weakest = min(self.labelled, key=lambda n: self.traffic.get(n, 0))
        if self.traffic.get(adapter, 0) <= 2 * self.traffic.get(weakest, 0):
            return False
        self.labelled.discard(weakest)
        self.labelled.add(adapter)
        self.on_evict(weakest)
        return True


class NodeMetrics:
    def __init__(self, snapshot: Callable[[], dict] | None = None,
                 max_adapter_labels: int = DEFAULT_MAX_ADAPTER_LABELS) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("lora_node_requests", "Generate requests by how they ended (finish reason "
                                "or gRPC status) and adapter", ["adapter", "status"], registry=r)
        self.prompt_tokens = Counter("lora_node_prompt_tokens", "prompt tokens of finished requests",
                                     ["adapter"], registry=r)
        self.generated_tokens = Counter("lora_node_generated_tokens", "tokens streamed to clients",
                                        ["adapter"], registry=r)
        self.ttft = Histogram("lora_node_time_to_first_token_seconds", "time to the first token",
                              ["adapter"], buckets=LATENCY_BUCKETS, registry=r)
        self.token_latency = Histogram("lora_node_time_per_output_token_seconds",
                                       "time between streamed tokens", ["adapter"], buckets=LATENCY_BUCKETS,
                                       registry=r)
        self.cut_short = Counter("lora_node_requests_cut_short",
                                 "answers ended part-way because the node shut down (drain deadline)", registry=r)
        self.admin_calls = Counter("lora_node_admin_calls", "adapter admin RPCs by method and outcome",
                                   ["method", "outcome"], registry=r)
        self.labels = AdapterLabels(max_adapter_labels, on_evict=self._remove_series)
        self._statuses: dict[str, set[str]] = {}  # label -> statuses seen (to remove its series)
        self._streamed: dict[str, tuple] = {}       # label -> its streaming series (_streamed_series)
        self.engine_collector = _EngineCollector(snapshot, self.labels) if snapshot is not None else None
        if self.engine_collector is not None:
            self.registry.register(self.engine_collector)

    # -- what the front end reports --------------------------------------------------------------
    def first_token(self, adapter: str, ttft_s: float, count: int = 1) -> None:
        """The first message of tokens of a request, ttft_s after it arrived."""
        label = self.labels.label(adapter, admit=True)
        self.ttft.labels(label).observe(ttft_s)
        self.generated_tokens.labels(label).inc(count)

    def tokens_streamed(self, adapter: str, count: int, gap_s: float) -> None:
        """A later message of `count` tokens, gap_s after the previous one: one observation of
        gap_s / count per token, so the histogram's count is the tokens after each request's first
        message and its sum the time they took, however the tokens were grouped into messages."""
        if count:
            latency, tokens = self._streamed_series(self.labels.label(adapter))
            per_token = gap_s / count
            for _ in range(count):
                latency.observe(per_token)
            tokens.inc(count)

    def _streamed_series(self, label: str):
        """The label's time-per-token histogram and token counter, looked up once: this runs for
        every streamed message, and prometheus_client's labels() costs more than the update."""
        series = self._streamed.get(label)
        if series is None:
            series = self._streamed[label] = (self.token_latency.labels(label), self.generated_tokens.labels(label))
        return series

    def request_finished(self, adapter: str, status: str, prompt_tokens: int = 0, output_tokens: int = 0) -> None:
        """Once per request, however it ended: status is its finish reason (stop, length,
        cancelled) or its gRPC status in lower case (invalid_argument, not_found, data_loss...)."""
        resolved = status not in UNRESOLVED or output_tokens > 0
        if resolved:
            self.labels.count(adapter)
        label = self.labels.label(adapter, admit=resolved)
        self._statuses.setdefault(label, set()).add(status)
        self.requests.labels(label, status).inc()
        if prompt_tokens:
            self.prompt_tokens.labels(label).inc(prompt_tokens)

    # -- serving ------------------------------------------------------------------------------------
    def serve(self, port: int, host: str = "0.0.0.0", multiprocess_dir: str | None = None) -> None:
        """With several front-end processes (`multiprocess_dir`, prometheus_client's
        multiprocess mode), the counters and histograms of all of them are summed (each
        process bounds its own adapter labels)."""
        registry = self.registry
        if multiprocess_dir:
            from prometheus_client import multiprocess

            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry, path=multiprocess_dir)
            if self.engine_collector is not None:
                registry.register(self.engine_collector)
        start_http_server(port, addr=host, registry=registry)
        log.info("Prometheus metrics on http://%s:%d/metrics", host, port)

    def _remove_series(self, label: str) -> None:
        """An adapter lost its label: its series go (later traffic counts under OTHER)."""
        self._streamed.pop(label, None)
        for metric in (self.prompt_tokens, self.generated_tokens, self.ttft, self.token_latency):
            try:
                metric.remove(label)
            except KeyError:
                pass
        for status in self._statuses.pop(label, set()):
            try:
                self.requests.remove(label, status)
            except KeyError:
                pass


class _EngineCollector:
    """Engine state read at scrape time."""

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
        "non_finite_rows": "sampled rows whose logits held NaN or Inf; their requests failed (total)",
    }

    def __init__(self, snapshot: Callable[[], dict], labels: AdapterLabels | None = None) -> None:
        self.snapshot = snapshot
        self.labels = labels or AdapterLabels(DEFAULT_MAX_ADAPTER_LABELS)

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
        yield from self._adapters(values.get("adapter_counters", {}))
        if "adapter_tier_hits" in values:
            hits = CounterMetricFamily("lora_node_adapter_requests_by_tier", "adapter requests by where their "
                                       "adapter was when the node first saw them (gpu, host, disk, store): the "
                                       "tiers' hit rates", labels=["tier"])
            for tier, count in sorted(values["adapter_tier_hits"].items()):
                hits.add_metric([tier], count)
            yield hits
        if "adapter_direct_reads" in values:
            direct = CounterMetricFamily("lora_node_adapter_direct_reads", "adapter loads from the store by how "
                                         "their bytes came (--adapter-direct-reads): direct (straight from S3), "
                                         "fallback (the direct read failed: streamed), declined (no read plan: "
                                         "streamed)", labels=["outcome"])
            for outcome, count in sorted(values["adapter_direct_reads"].items()):
                direct.add_metric([outcome], count)
            yield direct

    def _fold(self, rows: dict[str, dict]) -> dict[str, list[dict]]:
        """Rows per label: labelled adapters alone, every other one under OTHER."""
        labelled = self.labels.current()
        folded: dict[str, list[dict]] = {}
        for name, row in rows.items():
            folded.setdefault(name if name in labelled or name == BASE else OTHER, []).append(row)
        return folded

    def _adapters(self, rows: dict[str, dict]) -> Iterator:
        """Per adapter (bounded labels): loads and evictions per tier, load time, faults."""
        folded = self._fold(rows)
        loads = CounterMetricFamily("lora_node_adapter_tier_loads", "adapter loads into a tier (host: fetched "
                                    "and validated; gpu: copied into a slot), per adapter", labels=["adapter", "tier"])
        evictions = CounterMetricFamily("lora_node_adapter_tier_evictions", "adapters dropped from a tier, per "
                                        "adapter", labels=["adapter", "tier"])
        faults = CounterMetricFamily("lora_node_adapter_numerical_faults", "requests whose logits were not finite "
                                     "(ended with DATA_LOSS), per adapter", labels=["adapter"])
        seconds = HistogramMetricFamily("lora_node_adapter_load_seconds", "time to fetch, validate and probe an "
                                        "adapter into host memory, per adapter", labels=["adapter"])
        for label, group in sorted(folded.items()):
            for tier in ("host", "gpu"):
                loads.add_metric([label, tier], sum(r["loads"][tier] for r in group))
                evictions.add_metric([label, tier], sum(r["evictions"][tier] for r in group))
            faults.add_metric([label], sum(r["numerical_faults"] for r in group))
            bounds = [b for b, _ in group[0]["load_seconds"]["buckets"]]  # cumulative counts
            buckets = [(repr(float(bound)), sum(r["load_seconds"]["buckets"][i][1] for r in group))
                       for i, bound in enumerate(bounds)]
            count = sum(r["load_seconds"]["count"] for r in group)
            buckets.append(("+Inf", count))
            seconds.add_metric([label], buckets, sum(r["load_seconds"]["sum"] for r in group))
        yield from (loads, evictions, faults, seconds)

    def _prefix_cache(self, rows: dict[str, dict[str, int]]) -> Iterator[GaugeMetricFamily]:
        """Per adapter (bounded labels, "" is the base model), over its live versions."""
        folded = self._fold(rows)
        for field, text in (("hit_tokens", "prompt tokens whose prefill the prefix cache skipped"),
                            ("hits", "admissions that reused a cached prefix"),
                            ("lookups", "admissions that looked for a cached prefix"),
                            ("blocks", "KV blocks the prefix cache indexes")):
            family = GaugeMetricFamily(f"lora_node_prefix_cache_{field}",
                                       f"{text}, per adapter, over its live versions", labels=["adapter"])
            for label, group in sorted(folded.items()):
                family.add_metric([label], float(sum(r[field] for r in group)))
            yield family
