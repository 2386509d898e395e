"""Adapters fetched from the adapter store, and the node's subscription to its catalog."""
from __future__ import annotations

import logging
import threading
from typing import Callable

import grpc
import torch

from adapter_store.client import (DELETED, UPDATED, AdapterInfo, AdapterStoreClient, AdapterTooLarge, Cancellation,
                                  Cancelled, FetchedAdapter, Manifest, ReadPlan, StoreError, StoreTLSRefused)
from lora_common.tls import ClientTLS
from lora_common.validation import DEFAULT_MAX_WEIGHT_ABS

from ..model.config import ModelConfig
from .direct_reads import DirectReader, DirectReadFailed, DirectReadSettings
from .disk_tier import DiskCorrupt, DiskTier
from .errors import (AdapterCancelled, AdapterCorrupt, AdapterError, AdapterNotFound, AdapterRejected,
                     AdapterUnavailable, SourceUnreachable)
from ..model.families import FAMILIES
from .slots import ADAPTER_MODULES, held_modules
from .sources import WEIGHTS_FILE, host_buffer, weights_from_files
from .weights import AdapterWeights, never_servable

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


MANIFEST_CHECK_S = 2.0  # how long a load with a disk copy waits to hear the store's current version
# How long a load of an adapter on no tier of this node waits for a connection to the store
# before it fails (UNAVAILABLE, naming the store). A fetch that started resumes until its
# deadline instead: that store was up a moment ago.
STORE_CONNECT_S = 2.0


class StoreSource:
    """Adapters from the store, received straight into host memory (pinned on a CUDA node),
    with the node's disk tier in front when one is configured: a load of a version kept on
    disk reads it from there (verified), and falls back to the store if it fails its checks.

    Before any byte, a load asks the store for the adapter's manifest (the catalog's rank,
    targets and sizes): an adapter this node can never serve (a rank over --max-lora-rank,
    modules outside --lora-modules, over --max-adapter-mb) is refused from it, and a store
    that cannot be reached fails the load within STORE_CONNECT_S, naming the store. With
    `direct_reads`, the read plan carries that manifest, and the files are read straight
    from the object store (direct_reads.py), into the same buffer; when the store offers no
    plan or the plan's reads fail (expired, refused, unreachable, bytes that do not match the
    catalog's BLAKE3), it streams the adapter from the store instead."""

    def __init__(self, target: str, model: ModelConfig, max_rank: int, fetch_deadline_s: float = 60.0, *,
                 tls: ClientTLS | None = None, token: str | None = None, max_adapter_bytes: int = 0,
                 pin_memory: bool = False, disk: DiskTier | None = None,
                 max_weight_abs: float = DEFAULT_MAX_WEIGHT_ABS, dtype: torch.dtype = torch.float32,
                 direct_reads: DirectReadSettings | None = None, modules: tuple[str, ...] = ADAPTER_MODULES) -> None:
        """modules: those adapters may target (--lora-modules)."""
        self.target = target
        self.client = AdapterStoreClient(target, tls=tls, token=token)
        self.model = model
        self.max_rank = max_rank
        self.modules = held_modules(modules)
        self.fetch_deadline_s = fetch_deadline_s
        self.max_adapter_bytes = max_adapter_bytes
        self.pin_memory = pin_memory
        self.disk = disk
        self.max_weight_abs = max_weight_abs
        self.dtype = dtype
        self.direct = DirectReader(direct_reads) if direct_reads is not None else None
        # Loads by how their bytes came: "direct" (read plan), "fallback" (its reads failed:
        # streamed), "declined" (no plan offered: streamed). The node's metrics read them.
        self.direct_reads = {"direct": 0, "fallback": 0, "declined": 0}
        self._counts_lock = threading.Lock()

    def load(self, name: str, version: str, cancel: Cancellation | None = None) -> AdapterWeights:
        """The adapter's weights; `cancel` ends the load (AdapterCancelled) when nobody waits
        for it any more."""
        cancel = cancel or Cancellation()
        try:
            disk_failure = ""
            if self.disk is not None:
                try:
                    weights = self._load_from_disk(name, version, cancel)
                except DiskCorrupt as exc:
                    log.warning("%s; fetching it from the store", exc)
                    disk_failure = " (its copy on this node's disk failed its checksum and was deleted)"
                else:
                    if weights is not None:
                        return weights
            return self._load_from_store(name, version, cancel, disk_failure)
        except Cancelled:
            raise AdapterCancelled(f"loading adapter {name!r} was cancelled") from None

    def refusal(self, info: AdapterInfo) -> str | None:
        """Why this node can never serve the catalog entry `info` (None: it can)."""
        return never_servable(info.name, info.rank, info.target_modules, self.max_rank, self.modules,
                              FAMILIES[self.model.family])

    def _allocate(self, holder: list[torch.Tensor]) -> Callable[[int], object]:
        """An allocator for the client and the disk tier, which fill any writable buffer (a
        numpy view); the tensor itself goes to `holder`, to view the weights in (sliced from
        it, they keep its storage, and with it the pinned allocator's bookkeeping)."""
        def allocate(nbytes: int) -> object:
            holder.append(host_buffer(nbytes, self.pin_memory))
            return holder[-1].numpy()
        return allocate

    def _weights(self, manifest: Manifest, buffer: torch.Tensor, offsets: list[int],
                 check_values: bool = True) -> AdapterWeights:
        index = [f.path for f in manifest.files].index(WEIGHTS_FILE)
        start, size = offsets[index], manifest.files[index].size
        return weights_from_files(manifest.info.name, manifest.info.version, manifest.config_json,
                                  buffer[start:start + size], self.model, self.max_rank, check_values,
                                  max_weight_abs=self.max_weight_abs, dtype=self.dtype)

    def _count(self, outcome: str) -> None:
        with self._counts_lock:
            self.direct_reads[outcome] += 1

    def _describe(self, name: str, version: str, cancel: Cancellation,
                  disk_failure: str) -> tuple[Manifest, ReadPlan | None]:
        """The adapter's manifest (and the read plan, with direct reads) before any byte of it,
        refused when this node can never serve it. Fails within STORE_CONNECT_S when the store
        cannot be reached."""
        down = self.client.connect_error(STORE_CONNECT_S, cancel)
        if isinstance(down, StoreTLSRefused):  # this node's TLS settings: no retry helps
            raise AdapterRejected(f"adapter {name!r} from the store at {self.target}: {down.details}")
        if down is not None:
            reason = (down.details or down.code.name).splitlines()[0]
            raise SourceUnreachable(f"adapter {name!r} is on no tier of this node and the adapter store at "
                                    f"{self.target} cannot be reached ({reason}): the node serves it once the "
                                    f"store is back{disk_failure}")
        plan = None
        try:
            if self.direct is not None:
                try:
                    plan = self.client.get_read_plan(name, version, self.fetch_deadline_s, cancel)
                except StoreError as exc:
                    if exc.code != grpc.StatusCode.UNIMPLEMENTED:  # else a store that predates plans
                        raise
            manifest = plan.manifest if plan is not None else self.client.get_manifest(
                name, version, self.fetch_deadline_s, cancel)
        except Cancelled:
            raise
        except StoreError as exc:
            raise self._store_error(name, version, exc, disk_failure) from exc
        refusal = self.refusal(manifest.info)
        if refusal is not None:
            raise AdapterRejected(refusal)
        size = sum(f.size for f in manifest.files)
        if self.max_adapter_bytes and size > self.max_adapter_bytes:
            raise AdapterRejected(f"adapter {name!r} is {size / 1e6:.1f} MB; this node loads adapters up to "
                                  f"{self.max_adapter_bytes / 1e6:.1f} MB (--max-adapter-mb)")
        return manifest, plan

    def _store_error(self, name: str, version: str, exc: StoreError, disk_failure: str) -> AdapterError:
        if exc.code == grpc.StatusCode.NOT_FOUND and self.disk is not None and not version:
            self.disk.remove_name(name)
        error = _ERRORS.get(exc.code, AdapterError)
        return error(f"adapter {name!r} from the store at {self.target}: {exc.code.name}: {exc.details}"
                     f"{_HINTS.get(exc.code, '')}{disk_failure}")

    def _read_direct(self, name: str, version: str, plan: ReadPlan | None,
                     holder: list[torch.Tensor]) -> FetchedAdapter | None:
        """The adapter read by the store's read plan, or None when it must be streamed (no
        plan: a store that predates plans)."""
        if plan is None:
            return None
        if not plan.files:
            self._count("declined")
            log.debug("adapter %s: no read plan (%s); streaming it", name, plan.reason)
            return None
        try:
            fetched = self.direct.read(plan, self._allocate(holder), version)
        except DirectReadFailed as exc:
            holder.clear()
            self._count("fallback")
            log.warning("%s; streaming it from the store instead", exc)
            return None
        self._count("direct")
        return fetched

    def _load_from_store(self, name: str, version: str, cancel: Cancellation, disk_failure: str = "") -> AdapterWeights:
        manifest, plan = self._describe(name, version, cancel, disk_failure)
        holder: list[torch.Tensor] = []
        fetched = self._read_direct(name, version, plan, holder) if self.direct is not None else None
        try:
            if fetched is None:
                fetched = self.client.fetch(name, version, deadline_s=self.fetch_deadline_s,
                                            max_bytes=self.max_adapter_bytes, allocate=self._allocate(holder),
                                            cancel=cancel)
        except AdapterTooLarge as exc:
            raise AdapterRejected(f"adapter {name!r} is {exc.size / 1e6:.1f} MB; this node loads adapters up to "
                                  f"{exc.limit / 1e6:.1f} MB (--max-adapter-mb)") from exc
        except StoreTLSRefused as exc:  # this node's TLS settings: no retry helps
            raise AdapterRejected(f"adapter {name!r} from the store at {self.target}: {exc.details}") from exc
        except Cancelled:
            raise
        except StoreError as exc:
            raise self._store_error(name, version, exc, disk_failure) from exc
        manifest = fetched.manifest
        weights = self._weights(manifest, holder[-1], [fetched.offsets[f.path] for f in manifest.files])
        weights.source_tier = "store"
        if self.disk is not None:  # only what passed validation is kept
            self.disk.put_later(manifest, list(fetched.files.values()))
        return weights

    def _load_from_disk(self, name: str, version: str, cancel: Cancellation) -> AdapterWeights | None:
        """The adapter from the disk tier, or None when the store must be asked. A load of
        the current version ("") asks the store which one that is, and uses the disk copy
        as it is only while the store cannot be reached."""
        entry = self.disk.lookup(name, version)
        if entry is None:
            return None
        if not version:
            try:
                current = self.client.get_manifest(name, timeout_s=MANIFEST_CHECK_S, cancel=cancel).info.version
            except Cancelled:
                raise
            except StoreError as exc:
                if exc.code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    return None  # the fetch reports what the store says
                log.warning("adapter %s: the store at %s is unreachable (%s); loading version %s from this "
                            "node's disk", name, self.target, exc.code.name, entry.version)
            else:
                if current != entry.version:
                    return None
        holder: list[torch.Tensor] = []
        try:
            _, offsets = self.disk.read(entry, self._allocate(holder))
        except FileNotFoundError:  # evicted meanwhile
            return None
        log.info("adapter %s@%s loaded from this node's disk", name, entry.version)
        # Only validated adapters are written to disk, and the read proved these bytes are
        # those: the value scan is not repeated (names, shapes and dtypes still are).
        weights = self._weights(entry.manifest, holder[-1], offsets, check_values=False)
        weights.source_tier = "disk"
        return weights

    def catalog(self) -> list[tuple[str, int]]:
        """The store's adapters this node can serve: valid, and not refused by `refusal`
        (raises AdapterError when the store cannot be reached)."""
        try:
            return [(a.name, a.updated_at) for a in self.client.list_adapters()
                    if a.valid and self.refusal(a) is None]
        except StoreError as exc:
            error = _ERRORS.get(exc.code, AdapterError)
            raise error(f"listing the adapter store at {self.target}: {exc.code.name}: {exc.details}"
                        f"{_HINTS.get(exc.code, '')}") from exc

    def disk_copies(self) -> list[tuple[str, str, int]]:
        """(name, version, rank from its manifest) of the adapters in the node's disk tier."""
        return ([(e.name, e.version, e.manifest.info.rank) for e in self.disk.entries()]
                if self.disk is not None else [])

    def close(self) -> None:
        self.client.close()
        if self.direct is not None:
            self.direct.close()


class CatalogWatcher:
    """Follows the store's catalog: a new version or a deletion reaches the adapter manager
    (through `post`, which runs the change on the engine thread)."""

    def __init__(self, client: AdapterStoreClient, post: Callable[[Callable[[], None]], object],
                 on_update: Callable[[str, str], None], on_delete: Callable[[str], None],
                 disk: DiskTier | None = None) -> None:
        self.client = client
        self.disk = disk  # a deleted adapter's disk copy goes too
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
            if self.disk is not None:
                self.disk.remove_name(name)
            self.post(lambda: self.on_delete(name))
