"""Typed client of the adapter store, as the inference node uses it.

`fetch()` writes each shard into one preallocated buffer, checks every file against the
manifest's BLAKE3 (its sha256 when the manifest has none) and the whole adapter's sha256
against the manifest, and the shards' own digests (BLAKE3, or sha256 from an older store)
before resuming after them; when the
stream breaks it resumes from the last verified byte (with backoff) until its deadline.
`watch()` yields catalog events and, with reconnect=True, survives store restarts by
turning the fresh snapshot into the difference from what it had already reported. A
`Cancellation` ends a fetch (or a unary call) from another thread at once: its call in
flight is cancelled and its backoff wait cut short.
"""
from __future__ import annotations

import hashlib
import logging
import random
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator, Sequence

import blake3
import grpc

from lora.v1 import adapter_store_pb2 as pb
from lora.v1 import adapter_store_pb2_grpc as pb_grpc

from lora_common.auth import bearer_metadata
from .records import (ADDED, DELETED, SYNCED, UPDATED, AdapterInfo, CatalogEvent, FetchedAdapter, FileEntry,
                      FileRead, Manifest, ReadPlan, adapter_digest, file_offsets, version_of)
from .shard_wire import decode_shard
from lora_common.tls import ClientTLS, open_channel

# The client's data model, which callers (the node) take from here rather than the store's
# own modules.
__all__ = ["ADDED", "DELETED", "SYNCED", "UPDATED", "AdapterInfo", "AdapterStoreClient", "AdapterTooLarge",
           "CatalogEvent", "Cancellation", "Cancelled", "FetchedAdapter", "FileEntry", "FileRead", "Manifest",
           "ReadPlan", "StoreError", "StoreTLSRefused", "adapter_digest", "file_offsets", "version_of"]

log = logging.getLogger(__name__)

# Transport trouble and a store that is restarting or overloaded; anything else is final.
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED,
             grpc.StatusCode.INTERNAL)
MAX_RECEIVE_BYTES = 64 << 20
Allocate = Callable[[int], Any]  # nbytes -> a writable buffer (bytearray, a pinned tensor's numpy view...)


class StoreError(Exception):
    """A failed store call: `code` is the gRPC status (DATA_LOSS for checksum mismatches)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details

    @classmethod
    def from_rpc(cls, exc: grpc.RpcError) -> "StoreError":
        return cls(exc.code(), exc.details() or "")


# How a TLS handshake the store refuses looks from here: this client failing to verify the
# store ("Tls handshake failed"), or, when the store refuses this client's certificate (none,
# or one its client CA did not sign), the socket closed during the handshake.
_HANDSHAKE_FAILED = "Tls handshake failed"
_SOCKET_CLOSED = "Socket closed"
TLS_REFUSALS_BEFORE_GIVING_UP = 3  # a socket closed before any reply, over TLS, in a row


class StoreTLSRefused(StoreError):
    """The TLS handshake with the store keeps failing before any reply: this client's TLS
    settings do not fit the store's, and retrying until the fetch deadline would not help."""

    def __init__(self, details: str, flag: str) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE,
                         f"the TLS handshake with the store failed ({details}); check {flag}-ca, and "
                         f"{flag}-cert/{flag}-key if the store requires client certificates")


class AdapterTooLarge(StoreError):
    """The manifest lists more bytes than the caller accepts (checked before downloading)."""

    def __init__(self, name: str, size: int, limit: int) -> None:
        super().__init__(grpc.StatusCode.FAILED_PRECONDITION,
                         f"adapter {name!r} is {size} bytes; the limit is {limit}")
        self.size, self.limit = size, limit


class Cancelled(StoreError):
    """The call was cancelled by its Cancellation (its request ended, the node is stopping)."""

    def __init__(self) -> None:
        super().__init__(grpc.StatusCode.CANCELLED, "cancelled")


class Cancellation:
    """Ends calls from another thread: `cancel()` cancels every call tracked now or later and
    wakes a backoff wait, so a fetch ends at once rather than at its deadline."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._calls: set[grpc.Future] = set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def cancel(self) -> None:
        with self._lock:
            self._event.set()
            calls = list(self._calls)
        for call in calls:
            call.cancel()

    def wait(self, seconds: float) -> bool:
        """Sleeps `seconds` unless cancelled first; True when cancelled."""
        return self._event.wait(seconds)

    @contextmanager
    def track(self, call: grpc.Future) -> Iterator[None]:
        with self._lock:
            self._calls.add(call)
        if self._event.is_set():
            call.cancel()
        try:
            yield
        finally:
            with self._lock:
                self._calls.discard(call)


class _Backoff:
    def __init__(self, base_s: float = 0.1, cap_s: float = 2.0) -> None:
        self.base_s, self.cap_s, self.attempt = base_s, cap_s, 0

    def delay(self) -> float:
        d = random.uniform(self.base_s, min(self.cap_s, self.base_s * 2 ** self.attempt))
        self.attempt += 1
        return d


class AdapterStoreClient:
    def __init__(self, target: str, *, timeout_s: float = 10.0, max_shard_bytes: int = 0,
                 channel: grpc.Channel | None = None, credentials: grpc.ChannelCredentials | None = None,
                 tls: ClientTLS | None = None, token: str | None = None) -> None:
        """`target` is HOST:PORT; `timeout_s` bounds the unary calls. `tls` (or ready-made
        `credentials`) secures the channel; `token` goes out as a bearer token on every call."""
        options = [("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),
                   # Reconnect within seconds once the store is back: gRPC's default backoff
                   # between connection attempts grows to 120 s over an outage, longer than a
                   # fetch's deadline (tests/store/test_client_reconnect.py). Fetches and the
                   # catalog watch keep their own backoff on top.
                   ("grpc.initial_reconnect_backoff_ms", 250),
                   ("grpc.max_reconnect_backoff_ms", 2000)]
        if channel is None:
            channel = (grpc.secure_channel(target, credentials, options=options) if credentials
                       else open_channel(target, tls, options))
        self.target = target
        self.tls = tls if tls is not None and tls.on else None
        self.channel = channel
        self.stub = pb_grpc.AdapterStoreStub(channel)
        # Shards come as (header, data view of the received message): see shard_wire.
        self._fetch_stream = channel.unary_stream(
            f"/{pb.DESCRIPTOR.services_by_name['AdapterStore'].full_name}/FetchAdapter",
            request_serializer=pb.FetchAdapterRequest.SerializeToString, response_deserializer=decode_shard)
        self.metadata = bearer_metadata(token)
        self.timeout_s = timeout_s
        self.max_shard_bytes = max_shard_bytes

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "AdapterStoreClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ catalog

    def list_adapters(self, page_size: int = 0) -> list[AdapterInfo]:
        """The whole catalog (valid and invalid adapters), sorted by name."""
        result: list[AdapterInfo] = []
        token = ""
        while True:
            page = self._unary(self.stub.ListAdapters,
                               pb.ListStoreAdaptersRequest(page_size=page_size, page_token=token))
            result.extend(AdapterInfo.from_proto(a) for a in page.adapters)
            token = page.next_page_token
            if not token:
                return result

    def _unary(self, rpc: Callable[..., Any], request: Any, timeout_s: float | None = None,
               cancel: Cancellation | None = None) -> Any:
        """One unary call with this client's deadline and metadata; its failure as StoreError."""
        try:
            if cancel is None:
                return rpc(request, timeout=timeout_s or self.timeout_s, metadata=self.metadata)
            call = rpc.future(request, timeout=timeout_s or self.timeout_s, metadata=self.metadata)
            with cancel.track(call):
                return call.result()
        except grpc.FutureCancelledError:
            raise Cancelled() from None
        except grpc.RpcError as exc:
            if cancel is not None and cancel.cancelled:
                raise Cancelled() from None
            raise StoreError.from_rpc(exc) from None

    def get_manifest(self, name: str, version: str = "", timeout_s: float | None = None,
                     cancel: Cancellation | None = None) -> Manifest:
        return Manifest.from_proto(self._unary(self.stub.GetManifest, pb.GetManifestRequest(name=name, version=version),
                                               timeout_s, cancel))

    def get_read_plan(self, name: str, version: str = "", timeout_s: float | None = None,
                      cancel: Cancellation | None = None) -> ReadPlan:
        """Presigned GETs of the adapter's files (see GetReadPlan); a plan without files when
        the store offers none. A store that predates the call raises StoreError(UNIMPLEMENTED)."""
        return ReadPlan.from_proto(self._unary(self.stub.GetReadPlan, pb.GetReadPlanRequest(name=name, version=version),
                                               timeout_s, cancel))

    def reachable(self, timeout_s: float, cancel: Cancellation | None = None) -> bool:
        """Whether a connection to the store is up, or comes up within `timeout_s` (the
        channel connects if idle). A store that is down answers False in `timeout_s` at most,
        where a call would wait for the transport's own connect timeout."""
        ready = grpc.channel_ready_future(self.channel)
        try:
            with cancel.track(ready) if cancel is not None else nullcontext():
                ready.result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            ready.cancel()  # stops watching the channel
            return False
        except grpc.FutureCancelledError:
            raise Cancelled() from None
        return True

    def connect_error(self, timeout_s: float, cancel: Cancellation | None = None) -> StoreError | None:
        """None when the store is `reachable` within `timeout_s`; else why not, as a call made
        now fails: the transport's reason (refused, unresolvable...), or StoreTLSRefused for
        a TLS handshake that fails (the channel kept trying meanwhile, so one failure is no
        passing restart)."""
        if self.reachable(timeout_s, cancel):
            return None
        try:
            self._unary(self.stub.ListAdapters, pb.ListStoreAdaptersRequest(page_size=1), 0.5, cancel)
        except Cancelled:
            raise
        except StoreError as exc:
            if self._tls_refusal(exc):
                return StoreTLSRefused(exc.details, self.tls.flag)
            if exc.code == grpc.StatusCode.DEADLINE_EXCEEDED:  # a host that takes the connection, then nothing
                return StoreError(grpc.StatusCode.UNAVAILABLE, f"no connection within {timeout_s:g}s")
            return exc
        return None  # it came up meanwhile

    def watch(self, reconnect: bool = True, stop: threading.Event | None = None) -> Iterator[CatalogEvent]:
        """Catalog events: ADDED for each adapter, then SYNCED, then changes as they happen.

        With reconnect=True a broken stream is reopened with backoff and the new snapshot is
        turned into the changes since (each change is reported once; SYNCED follows each
        resync). Setting `stop`, or closing the generator, ends it.
        """
        return _watch_events(self, reconnect, stop)

    # ------------------------------------------------------------------ fetch

    def fetch(self, name: str, version: str = "", deadline_s: float = 120.0, max_bytes: int = 0,
              allocate: Allocate = bytearray, cancel: Cancellation | None = None) -> FetchedAdapter:
        """The adapter's files, verified. Resumes broken streams until `deadline_s` has
        passed, then raises StoreError(UNAVAILABLE). A checksum mismatch raises
        StoreError(DATA_LOSS); NOT_FOUND, INVALID_ARGUMENT, FAILED_PRECONDITION,
        UNAUTHENTICATED are final, and so is a TLS handshake the store keeps refusing
        (StoreTLSRefused: its own verification failing at once, a socket closed before any
        reply TLS_REFUSALS_BEFORE_GIVING_UP times in a row). An adapter over `max_bytes` (when > 0) raises
        AdapterTooLarge before any buffer is allocated. `allocate(nbytes)` gives the one
        writable buffer the files are received into (pinned memory on a GPU node). `cancel`
        ends it at once with Cancelled."""
        state = _FetchState(name, version, max_bytes, allocate)
        try:
            return self._fetch(state, deadline_s, cancel or Cancellation())
        finally:
            state.close()

    def _fetch(self, state: "_FetchState", deadline_s: float, cancel: Cancellation) -> FetchedAdapter:
        name, version = state.name, state.pinned_version
        deadline = time.monotonic() + deadline_s
        backoff = _Backoff()
        refusals = 0  # TLS handshakes refused in a row (see StoreTLSRefused)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StoreError(grpc.StatusCode.UNAVAILABLE,
                                 f"fetching {name!r} did not finish in {deadline_s:.1f}s ({state.progress()})")
            request = pb.FetchAdapterRequest(name=name, version=state.pinned_version, start_file=state.file_index,
                                             start_offset=state.offset, max_shard_bytes=self.max_shard_bytes,
                                             verify=state.verify, blake3_shards=True)
            call = self._fetch_stream(request, timeout=remaining, metadata=self.metadata)
            try:
                try:
                    with cancel.track(call):
                        for shard, data in call:
                            state.accept(shard, data)
                            backoff.attempt = refusals = 0
                            if state.done:
                                return state.result()
                    raise StoreError(grpc.StatusCode.UNAVAILABLE, "the stream ended before the last shard")
                except FileMismatch as exc:
                    self._rewind(state, exc)
                    continue
            except grpc.RpcError as exc:
                if cancel.cancelled:
                    raise Cancelled() from None
                code = exc.code()
                if code == grpc.StatusCode.NOT_FOUND and state.pinned_version and not version:
                    log.info("fetch %s: version %s was replaced; starting over", name, state.pinned_version)
                    state.restart(version)
                    continue
                if code not in RETRYABLE and code != grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise StoreError.from_rpc(exc) from None
                error = StoreError.from_rpc(exc)
                refusals = refusals + 1 if self._tls_refusal(error) else 0
                if refusals and (_HANDSHAKE_FAILED in error.details
                                 or refusals >= TLS_REFUSALS_BEFORE_GIVING_UP):
                    raise StoreTLSRefused(error.details, self.tls.flag) from None
            except StoreError as exc:
                if exc.code != grpc.StatusCode.UNAVAILABLE:
                    raise
                error = exc
            finally:
                call.cancel()
            try:
                state.settle()  # resume only from verified bytes
            except FileMismatch as exc:
                self._rewind(state, exc)
            delay = backoff.delay()
            if time.monotonic() + delay >= deadline:
                raise StoreError(grpc.StatusCode.UNAVAILABLE, f"fetching {name!r} gave up at its deadline "
                                 f"({state.progress()}): {error.details}") from None
            log.warning("fetch %s: stream broke at %s (%s); resuming in %.2fs", name, state.progress(),
                        error, delay)
            if cancel.wait(delay):
                raise Cancelled()

    @staticmethod
    def _rewind(state: "_FetchState", mismatch: FileMismatch) -> None:
        """Bytes that fail their checksum are fetched once more from a store asked to verify
        its copy first (a blob that rotted on its disk is dropped and downloaded again)."""
        if state.verify:
            raise mismatch
        log.warning("fetch %s: %s; fetching file %d again, verified by the store", state.name,
                    mismatch.details, mismatch.file_index)
        state.rewind(mismatch.file_index)

    def _tls_refusal(self, error: StoreError) -> bool:
        """Whether a failed call looks like the store refusing this client's TLS handshake."""
        return (self.tls is not None and error.code == grpc.StatusCode.UNAVAILABLE
                and (_HANDSHAKE_FAILED in error.details or _SOCKET_CLOSED in error.details))


class FileMismatch(StoreError):
    """A file's bytes (or a shard's) do not hash to what the store said: DATA_LOSS, unless a
    retry that asks the store to verify its copy (FetchAdapterRequest.verify) heals it."""

    def __init__(self, details: str, file_index: int) -> None:
        super().__init__(grpc.StatusCode.DATA_LOSS, details)
        self.file_index = file_index


def file_hasher(entry: FileEntry) -> "hashlib._Hash | blake3.blake3":
    """The digest a file is checked with: BLAKE3 (several times cheaper than sha256, and as
    strong) when the manifest lists one, else its sha256."""
    return blake3.blake3() if entry.blake3 else hashlib.sha256()


def expected_digest(entry: FileEntry) -> tuple[str, str]:
    """(algorithm, hex digest) that file_hasher's result must match."""
    return ("blake3", entry.blake3) if entry.blake3 else ("sha256", entry.sha256)


def shard_digest(shard: pb.AdapterShard) -> tuple[str, str]:
    """(algorithm, hex digest) of a shard's data as the store sent it: BLAKE3 when asked
    for (FetchAdapterRequest.blake3_shards), sha256 from a store that predates it."""
    return ("blake3", shard.blake3) if shard.blake3 else ("sha256", shard.sha256)


class _Verifier:
    """Hashes each file as its bytes arrive, on a worker thread (hashlib and blake3 release the GIL), so
    the receiving thread only copies bytes into place. The shards' own digests are checked
    when they are what protects the bytes: before a broken stream is resumed after them (a
    file's digest covers its shards once the file is whole)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._files = ThreadPoolExecutor(1, thread_name_prefix="fetch-sha256")
        self._pending: deque[Future] = deque()
        self._shards: list[tuple[memoryview, str, str, int, int]] = []  # (bytes, algorithm, hex, file, offset)

    def _submit(self, fn: Callable[..., None], *args: object) -> None:
        self._pending.append(self._files.submit(fn, *args))
        while self._pending and self._pending[0].done():
            self._pending.popleft().result()  # raises what a check found

    def shard(self, data: memoryview, algorithm: str, digest: str, file_index: int, offset: int) -> None:
        self._shards.append((data, algorithm, digest, file_index, offset))

    def file_bytes(self, digest: "hashlib._Hash | blake3.blake3", data: memoryview) -> None:
        self._submit(digest.update, data)

    def file_end(self, digest: "hashlib._Hash | blake3.blake3", entry: FileEntry, file_index: int) -> None:
        self._shards.clear()  # the file's digest vouches for them

        def check() -> None:
            algorithm, expected = expected_digest(entry)
            if digest.hexdigest() != expected:
                raise FileMismatch(f"adapter {self.name!r}: {entry.path} has {algorithm} {digest.hexdigest()}, "
                                   f"the manifest says {expected}", file_index)
        self._submit(check)

    def drain(self) -> None:
        """Waits for the file checks submitted so far; raises the first mismatch."""
        while self._pending:
            self._pending.popleft().result()

    def settle(self) -> None:
        """Every byte received so far is verified: whole files by their digest, the part of a
        file received before a stream broke by its shards' digests."""
        self.drain()
        for data, algorithm, digest, file_index, offset in self._shards:
            hasher = blake3.blake3 if algorithm == "blake3" else hashlib.sha256
            if hasher(data).hexdigest() != digest:
                raise FileMismatch(f"adapter {self.name!r}: {algorithm} mismatch in the shard of file "
                                   f"{file_index} at offset {offset}", file_index)
        self._shards.clear()

    def quiesce(self) -> None:
        """Waits for the checks in flight, whatever they find (before bytes are received again)."""
        for future in self._pending:
            future.exception()
        self._pending.clear()
        self._shards.clear()

    def close(self) -> None:
        self._files.shutdown(wait=False, cancel_futures=True)


class _FetchState:
    """The bytes received so far, their checks in flight, and where to resume.

    The whole adapter lands in one buffer sized from the manifest (`allocate`), each shard
    copied straight to its place; the files are views of it."""

    def __init__(self, name: str, version: str, max_bytes: int = 0, allocate: Allocate = bytearray) -> None:
        self.name = name
        self.max_bytes = max_bytes
        self.allocate = allocate
        self.verifier: _Verifier | None = None
        self.restart(version)

    def restart(self, version: str) -> None:
        """Forgets what was received (also when the version it had pinned was replaced)."""
        if self.verifier is not None:
            self.verifier.close()
        self.pinned_version = version
        self.manifest: Manifest | None = None
        self.buffer: Any = None
        self.files: list[memoryview] = []
        self.offsets: list[int] = []
        self.file_index = 0
        self.offset = 0
        self.done = False
        self.verify = False  # ask the store to verify its copy (after a checksum failure)
        self.verifier = _Verifier(self.name)
        self._file_digest = None  # of the file being received, from its first byte

    def progress(self) -> str:
        return f"file {self.file_index} byte {self.offset}"

    def _loss(self, details: str) -> StoreError:
        return StoreError(grpc.StatusCode.DATA_LOSS, f"adapter {self.name!r}: {details}")

    def accept(self, shard: pb.AdapterShard, data: bytes | memoryview | None = None) -> None:
        """Places one shard; `data` is its data when it came apart from `shard` (decode_shard)."""
        if shard.HasField("manifest"):
            manifest = Manifest.from_proto(shard.manifest)
            if self.manifest is None:
                self._start(manifest)
            elif manifest != self.manifest:
                raise self._loss("the manifest changed while resuming")
        if self.manifest is None:
            raise self._loss("the first shard carries no manifest")
        files = self.manifest.files
        if shard.file_index != self.file_index or shard.offset != self.offset:
            raise self._loss(f"shard at file {shard.file_index} offset {shard.offset}, expected "
                             f"{self.progress()}")
        entry = files[self.file_index]
        if data is None:
            data = shard.data  # each read of a bytes field is a copy: read it once
        end = shard.offset + len(data)
        if shard.path != entry.path or shard.file_size != entry.size or end > entry.size:
            raise self._loss(f"shard {shard.path}@{shard.offset}+{len(data)} does not fit "
                             f"{entry.path} ({entry.size} bytes)")
        placed = self.files[self.file_index][shard.offset:end]
        placed[:] = data
        if self._file_digest is None:
            self._file_digest = file_hasher(entry)
        self.verifier.shard(placed, *shard_digest(shard), self.file_index, shard.offset)
        self.verifier.file_bytes(self._file_digest, placed)
        self.offset = end
        if end == entry.size:
            self.verifier.file_end(self._file_digest, entry, self.file_index)
            self._file_digest = None
            if self.file_index + 1 < len(files):
                self.file_index, self.offset = self.file_index + 1, 0
            elif not shard.last:
                raise self._loss("the last file ended without the last shard")
        if shard.last:
            if self.file_index != len(files) - 1 or self.offset != files[-1].size:
                raise self._loss("the last shard came before all the bytes")
            whole = adapter_digest(f.sha256 for f in files)
            if shard.adapter_sha256 != self.manifest.adapter_sha256 or whole != self.manifest.adapter_sha256:
                raise self._loss(f"adapter sha256 {shard.adapter_sha256} does not match the manifest's "
                                 f"{self.manifest.adapter_sha256}")
            self.verifier.drain()
            self.done = True

    def settle(self) -> None:
        """Before resuming: every byte received so far is verified (or FileMismatch is raised)."""
        self.verifier.settle()

    def rewind(self, file_index: int) -> None:
        """Receives file `file_index` and those after it again, from a store asked to verify."""
        self.verifier.quiesce()
        self.file_index, self.offset = file_index, 0
        self._file_digest = None
        self.verify = True

    def close(self) -> None:
        self.verifier.close()

    def _start(self, manifest: Manifest) -> None:
        if self.pinned_version and manifest.info.version != self.pinned_version:
            raise self._loss(f"asked for version {self.pinned_version}, got {manifest.info.version}")
        if not manifest.files:
            raise self._loss("the manifest lists no files")
        size = sum(f.size for f in manifest.files)
        if self.max_bytes and size > self.max_bytes:
            raise AdapterTooLarge(self.name, size, self.max_bytes)
        self.manifest = manifest
        self.pinned_version = manifest.info.version
        self.offsets = file_offsets(manifest)
        total = self.offsets[-1] + manifest.files[-1].size
        self.buffer = self.allocate(total)
        whole = memoryview(self.buffer).cast("B")
        if len(whole) != total:
            raise ValueError(f"allocate({total}) returned {len(whole)} bytes")
        self.files = [whole[start:start + f.size] for start, f in zip(self.offsets, manifest.files)]

    def result(self) -> FetchedAdapter:
        assert self.manifest is not None and self.done
        return FetchedAdapter(self.manifest, {f.path: view for f, view in zip(self.manifest.files, self.files)},
                              self.buffer, {f.path: start for f, start in zip(self.manifest.files, self.offsets)})


class _Watch:
    """Reconciles snapshots across reconnects into one consistent event stream."""

    def __init__(self) -> None:
        self.known: dict[str, AdapterInfo] = {}
        self.synced_once = False

    def resync(self, snapshot: Sequence[AdapterInfo]) -> list[CatalogEvent]:
        fresh = {a.name: a for a in snapshot}
        events = [CatalogEvent(DELETED, old, old.version) for name, old in sorted(self.known.items())
                  if name not in fresh]
        for name, info in sorted(fresh.items()):
            old = self.known.get(name)
            if old is None:
                events.append(CatalogEvent(ADDED, info))
            elif old != info:
                events.append(CatalogEvent(UPDATED, info, old.version))
        self.known = fresh
        events.append(CatalogEvent(SYNCED))
        return events

    def apply(self, event: CatalogEvent) -> None:
        assert event.adapter is not None
        if event.kind == DELETED:
            self.known.pop(event.adapter.name, None)
        else:
            self.known[event.adapter.name] = event.adapter


def _cancel_on_stop(call: grpc.Future, stop: threading.Event) -> None:
    while call.running() and not stop.wait(0.2):
        pass
    call.cancel()


def _watch_events(client: AdapterStoreClient, reconnect: bool, stop: threading.Event | None) -> Iterator[CatalogEvent]:
    state = _Watch()
    backoff = _Backoff(0.2, 5.0)
    while stop is None or not stop.is_set():
        call = client.stub.WatchAdapters(pb.WatchAdaptersRequest(), metadata=client.metadata)
        if stop is not None:
            threading.Thread(target=_cancel_on_stop, args=(call, stop), daemon=True).start()
        snapshot: list[AdapterInfo] = []
        syncing = True
        try:
            for message in call:
                event = CatalogEvent.from_proto(message)
                if syncing:
                    if event.kind == SYNCED:
                        syncing = False
                        backoff.attempt = 0
                        yield from state.resync(snapshot)
                    elif event.adapter is not None:
                        snapshot.append(event.adapter)
                    continue
                state.apply(event)
                yield event
            error: StoreError = StoreError(grpc.StatusCode.UNAVAILABLE, "the watch stream ended")
        except grpc.RpcError as exc:
            if stop is not None and stop.is_set():
                return
            if exc.code() not in RETRYABLE and exc.code() != grpc.StatusCode.CANCELLED:
                raise StoreError.from_rpc(exc) from None
            error = StoreError.from_rpc(exc)
        finally:
            call.cancel()
        if not reconnect:
            raise error
        delay = backoff.delay()
        log.warning("watch: %s; reconnecting in %.2fs", error, delay)
        if stop is not None:
            if stop.wait(delay):
                return
        else:
            time.sleep(delay)
