"""The node's catalog watcher keeps following the store after a final watch error (a wrong
token, a refused certificate): it logs the error and retries with a growing delay, so a
store fixed later is followed again without restarting the node."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import grpc

from adapter_store.client import StoreError
from adapter_store.records import UPDATED
from inference_node.adapters.store_source import CatalogWatcher


class FlakyStore:
    """watch() fails `failures` times with UNAUTHENTICATED, then streams one update."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls = 0

    def watch(self, reconnect: bool, stop: threading.Event):
        self.calls += 1
        if self.calls <= self.failures:
            raise StoreError(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token")
        yield SimpleNamespace(kind=UPDATED, adapter=SimpleNamespace(name="tenant", version="v2"))
        stop.wait()


def test_the_watch_retries_after_final_errors_and_then_follows_updates(caplog) -> None:
    store = FlakyStore(failures=2)
    updates: list[tuple[str, str]] = []
    got = threading.Event()

    def on_update(name: str, version: str) -> None:
        updates.append((name, version))
        got.set()

    watcher = CatalogWatcher(store, post=lambda fn: fn(), on_update=on_update, on_delete=lambda name: None)
    watcher.retry_delay = 0.01
    watcher.start()
    try:
        assert got.wait(10), "the watcher gave up after the failed watches"
    finally:
        watcher.stop()
        watcher.thread.join(5)
    assert updates == [("tenant", "v2")] and store.calls == 3
    assert "catalog watch failed" in caplog.text and "UNAUTHENTICATED" in caplog.text
    assert not watcher.thread.is_alive()
