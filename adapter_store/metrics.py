"""Prometheus metrics of one store, in their own registry (several stores can share a
process, as in tests). Exposed over HTTP only when --metrics-port is given."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server


class StoreMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.fetches = Counter("adapter_store_fetches", "FetchAdapter calls started", registry=r)
        self.fetch_bytes = Counter("adapter_store_fetch_bytes", "Adapter bytes streamed to clients", registry=r)
        self.fetch_errors = Counter("adapter_store_fetch_errors", "FetchAdapter calls that failed, by status",
                                    ["code"], registry=r)
        self.catalog_adapters = Gauge("adapter_store_catalog_adapters", "Adapters in the catalog",
                                      ["valid"], registry=r)
        self.cache_hits = Counter("adapter_store_cache_hits", "Objects served from the disk cache", registry=r)
        self.cache_misses = Counter("adapter_store_cache_misses", "Objects downloaded from S3 into the cache",
                                    registry=r)
        self.s3_bytes = Counter("adapter_store_s3_download_bytes", "Bytes downloaded from S3", registry=r)
        self.s3_retries = Counter("adapter_store_s3_retries", "S3 reads retried after an error", registry=r)
        self.read_plans = Counter("adapter_store_read_plans", "GetReadPlan answers: offered, declined (no plan: "
                                  "direct reads off or no digest), or the error code", ["outcome"], registry=r)
        self.watchers = Gauge("adapter_store_watchers", "Open WatchAdapters streams", registry=r)

    def set_catalog(self, valid: int, invalid: int) -> None:
        self.catalog_adapters.labels(valid="true").set(valid)
        self.catalog_adapters.labels(valid="false").set(invalid)

    def value(self, name: str, **labels: str) -> float:
        """A sample's current value (for tests and the benchmark), 0 when absent."""
        return self.registry.get_sample_value(name, labels or None) or 0.0

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        start_http_server(port, addr=host, registry=self.registry)
