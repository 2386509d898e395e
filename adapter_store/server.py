"""gRPC surface of the store: AdapterStore, health checking and reflection, on asyncio.

Blocking work (S3 downloads, file reads, hashing) runs on worker threads; handlers only
await it. Health is SERVING once the first listing of the bucket has completed.
"""
from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import blake3
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from lora.v1 import adapter_store_pb2 as pb
from lora.v1 import adapter_store_pb2_grpc as pb_grpc

from .auth import store_token_auth
from .cache import BlobReader, CacheCorrupt, DiskCache
from .catalog import Catalog, CatalogEntry, Limits, StoredFile
from .metrics import StoreMetrics
from lora_common.names import InvalidName, check_name, normalize_prefix
from .read_plans import OFF_REASON, DirectReads, ReadPlanner
from .records import SYNCED, CatalogEvent, ReadPlan
from .shard_wire import encode_shard
from .s3 import LocalWriteFailed, ObjectChanged, ObjectCorrupt, S3Store, S3Unavailable, make_client
from lora_common.tls import EXCLUSIVE_PORT, ServerTLS, add_port
from lora_common.validation import DEFAULT_MAX_WEIGHT_ABS

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["AdapterStore"].full_name
DEFAULT_SHARD_BYTES = 4 << 20
READ_AHEAD = 2  # shards read from disk while one is being sent
MIN_SHARD_BYTES = 4 << 10
MAX_SHARD_BYTES = 16 << 20
DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000
WATCH_QUEUE_LIMIT = 10_000
MAX_MESSAGE_BYTES = MAX_SHARD_BYTES + (4 << 20)


@dataclass
class StoreSettings:
    bucket: str
    s3_endpoint: str | None = None
    region: str | None = None
    prefix: str = "adapters/"
    cache_dir: str = ".adapter-cache"
    cache_max_bytes: int = 20 << 30
    host: str = "127.0.0.1"
    port: int = 50061
    poll_interval_s: float = 5.0
    settle_s: float = 1.0  # a change must be stable this long before it is published
    max_adapter_bytes: int = 4 << 30
    max_header_bytes: int = 16 << 20
    max_weight_abs: float = DEFAULT_MAX_WEIGHT_ABS  # larger LoRA weights are listed invalid (0: no bound)
    shard_bytes: int = DEFAULT_SHARD_BYTES
    fetch_timeout_s: float = 600.0  # S3 downloads of a fetch without a client deadline
    validate_workers: int = 2
    metrics_port: int = 0
    tls: ServerTLS = field(default_factory=ServerTLS)          # TLS, or mutual TLS with a client CA
    token: str | None = field(default=None, repr=False)        # bearer token every store RPC needs
    direct_reads: DirectReads = field(default_factory=DirectReads)  # read plans for nodes (GetReadPlan)


MISS_RELIST_TIMEOUT_S = 10.0  # how long a request for an unknown name waits on a fresh listing


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


def _page_token(name: str) -> str:
    return base64.urlsafe_b64encode(name.encode()).decode() if name else ""


def _page_after(token: str) -> str:
    if not token:
        return ""
    try:
        return check_name(base64.urlsafe_b64decode(token.encode()).decode())
    except (ValueError, UnicodeError):
        raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "page_token is not one this server issued") from None


def _sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _blake3_hex(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


def _serialize_shard(message: bytes | pb.AdapterShard) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


def add_service(service: pb_grpc.AdapterStoreServicer, server: grpc.aio.Server) -> None:
    """pb_grpc.add_AdapterStoreServicer_to_server, with FetchAdapter's shards sent as
    encode_shard made them."""
    handlers = {
        "ListAdapters": grpc.unary_unary_rpc_method_handler(
            service.ListAdapters, request_deserializer=pb.ListStoreAdaptersRequest.FromString,
            response_serializer=pb.ListStoreAdaptersResponse.SerializeToString),
        "GetManifest": grpc.unary_unary_rpc_method_handler(
            service.GetManifest, request_deserializer=pb.GetManifestRequest.FromString,
            response_serializer=pb.AdapterManifest.SerializeToString),
        "FetchAdapter": grpc.unary_stream_rpc_method_handler(
            service.FetchAdapter, request_deserializer=pb.FetchAdapterRequest.FromString,
            response_serializer=_serialize_shard),
        "GetReadPlan": grpc.unary_unary_rpc_method_handler(
            service.GetReadPlan, request_deserializer=pb.GetReadPlanRequest.FromString,
            response_serializer=pb.ReadPlan.SerializeToString),
        "WatchAdapters": grpc.unary_stream_rpc_method_handler(
            service.WatchAdapters, request_deserializer=pb.WatchAdaptersRequest.FromString,
            response_serializer=pb.AdapterEvent.SerializeToString),
    }
    assert set(handlers) == set(pb.DESCRIPTOR.services_by_name["AdapterStore"].methods_by_name)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


class AdapterStoreService(pb_grpc.AdapterStoreServicer):
    def __init__(self, catalog: Catalog, metrics: StoreMetrics, shard_bytes: int = DEFAULT_SHARD_BYTES,
                 fetch_timeout_s: float = 600.0, planner: ReadPlanner | None = None) -> None:
        self.catalog, self.metrics = catalog, metrics
        self.cache = catalog.cache
        self.shard_bytes = shard_bytes
        self.fetch_timeout_s = fetch_timeout_s
        self.planner = planner  # None: direct reads are off (GetReadPlan answers plans without files)

    async def _entry(self, name: str, version: str) -> CatalogEntry:
        try:
            check_name(name)
        except InvalidName as exc:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        if not self.catalog.ready.is_set():
            raise _Abort(grpc.StatusCode.UNAVAILABLE, "the catalog is still loading")
        entry = self.catalog.get(name)
        if entry is None or (version and version != entry.info.version):
            # Pushed (or re-uploaded) a moment ago by some tool: look again before saying no.
            await asyncio.to_thread(self.catalog.wait_fresh_pass, MISS_RELIST_TIMEOUT_S)
            entry = self.catalog.get(name)
        if entry is None:
            raise _Abort(grpc.StatusCode.NOT_FOUND, f"adapter {name!r} is not in the catalog")
        if version and version != entry.info.version:
            raise _Abort(grpc.StatusCode.NOT_FOUND, f"adapter {name!r} has version {entry.info.version}, "
                                                    f"not {version!r}")
        if not entry.info.valid:
            raise _Abort(grpc.StatusCode.FAILED_PRECONDITION,
                         f"adapter {name!r} is invalid: {entry.info.invalid_reason}")
        return entry

    async def ListAdapters(self, request: pb.ListStoreAdaptersRequest, context: grpc.aio.ServicerContext):
        try:
            if request.page_size < 0:
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "page_size must not be negative")
            if not self.catalog.ready.is_set():
                raise _Abort(grpc.StatusCode.UNAVAILABLE, "the catalog is still loading")
            size = min(request.page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
            infos, last = self.catalog.page(_page_after(request.page_token), size)
        except _Abort as exc:
            await context.abort(exc.code, exc.details)
        return pb.ListStoreAdaptersResponse(adapters=[i.to_proto() for i in infos], next_page_token=_page_token(last))

    async def GetManifest(self, request: pb.GetManifestRequest, context: grpc.aio.ServicerContext):
        try:
            entry = await self._entry(request.name, request.version)
        except _Abort as exc:
            await context.abort(exc.code, exc.details)
        return entry.manifest().to_proto()

    async def GetReadPlan(self, request: pb.GetReadPlanRequest, context: grpc.aio.ServicerContext):
        try:
            entry = await self._entry(request.name, request.version)
        except _Abort as exc:
            self.metrics.read_plans.labels(outcome=exc.code.name.lower()).inc()
            await context.abort(exc.code, exc.details)
        if self.planner is None:
            plan = ReadPlan(entry.manifest(), (), 0, OFF_REASON)
        else:  # presigning is local, but resolving credentials the first time may not be
            plan = await asyncio.to_thread(self.planner.plan, entry)
        self.metrics.read_plans.labels(outcome="offered" if plan.files else "declined").inc()
        # The URLs are credentials: only what they are for is logged.
        log.info("read plan %s@%s: %s", entry.name, entry.info.version,
                 f"{len(plan.files)} presigned GETs valid until {plan.expires_at}" if plan.files
                 else f"none ({plan.reason})")
        return plan.to_proto()

    async def FetchAdapter(self, request: pb.FetchAdapterRequest,
                           context: grpc.aio.ServicerContext) -> None:
        self.metrics.fetches.inc()
        code = None
        try:
            await self._fetch(request, context)
        except _Abort as exc:
            code = exc.code
            log.info("fetch %r: %s %s", request.name[:200], exc.code.name, exc.details)
            await context.abort(exc.code, exc.details)
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        finally:
            if code is not None:
                self.metrics.fetch_errors.labels(code=code.name).inc()

    async def _fetch(self, request: pb.FetchAdapterRequest, context: grpc.aio.ServicerContext) -> None:
        entry = await self._entry(request.name, request.version)
        files = entry.files
        if not 0 <= request.start_file < len(files):
            raise _Abort(grpc.StatusCode.OUT_OF_RANGE, f"start_file {request.start_file} is not in "
                                                       f"[0, {len(files)})")
        if not 0 <= request.start_offset <= files[request.start_file].obj.size:
            raise _Abort(grpc.StatusCode.OUT_OF_RANGE, f"start_offset {request.start_offset} is outside "
                                                       f"{files[request.start_file].path}")
        if request.max_shard_bytes < 0:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "max_shard_bytes must not be negative")
        shard_bytes = min(max(request.max_shard_bytes or self.shard_bytes, MIN_SHARD_BYTES), MAX_SHARD_BYTES)
        remaining = context.time_remaining()
        # Give up on S3 a little before the client does, so it hears UNAVAILABLE, not a timeout.
        budget = self.fetch_timeout_s if remaining is None else max(0.0, remaining * 0.9 - 0.2)
        deadline = time.monotonic() + budget
        sent = 0
        manifest: pb.AdapterManifest | None = entry.manifest().to_proto()
        for index in range(request.start_file, len(files)):
            file = files[index]
            offset = request.start_offset if index == request.start_file else 0
            try:
                reader = await self._open(file, deadline, request.verify)
            except Exception as exc:
                raise self._storage_error(entry, exc) from None
            try:
                sent += await self._send_file(context, entry, index, reader, offset, shard_bytes, manifest,
                                              fresh_digests=request.verify, blake3_shards=request.blake3_shards)
            except _Abort:
                raise
            except Exception as exc:
                raise self._storage_error(entry, exc) from None
            finally:
                reader.close()
            manifest = None
        log.info("fetch %s@%s: %d bytes from file %d offset %d%s", entry.name, entry.info.version, sent,
                 request.start_file, request.start_offset, " (verified)" if request.verify else "")

    async def _open(self, file: StoredFile, deadline: float, verify: bool) -> BlobReader:
        """A reader of the file's bytes. With `verify` (a client saw bad bytes), a cached blob
        is re-hashed first and, if it rotted, dropped and downloaded again."""
        reader = await asyncio.to_thread(self.catalog.open_file, file, deadline)
        if not verify or reader.streaming:  # a download in progress is verified as it ends
            return reader
        blob = reader.wait_complete()
        if await asyncio.to_thread(self.cache.verify, blob):
            return reader
        reader.close()
        log.warning("%s (%s) rotted in the disk cache; downloading it again", file.path, file.sha256[:16])
        return await asyncio.to_thread(self.catalog.open_file, file, deadline)

    async def _send_file(self, context: grpc.aio.ServicerContext, entry: CatalogEntry, index: int,
                         reader: BlobReader, offset: int, shard_bytes: int,
                         manifest: pb.AdapterManifest | None, fresh_digests: bool = False,
                         blake3_shards: bool = False) -> int:
        """Streams one file from `offset`, reading READ_AHEAD shards ahead of the one being sent.
        Each shard carries its BLAKE3 where the client asked for it (blake3_shards), else its
        sha256. Shards lie on a grid of `shard_bytes` from the file's start, so their digests
        can come from those the cache recorded when the blob was last streamed whole;
        otherwise they are hashed as they are read (and recorded once the whole file was).
        The file's last shard goes out only once its bytes are complete and verified."""
        file = entry.files[index]
        size = file.obj.size
        algorithm = "blake3" if blake3_shards else "sha256"
        known = None if fresh_digests else self.cache.shard_digests(file.sha256, shard_bytes, algorithm)
        computed: list[str] | None = [] if known is None and offset == 0 else None
        digest_of = _blake3_hex if blake3_shards else _sha256_hex

        def read(at: int) -> tuple[bytes, str]:  # on a worker thread
            n = min(shard_bytes - at % shard_bytes, size - at)
            data = reader.read(at, n)
            if len(data) != n:
                raise _Abort(grpc.StatusCode.DATA_LOSS, f"{file.path} is shorter in the cache than listed")
            if known is not None and at % shard_bytes == 0:
                return data, known[at // shard_bytes]
            return data, digest_of(data)

        loop = asyncio.get_running_loop()
        pending: deque[asyncio.Future] = deque()
        ahead = offset  # where the next read starts
        sent = 0
        try:
            while True:
                while len(pending) < READ_AHEAD and (ahead < size or not pending):
                    pending.append(loop.run_in_executor(None, read, ahead))
                    ahead += min(shard_bytes - ahead % shard_bytes, size - ahead) if ahead < size else 0
                data, digest = await pending.popleft()
                end = offset + len(data)
                end_of_file = end >= size
                if computed is not None:
                    computed.append(digest)
                if end_of_file:
                    await asyncio.to_thread(reader.wait_complete)
                last = end_of_file and index == len(entry.files) - 1
                await context.write(encode_shard(pb.AdapterShard(
                    file_index=index, path=file.path, offset=offset, file_size=size, last=last, manifest=manifest,
                    sha256="" if blake3_shards else digest, blake3=digest if blake3_shards else "",
                    adapter_sha256=entry.adapter_sha256 if last else ""), data))
                manifest = None
                sent += len(data)
                self.metrics.fetch_bytes.inc(len(data))
                offset = end
                if end_of_file:
                    if computed is not None and size > 0:
                        self.cache.record_shard_digests(file.sha256, shard_bytes, algorithm, tuple(computed))
                    return sent
        finally:
            if pending:  # a cancelled stream: let the reads end before the reader closes
                await asyncio.wait(pending)

    def _storage_error(self, entry: CatalogEntry, exc: BaseException) -> _Abort:
        """The status a client sees when the bytes could not be had."""
        if isinstance(exc, _Abort):
            return exc
        if isinstance(exc, (S3Unavailable, TimeoutError)):
            return _Abort(grpc.StatusCode.UNAVAILABLE, f"adapter {entry.name!r}: object store unavailable ({exc})")
        if isinstance(exc, ObjectChanged):
            self.catalog.poke()
            return _Abort(grpc.StatusCode.NOT_FOUND, f"adapter {entry.name!r} changed in the bucket since version "
                                                     f"{entry.info.version} was listed ({exc})")
        if isinstance(exc, (ObjectCorrupt, CacheCorrupt)):
            self.catalog.poke()
            return _Abort(grpc.StatusCode.UNAVAILABLE, f"adapter {entry.name!r}: download failed its checksum "
                                                       f"({exc}); try again")
        if isinstance(exc, LocalWriteFailed):
            return _Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"adapter {entry.name!r}: {exc}")
        log.error("fetch %s failed", entry.name, exc_info=exc)
        return _Abort(grpc.StatusCode.INTERNAL, f"adapter {entry.name!r}: {type(exc).__name__}: {exc}")

    async def WatchAdapters(self, request: pb.WatchAdaptersRequest, context: grpc.aio.ServicerContext):
        while not self.catalog.ready.is_set():
            await asyncio.sleep(0.05)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[CatalogEvent] = asyncio.Queue()
        overflow = asyncio.Event()

        def deliver(event: CatalogEvent) -> None:  # on the catalog's thread
            if queue.qsize() >= WATCH_QUEUE_LIMIT:
                loop.call_soon_threadsafe(overflow.set)
            else:
                loop.call_soon_threadsafe(queue.put_nowait, event)

        snapshot, unsubscribe = self.catalog.subscribe(deliver)
        self.metrics.watchers.inc()
        try:
            for info in snapshot:
                await context.write(CatalogEvent("ADDED", info).to_proto())
            await context.write(CatalogEvent(SYNCED).to_proto())
            while True:
                event = await queue.get()
                if overflow.is_set():
                    await context.abort(grpc.StatusCode.ABORTED, "watcher fell behind; watch again to resync")
                await context.write(event.to_proto())
        finally:
            unsubscribe()
            self.metrics.watchers.dec()


class StoreServer:
    """The catalog, cache and gRPC server of one store; start() and stop() on one event loop."""

    def __init__(self, settings: StoreSettings, s3: S3Store | None = None, metrics: StoreMetrics | None = None) -> None:
        self.settings = settings
        self.metrics = metrics or StoreMetrics()
        self.s3 = s3 or S3Store(settings.bucket, make_client(settings.s3_endpoint, settings.region))
        if self.s3.on_retry is None:
            self.s3.on_retry = lambda exc: self.metrics.s3_retries.inc()
        self.cache = DiskCache(Path(settings.cache_dir), settings.cache_max_bytes,
                               on_hit=self.metrics.cache_hits.inc, on_miss=self.metrics.cache_misses.inc)
        limits = Limits(max_adapter_bytes=settings.max_adapter_bytes, max_header_bytes=settings.max_header_bytes,
                        max_weight_abs=settings.max_weight_abs)
        self.catalog = Catalog(self.s3, self.cache, normalize_prefix(settings.prefix),
                               poll_interval_s=settings.poll_interval_s, limits=limits,
                               workers=settings.validate_workers, settle_s=settings.settle_s,
                               metrics=self.metrics)
        self.service = AdapterStoreService(self.catalog, self.metrics, settings.shard_bytes, settings.fetch_timeout_s,
                                           self._planner(settings.direct_reads))
        self.server: grpc.aio.Server | None = None
        self.health: health_aio.HealthServicer | None = None
        self.port = 0
        self._health_task: asyncio.Task | None = None

    def _planner(self, direct: DirectReads) -> ReadPlanner | None:
        """Read plans presigned by the S3 client of the endpoint nodes reach: the store's own,
        or one for direct.endpoint (the same credentials and region, from the environment)."""
        if not direct.enabled:
            return None
        client = make_client(direct.endpoint, self.settings.region) if direct.endpoint else None
        return ReadPlanner(lambda obj, expires_s: self.s3.presign_get(obj, expires_s, client), direct.expiry_s)

    @property
    def address(self) -> str:
        return f"{self.settings.host}:{self.port}"

    async def start(self) -> None:
        options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", 1 << 20), EXCLUSIVE_PORT]
        interceptors = [store_token_auth(self.settings.token)] if self.settings.token else []
        server = grpc.aio.server(options=options, interceptors=interceptors)
        add_service(self.service, server)
        self.health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            [SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            server)
        self.port = add_port(server, f"{self.settings.host}:{self.settings.port}", self.settings.tls)
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.start()
        self.server = server
        if self.settings.metrics_port:
            self.metrics.serve(self.settings.metrics_port, self.settings.host)
        self.catalog.start()
        self._health_task = asyncio.create_task(self._serving_when_ready())
        direct = self.settings.direct_reads
        log.info("adapter store on %s (%s%s): %s prefix %r, cache %s (%.1f GB max), polling every %.1fs%s%s",
                 self.address, self.settings.tls.describe(), ", token required" if self.settings.token else "",
                 self.s3.describe(), self.catalog.prefix, self.settings.cache_dir,
                 self.settings.cache_max_bytes / 1e9, self.settings.poll_interval_s,
                 f", metrics on :{self.settings.metrics_port}" if self.settings.metrics_port else "",
                 f", direct reads via {direct.endpoint or 'the same endpoint'} ({direct.expiry_s}s URLs)"
                 if direct.enabled else "")

    async def _serving_when_ready(self) -> None:
        await asyncio.to_thread(self.catalog.ready.wait)
        assert self.health is not None
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        log.info("catalog loaded: %d adapters; serving", len(self.catalog.snapshot()))

    async def stop(self, grace_s: float = 5.0) -> None:
        if self.health is not None:
            await self.health.enter_graceful_shutdown()
        if self._health_task is not None:
            self._health_task.cancel()
        self.catalog.ready.set()  # release waiters
        await asyncio.to_thread(self.catalog.stop)
        if self.server is not None:
            await self.server.stop(grace_s)
        log.info("adapter store stopped")

    async def serve_until_signalled(self, grace_s: float = 5.0) -> None:
        await self.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("signal received; stopping")
        await self.stop(grace_s)


class BackgroundStore:
    """A StoreServer on its own event loop thread: for tests, benchmarks and embedding."""

    def __init__(self, settings: StoreSettings, s3: S3Store | None = None, wait_ready_s: float = 60.0) -> None:
        self.store = StoreServer(settings, s3)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="adapter-store", daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.store.start(), self.loop).result(60)
        if wait_ready_s and not self.store.catalog.ready.wait(wait_ready_s):
            raise TimeoutError("the catalog did not load in time")

    @property
    def address(self) -> str:
        return self.store.address

    @property
    def catalog(self) -> Catalog:
        return self.store.catalog

    @property
    def cache(self) -> DiskCache:
        return self.store.cache

    @property
    def metrics(self) -> StoreMetrics:
        return self.store.metrics

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.store.stop(1.0), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def __enter__(self) -> "BackgroundStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
