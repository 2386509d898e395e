"""The catalog: what the bucket holds under the prefix, validated, and how it changes.

The bucket is the source of truth and anything may write to it (aws cli, boto3, training
jobs), so there is no registration: a poller lists the prefix every `poll_interval_s`,
groups keys `<prefix><name>/<file>` by name and, for each name whose objects (ETags and
sizes) changed, downloads them into the disk cache and validates them. A change is taken once it
has been stable for `settle_s` (so an upload in progress is not published half-done). The
version is content: the first 16 hex digits of the adapter's sha256 (over the files' sha256), or
for an adapter refused before download, of its objects' ETags.
Changes are pushed to subscribers as ADDED / UPDATED / DELETED events.
"""
from __future__ import annotations

import hashlib
import logging
import mmap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from .cache import Blob, BlobReader, DiskCache
from .metrics import StoreMetrics
from lora_common.names import CONFIG_FILE, WEIGHTS_FILE, split_key
from .records import (ADDED, DELETED, UPDATED, AdapterInfo, CatalogEvent, FileEntry, Manifest, adapter_digest,
                      version_of)
from .s3 import ObjectInfo, S3Error, S3Store
from lora_common.validation import (DEFAULT_MAX_CONFIG_BYTES, DEFAULT_MAX_HEADER_BYTES, DEFAULT_MAX_RANK,
                                    DEFAULT_MAX_WEIGHT_ABS, AdapterInvalid,
                         LoraConfig, parse_adapter_config, parse_safetensors_header, validate_weights)

log = logging.getLogger(__name__)

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
Subscriber = Callable[[CatalogEvent], None]


@dataclass(frozen=True)
class Limits:
    max_adapter_bytes: int = 4 << 30
    max_config_bytes: int = DEFAULT_MAX_CONFIG_BYTES
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    max_rank: int = DEFAULT_MAX_RANK
    max_weight_abs: float = DEFAULT_MAX_WEIGHT_ABS  # 0: no bound (the overflow probe still runs)


@dataclass(frozen=True)
class StoredFile:
    path: str
    obj: ObjectInfo
    sha256: str
    blake3: str = ""


@dataclass(frozen=True)
class CatalogEntry:
    info: AdapterInfo
    fingerprint: tuple
    files: tuple[StoredFile, ...] = ()  # manifest order (config, weights); empty when refused early
    config_json: str = ""
    adapter_sha256: str = ""

    @property
    def name(self) -> str:
        return self.info.name

    def manifest(self) -> Manifest:
        return Manifest(self.info, self.config_json,
                        tuple(FileEntry(f.path, f.obj.size, f.sha256, f.blake3) for f in self.files), self.adapter_sha256)


def _fingerprint(objs: dict[str, ObjectInfo]) -> tuple:
    return tuple(sorted((path, o.etag, o.size) for path, o in objs.items()))


def _short_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class Catalog:
    def __init__(self, s3: S3Store, cache: DiskCache, prefix: str, *, poll_interval_s: float = 5.0,
                 limits: Limits = Limits(), workers: int = 2, download_timeout_s: float = 300.0,
                 settle_s: float = 1.0, metrics: StoreMetrics | None = None) -> None:
        self.s3, self.cache, self.prefix = s3, cache, prefix
        self.poll_interval_s = poll_interval_s
        self.limits = limits
        self.download_timeout_s = download_timeout_s
        self.settle_s = settle_s
        self.metrics = metrics or StoreMetrics()
        self.ready = threading.Event()  # set after the first complete listing
        self._entries: dict[str, CatalogEntry] = {}
        self._lock = threading.RLock()
        self._subscribers: list[Subscriber] = []
        self._ignored: set[str] = set()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="catalog-validate")
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_error: str = ""
        self._passes = 0  # completed listing passes, for callers waiting on a fresh one
        self._passed = threading.Condition()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="catalog-poll", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(30)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def poke(self) -> None:
        """Polls now instead of at the end of the interval."""
        self._wake.set()

    def wait_fresh_pass(self, timeout: float) -> bool:
        """Polls now and waits until a pass that started after this call has ended, so an
        adapter pushed a moment ago is found without waiting for the poll interval."""
        with self._passed:
            target = self._passes + 2  # the pass under way may have listed before the push
        self.poke()
        deadline = time.monotonic() + timeout
        with self._passed:
            while self._passes < target:
                left = deadline - time.monotonic()
                if left <= 0 or self._stop.is_set():
                    return False
                self._passed.wait(left)
                self.poke()
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.refresh()
                self.last_error = ""
            except Exception as exc:  # S3 down: keep the catalog as it is and try again
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.warning("catalog: listing %s failed: %s", self.s3.describe(), self.last_error)
            with self._passed:
                self._passes += 1
                self._passed.notify_all()
            self._wake.wait(max(0.0, self.poll_interval_s - (time.monotonic() - started)))
            self._wake.clear()

    # ------------------------------------------------------------------ polling

    def refresh(self) -> list[CatalogEvent]:
        """One pass: list, validate what changed, apply and publish the changes."""
        listed = self._list()
        with self._lock:
            known = dict(self._entries)
        changed = {name: objs for name, objs in listed.items()
                   if name not in known or known[name].fingerprint != _fingerprint(objs)}
        gone = set(known) - set(listed)
        if (changed or gone) and self.settle_s > 0:
            # An upload in progress (weights up, config not yet) must not be published as a
            # half-new adapter: only what is unchanged a moment later is taken this round.
            self._stop.wait(self.settle_s)
            again = self._list()
            changed = {name: objs for name, objs in changed.items()
                       if name in again and _fingerprint(again[name]) == _fingerprint(objs)}
            gone -= set(again)
        futures = {name: self._pool.submit(self._build, name, objs) for name, objs in sorted(changed.items())}
        built: dict[str, CatalogEntry] = {}
        for name, future in futures.items():
            try:
                built[name] = future.result()
            except S3Error as exc:  # transient: retried at the next poll
                log.warning("catalog: %s not (re)validated this time: %s", name, exc)
        events: list[CatalogEvent] = []
        with self._lock:
            for name in sorted(gone & set(self._entries)):
                old = self._entries.pop(name)
                events.append(CatalogEvent(DELETED, old.info, old.info.version))
            for name, entry in sorted(built.items()):
                old = self._entries.get(name)
                self._entries[name] = entry
                if old is None:
                    events.append(CatalogEvent(ADDED, entry.info))
                elif old.info != entry.info:
                    events.append(CatalogEvent(UPDATED, entry.info, old.info.version))
            for event in events:
                self._log_event(event)
                self._publish(event)
            valid = sum(1 for e in self._entries.values() if e.info.valid)
            self.metrics.set_catalog(valid, len(self._entries) - valid)
        self.ready.set()
        return events

    def _list(self) -> dict[str, dict[str, ObjectInfo]]:
        grouped: dict[str, dict[str, ObjectInfo]] = {}
        for obj in self.s3.list(self.prefix):
            parts = split_key(self.prefix, obj.key)
            if parts is None:
                if obj.key not in self._ignored and len(self._ignored) < 10000:
                    self._ignored.add(obj.key)
                    log.warning("catalog: ignoring key %r (not <prefix><name>/<file> with a safe name)",
                                obj.key[:300])
                continue
            name, filename = parts
            if filename in (CONFIG_FILE, WEIGHTS_FILE) or filename.endswith(PICKLE_SUFFIXES):
                grouped.setdefault(name, {})[filename] = obj
        return grouped

    @staticmethod
    def _log_event(event: CatalogEvent) -> None:
        info = event.adapter
        assert info is not None
        state = "valid" if info.valid else f"INVALID: {info.invalid_reason}"
        log.info("catalog: %s %s version %s (%s)", event.kind.lower(), info.name, info.version, state)

    # ------------------------------------------------------------------ validation

    def _build(self, name: str, objs: dict[str, ObjectInfo]) -> CatalogEntry:
        fingerprint = _fingerprint(objs)
        updated = int(max(o.last_modified for o in objs.values()))
        size = sum(o.size for f, o in objs.items() if f in (CONFIG_FILE, WEIGHTS_FILE))
        config_obj, weights_obj = objs.get(CONFIG_FILE), objs.get(WEIGHTS_FILE)
        parsed: LoraConfig | None = None

        def refused(reason: str, files: tuple[StoredFile, ...] = (), config_json: str = "") -> CatalogEntry:
            info = AdapterInfo(name, _short_hash(repr(fingerprint)), parsed.r if parsed else 0,
                               parsed.lora_alpha if parsed else 0.0, parsed.use_rslora if parsed else False,
                               parsed.target_modules if parsed else (),
                               parsed.base_model_name_or_path if parsed else "", size, False, reason, updated)
            return CatalogEntry(info, fingerprint, files, config_json, "")

        if weights_obj is None:
            pickles = sorted(f for f in objs if f.endswith(PICKLE_SUFFIXES))
            if pickles:
                return refused(f"no {WEIGHTS_FILE}; {', '.join(pickles)} is a pickle file, which is never "
                               "loaded (save the adapter with safe_serialization=True)")
            return refused(f"missing {WEIGHTS_FILE}")
        if config_obj is None:
            return refused(f"missing {CONFIG_FILE}")
        if config_obj.size > self.limits.max_config_bytes:
            return refused(f"{CONFIG_FILE} is {config_obj.size} bytes; the limit is {self.limits.max_config_bytes}")
        if weights_obj.size > self.limits.max_adapter_bytes:
            return refused(f"{WEIGHTS_FILE} is {weights_obj.size} bytes; the limit is {self.limits.max_adapter_bytes}")
        deadline = time.monotonic() + self.download_timeout_s
        config_blob = self.blob(config_obj, deadline)
        config_bytes = config_blob.path.read_bytes()
        config_file = StoredFile(CONFIG_FILE, config_obj, config_blob.sha256, config_blob.blake3)
        config_json = config_bytes.decode("utf-8", "replace")
        try:
            parsed = parse_adapter_config(config_bytes, self.limits.max_config_bytes, self.limits.max_rank)
        except AdapterInvalid as exc:
            return refused(f"{CONFIG_FILE}: {exc}", (config_file,), config_json)
        weights_blob = self.blob(weights_obj, deadline)
        weights_file = StoredFile(WEIGHTS_FILE, weights_obj, weights_blob.sha256, weights_blob.blake3)
        try:
            spec = self._validate_weights(parsed, weights_blob)
        except AdapterInvalid as exc:
            return refused(f"{WEIGHTS_FILE}: {exc}", (config_file, weights_file), config_json)
        digest = adapter_digest([config_blob.sha256, weights_blob.sha256])
        info = AdapterInfo(name, version_of(digest), parsed.r, parsed.lora_alpha, parsed.use_rslora, spec.target_modules,
                           parsed.base_model_name_or_path, size, True, "", updated)
        return CatalogEntry(info, fingerprint, (config_file, weights_file), config_json, digest)

    def _validate_weights(self, config: LoraConfig, blob: Blob):
        if blob.size == 0:
            raise AdapterInvalid("the file is empty")
        with open(blob.path, "rb") as f:
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            header = parse_safetensors_header(data, max_header_bytes=self.limits.max_header_bytes)
            return validate_weights(config, header, data, self.limits.max_weight_abs)
        finally:
            try:
                data.close()
            except BufferError:  # a view is still referenced (by a traceback): GC closes it
                pass

    def blob(self, obj: ObjectInfo, deadline: float | None) -> Blob:
        """The object's bytes in the disk cache, downloaded once if absent."""
        def fill(out) -> tuple[str, int]:
            result = self.s3.download(obj, out, deadline)
            self.metrics.s3_bytes.inc(result.size)
            return result.sha256, result.size

        return self.cache.get(f"{self.s3.bucket}/{obj.key}#{obj.etag}", fill)

    def open_file(self, file: StoredFile, deadline: float | None) -> BlobReader:
        """A reader of a listed file: from the disk cache, or streaming from a download
        (shared with concurrent fetches) that is checked, when it completes, against the
        BLAKE3 recorded at validation (its sha256 where none was): that proves every byte,
        so the download computes neither the ETag's MD5 nor a sha256 the check does not use."""
        def fill(out) -> tuple[str, int]:
            result = self.s3.download(file.obj, out, deadline, caller_checks="blake3" if file.blake3 else "sha256")
            self.metrics.s3_bytes.inc(result.size)
            return result.sha256, result.size

        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        return self.cache.open(f"{self.s3.bucket}/{file.obj.key}#{file.obj.etag}", fill, file.sha256, timeout,
                               expected_blake3=file.blake3)

    # ------------------------------------------------------------------ queries

    def get(self, name: str) -> CatalogEntry | None:
        with self._lock:
            return self._entries.get(name)

    def page(self, after: str, limit: int) -> tuple[list[AdapterInfo], str]:
        """Up to `limit` adapters named after `after`, sorted; and the last name if more follow."""
        with self._lock:
            names = sorted(n for n in self._entries if n > after)
            chosen = [self._entries[n].info for n in names[:limit]]
        return chosen, (chosen[-1].name if len(names) > limit else "")

    def snapshot(self) -> list[AdapterInfo]:
        with self._lock:
            return [self._entries[n].info for n in sorted(self._entries)]

    def subscribe(self, callback: Subscriber) -> tuple[list[AdapterInfo], Callable[[], None]]:
        """The current catalog and, atomically with it, a subscription to later changes.
        Callbacks run on the poll thread and must not block."""
        with self._lock:
            self._subscribers.append(callback)
            snapshot = [self._entries[n].info for n in sorted(self._entries)]

        def unsubscribe() -> None:
            with self._lock:
                if callback in self._subscribers:
                    self._subscribers.remove(callback)

        return snapshot, unsubscribe

    def _publish(self, event: CatalogEvent) -> None:
        for callback in list(self._subscribers):
            try:
                callback(event)
            except Exception:
                log.exception("catalog: dropping a subscriber that failed")
                self._subscribers.remove(callback)
