"""Adapters fetched from the adapter store, and the node's subscription to its catalog."""
from __future__ import annotations

import logging
import threading
from typing import Callable

import grpc
import torch

from adapter_store.client import DELETED, UPDATED, AdapterStoreClient, AdapterTooLarge, StoreError, StoreTLSRefused
from lora_common.tls import ClientTLS
from lora_common.validation import DEFAULT_MAX_WEIGHT_ABS

from ..model.config import ModelConfig
from .errors import (AdapterCorrupt, AdapterError, AdapterNotFound, AdapterRejected,
                     AdapterUnavailable)
from .sources import WEIGHTS_FILE, weights_from_files
from .weights import AdapterWeights

log = logging.getLogger(__name__)

_ERRORS = {
    grpc.StatusCode.NOT_FOUND: AdapterNotFound,
    grpc.StatusCode.INVALID_ARGUMENT: AdapterRejected,
    grpc.StatusCode.FAILED_PRECONDITION: AdapterRejected,
    grpc.StatusCode.DATA_LOSS: AdapterCorrupt,
    grpc.StatusCode.UNAVAILABLE: AdapterUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: AdapterUnavailable,
    # This node's credentials are wrong: not the client's fault, and no retry helps.
    grpc.StatusCode.UNAUTHENTICATED: AdapterRejected,
    grpc.StatusCode.PERMISSION_DENIED: AdapterRejected,
}
_HINTS = {
    grpc.StatusCode.UNAUTHENTICATED: " (the store refused this node's token: check --store-token)",
    grpc.StatusCode.PERMISSION_DENIED: " (the store refused this node: check --store-token)",
}


class StoreSource:
    def __init__(self, target: str, model: ModelConfig, max_rank: int, fetch_deadline_s: float = 60.0, *,
                 tls: ClientTLS | None = None, token: str | None = None, max_adapter_bytes: int = 0,
                 max_weight_abs: float = DEFAULT_MAX_WEIGHT_ABS, dtype: torch.dtype = torch.float32) -> None:
        self.target = target
        self.client = AdapterStoreClient(target, tls=tls, token=token)
        self.model = model
        self.max_rank = max_rank
        self.fetch_deadline_s = fetch_deadline_s
        self.max_adapter_bytes = max_adapter_bytes
        self.max_weight_abs = max_weight_abs
        self.dtype = dtype

    def load(self, name: str, version: str) -> AdapterWeights:
        try:
            fetched = self.client.fetch(name, version, deadline_s=self.fetch_deadline_s,
                                        max_bytes=self.max_adapter_bytes)
        except AdapterTooLarge as exc:
            raise AdapterRejected(f"adapter {name!r} is {exc.size / 1e6:.1f} MB; this node loads adapters up to "
                                  f"{exc.limit / 1e6:.1f} MB (--max-adapter-mb)") from exc
        except StoreTLSRefused as exc:  # this node's TLS settings: no retry helps
            raise AdapterRejected(f"adapter {name!r} from the store at {self.target}: {exc.details}") from exc
        except StoreError as exc:
            error = _ERRORS.get(exc.code, AdapterError)
            raise error(f"adapter {name!r} from the store at {self.target}: {exc.code.name}: {exc.details}"
                        f"{_HINTS.get(exc.code, '')}") from exc
        manifest = fetched.manifest
        return weights_from_files(name, manifest.info.version, manifest.config_json,
                                  fetched.files[WEIGHTS_FILE], self.model, self.max_rank,
                                  max_weight_abs=self.max_weight_abs, dtype=self.dtype)

    def catalog(self) -> list[tuple[str, int]]:
        """The store's valid adapters (raises AdapterError when it cannot be reached)."""
        try:
            return [(a.name, a.updated_at) for a in self.client.list_adapters() if a.valid]
        except StoreError as exc:
            error = _ERRORS.get(exc.code, AdapterError)
            raise error(f"listing the adapter store at {self.target}: {exc.code.name}: {exc.details}"
                        f"{_HINTS.get(exc.code, '')}") from exc

    def close(self) -> None:
        self.client.close()


class CatalogWatcher:
    """Follows the store's catalog: a new version or a deletion reaches the adapter manager
    (through `post`, which runs the change on the engine thread)."""

    def __init__(self, client: AdapterStoreClient, post: Callable[[Callable[[], None]], object],
                 on_update: Callable[[str, str], None], on_delete: Callable[[str], None]) -> None:
        self.client = client
        self.post = post
        self.on_update = on_update
        self.on_delete = on_delete
        self.stop_event = threading.Event()
        self.retry_delay, self.max_retry_delay = 1.0, 60.0  # after a final watch error
        self.thread = threading.Thread(target=self._run, name="catalog-watch", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stop_event.set()

    def _run(self) -> None:
        """Watches until stopped. The client reconnects after transient errors itself; a final
        one (a wrong token, a refused certificate) is logged and retried with a growing delay,
        so a store whose credentials are fixed later is followed again without a node restart."""
        delay = self.retry_delay
        while not self.stop_event.is_set():
            try:
                for event in self.client.watch(reconnect=True, stop=self.stop_event):
                    delay = self.retry_delay
                    self._apply(event)
            except Exception as exc:  # the node keeps serving; loads still go to the store
                if self.stop_event.is_set():
                    return
                log.error("catalog watch failed, retrying in %.0fs: %s", delay, exc)
                self.stop_event.wait(delay)
                delay = min(delay * 2, self.max_retry_delay)

    def _apply(self, event) -> None:
        if event.kind == UPDATED and event.adapter is not None:
            name, version = event.adapter.name, event.adapter.version
            log.info("catalog: %s has a new version %s", name, version[:12])
            self.post(lambda: self.on_update(name, version))
        elif event.kind == DELETED and event.adapter is not None:
            name = event.adapter.name
            log.info("catalog: %s was deleted", name)
            self.post(lambda: self.on_delete(name))
