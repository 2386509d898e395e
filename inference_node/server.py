"""gRPC surface of the node: InferenceNode, standard health checking and reflection.

Handlers run on asyncio; they validate, hand work to the engine thread and relay its
events. A client that goes away (or whose deadline passes) aborts its request, which
frees its KV blocks at the engine's next step.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from lora_common.tls import EXCLUSIVE_PORT, add_port
from lora.v1 import inference_pb2, inference_pb2_grpc

from .engine.engine import EngineStopped, InvalidRequest, QueueFull
from .engine.request import StreamEvent
from .node import Node
from .adapters.errors import AdapterError
from .auth import TokenAuth
from .limits import StreamSlots, check_message, check_prompt_tokens
from .metrics import NodeMetrics
from .request_builder import ADAPTER_NAME, BadRequest, build_request

log = logging.getLogger(__name__)
SERVICE_NAME = inference_pb2.DESCRIPTOR.services_by_name["InferenceNode"].full_name


class InferenceNodeService(inference_pb2_grpc.InferenceNodeServicer):
    def __init__(self, node: Node, metrics: NodeMetrics) -> None:
        self.node = node
        self.metrics = metrics
        self.streams = StreamSlots(node.settings.limits.max_concurrent_streams)

    async def Generate(self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        if not self.streams.try_acquire():
            kind = "adapter" if request.adapter else "base"
            self.metrics.requests.labels(outcome="resource_exhausted", kind=kind).inc()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, self.streams.refusal())
        stream = self._generate(request, context)
        try:
            async for reply in stream:
                yield reply
        finally:
            try:
                await stream.aclose()  # now, not at garbage collection: it aborts the engine request
            finally:
                self.streams.release()

    async def _generate(self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        node = self.node
        limits = node.settings.limits
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[StreamEvent] = asyncio.Queue()

        def emit(event: StreamEvent) -> None:  # called on the engine thread
            loop.call_soon_threadsafe(events.put_nowait, event)

        try:
            check_message(request, limits)
            req = build_request(request, node.codec, node.model.config.vocab_size,
                                node.engine.config.max_model_len,
                                limits.default_max_tokens(node.settings.default_max_tokens), emit)
            check_prompt_tokens(len(req.prompt_token_ids), limits)
            if req.adapter and node.adapters is None:
                await context.abort(grpc.StatusCode.NOT_FOUND,
                                    f"adapter {req.adapter!r}: LoRA is disabled on this node (--max-loras 0)")
            node.engine.submit(req)
        except (BadRequest, InvalidRequest) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except QueueFull as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except EngineStopped as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))

        finished = False
        outcome = "cancelled"
        started = last = time.monotonic()
        first_token_at = None
        kind = "adapter" if req.adapter else "base"
        try:
            while not finished:
                event = await events.get()
                finished = event.finish_reason is not None
                now = time.monotonic()
                if event.token_ids:
                    if first_token_at is None:
                        first_token_at = now
                        self.metrics.ttft.observe(now - started)
                    else:
                        self.metrics.token_latency.observe((now - last) / len(event.token_ids))
                    last = now
                    self.metrics.generated_tokens.inc(len(event.token_ids))
                if event.error is not None:
                    code, message = _status_of(event)
                    outcome = code.name.lower()
                    await context.abort(code, message)
                if finished:
                    outcome = event.finish_reason
                    self.metrics.prompt_tokens.inc(event.prompt_tokens)
                    log.info("request %s adapter=%s finished=%s prompt=%d completion=%d cached=%d ttft=%.3fs total=%.3fs",
                             req.request_id or req.id, req.adapter or "-", event.finish_reason,
                             event.prompt_tokens, event.completion_tokens, event.cached_prompt_tokens,
                             (first_token_at or now) - started, now - started)
                yield inference_pb2.GenerateResponse(
                    token_ids=event.token_ids, text=event.text,
                    finish_reason=event.finish_reason or "",
                    prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens,
                    cached_prompt_tokens=event.cached_prompt_tokens,
                    adapter_version=event.adapter_version)
        finally:
            self.metrics.requests.labels(outcome=outcome, kind=kind).inc()
            if not finished:  # the client went away or the deadline passed
                node.engine.abort(req.id)

    async def LoadAdapter(self, request: inference_pb2.LoadAdapterRequest, context: grpc.aio.ServicerContext):
        manager = await self._adapters(request.name, context)
        loop = asyncio.get_running_loop()
        result: asyncio.Future = loop.create_future()

        def done(entry, error) -> None:  # engine thread
            outcome = (entry.version, entry.tier) if entry is not None else None
            loop.call_soon_threadsafe(lambda: result.done() or result.set_result((outcome, error)))

        self.node.engine.call(lambda: manager.load(request.name, request.version, request.pin, done))
        outcome, error = await result
        self.metrics.admin_calls.labels(method="LoadAdapter", outcome=error.status.name if error else "OK").inc()
        if error is not None:
            await context.abort(error.status, str(error))
        version, tier = outcome
        return inference_pb2.LoadAdapterResponse(name=request.name, version=version, tier=TIERS[tier])

    async def UnloadAdapter(self, request: inference_pb2.UnloadAdapterRequest, context: grpc.aio.ServicerContext):
        manager = await self._adapters(request.name, context)
        try:
            deferred = await asyncio.wrap_future(self.node.engine.call(lambda: manager.unload(request.name)))
        except AdapterError as exc:
            self.metrics.admin_calls.labels(method="UnloadAdapter", outcome=exc.status.name).inc()
            await context.abort(exc.status, str(exc))
        self.metrics.admin_calls.labels(method="UnloadAdapter", outcome="OK").inc()
        return inference_pb2.UnloadAdapterResponse(deferred=deferred)

    async def ListAdapters(self, request: inference_pb2.ListAdaptersRequest, context: grpc.aio.ServicerContext):
        manager = self.node.adapters
        reply = inference_pb2.ListAdaptersResponse()
        if manager is None:
            return reply
        reply.max_loras, reply.max_cpu_loras = manager.max_loras, manager.max_cpu_loras

        cache = self.node.engine.prefix_cache

        def snapshot() -> list[inference_pb2.AdapterStatus]:
            replies = []
            for e in manager.entries():
                stats = cache.stats.get(e.namespace) if cache is not None else None
                replies.append(inference_pb2.AdapterStatus(
                    name=e.name, version=e.version, tier=TIERS[e.tier], pinned=e.pinned, ref_count=e.refs,
                    pending_eviction=e.draining or e.retired, slot=e.slot,
                    rank=e.weights.rank if e.weights else 0,
                    target_modules=list(e.weights.target_modules) if e.weights else [],
                    cache_hit_tokens=stats.hit_tokens if stats else 0, cache_blocks=stats.blocks if stats else 0))
            return replies

        reply.adapters.extend(await asyncio.wrap_future(self.node.engine.call(snapshot)))
        return reply

    async def _adapters(self, name: str, context: grpc.aio.ServicerContext):
        if not ADAPTER_NAME.match(name):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"adapter name {name!r} is not allowed: 1-128 letters, digits, '.', '_', '-'")
        if self.node.adapters is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "LoRA is disabled on this node (--max-loras 0)")
        return self.node.adapters

    async def GetStats(self, request: inference_pb2.GetStatsRequest, context: grpc.aio.ServicerContext):
        engine = self.node.engine

        def read() -> tuple[dict[str, int], list[inference_pb2.PrefixCacheStats]]:
            rows = [inference_pb2.PrefixCacheStats(adapter=adapter, version=version, lookups=s.lookups, hits=s.hits,
                                                   hit_tokens=s.hit_tokens, blocks=s.blocks)
                    for (adapter, version), s in engine.prefix_cache_rows()]
            return engine.snapshot(), rows

        snap, rows = await asyncio.wrap_future(engine.call(read))
        return inference_pb2.GetStatsResponse(
            kv_blocks_total=snap["kv_blocks_total"], kv_blocks_free=snap["kv_blocks_free"],
            kv_blocks_cached=snap["kv_blocks_cached"],
            running_requests=snap["running"], waiting_requests=snap["waiting"],
            steps=snap["steps"], generated_tokens=snap["generated_tokens"],
            prompt_tokens=snap["prompt_tokens"], cached_prompt_tokens=snap["cached_prompt_tokens"],
            block_size=engine.config.block_size, model=self.node.model_name,
            preemptions=snap["preemptions"], prefix_cache=rows)


TIERS = {"gpu": inference_pb2.ADAPTER_TIER_GPU, "host": inference_pb2.ADAPTER_TIER_HOST,
         "loading": inference_pb2.ADAPTER_TIER_LOADING, "disk": inference_pb2.ADAPTER_TIER_DISK}


def _status_of(event: StreamEvent) -> tuple[grpc.StatusCode, str]:
    error = event.error
    if isinstance(error, AdapterError):
        return error.status, str(error)
    if isinstance(error, QueueFull):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(error)
    if isinstance(error, EngineStopped):
        return grpc.StatusCode.UNAVAILABLE, str(error)
    return grpc.StatusCode.INTERNAL, f"generation failed: {error}"


class NodeServer:
    """Owns the grpc.aio server, health state and graceful shutdown."""

    def __init__(self, node: Node, host: str, port: int, drain_seconds: float = 10.0) -> None:
        self.node = node
        self.host = host
        self.requested_port = port
        self.drain_seconds = drain_seconds
        self.server: grpc.aio.Server | None = None
        self.health = None
        self.metrics = NodeMetrics(lambda: node.engine.call(node.snapshot).result(2.0))
        self.port = 0
        self.address = ""
        self._stopped = False

    def _build(self) -> grpc.aio.Server:
        """Creates the grpc.aio server (it must be made inside the running event loop)."""
        settings = self.node.settings
        interceptors = []
        if settings.admin_token or settings.generate_token:
            interceptors.append(TokenAuth(settings.admin_token, settings.generate_token))
        server = grpc.aio.server(interceptors=interceptors, options=[
            # A larger request is refused by gRPC itself with RESOURCE_EXHAUSTED (--max-request-bytes).
            ("grpc.max_receive_message_length", settings.limits.max_request_bytes),
            ("grpc.max_send_message_length", 16 << 20),
            EXCLUSIVE_PORT,
        ])
        inference_pb2_grpc.add_InferenceNodeServicer_to_server(InferenceNodeService(self.node, self.metrics), server)
        self.health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            [SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME], server)
        self.port = add_port(server, f"{self.host}:{self.requested_port}", settings.tls)
        self.address = f"{self.host}:{self.port}"
        return server

    async def start(self) -> None:
        self.server = self._build()
        self.node.engine.start()
        if self.node.catalog is not None:
            self.node.catalog.start()
        await self.server.start()
        if self.node.settings.metrics_port:
            self.metrics.serve(self.node.settings.metrics_port, self.host)
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        log.info("inference node serving on %s (%s)", self.address, self.node.settings.tls.describe())

    async def stop(self) -> None:
        """Refuses new work, lets running requests finish (up to drain_seconds), then exits."""
        if self._stopped or self.server is None:
            return
        self._stopped = True
        log.info("shutting down: draining %d requests", self.node.engine.num_inflight())
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.node.engine.stop_accepting()
        deadline = asyncio.get_running_loop().time() + self.drain_seconds
        while self.node.engine.num_inflight() and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        if self.node.catalog is not None:
            self.node.catalog.stop()
        if self.node.adapters is not None:
            self.node.adapters.shutdown()
        self.node.engine.shutdown()
        await self.server.stop(grace=1.0)
        log.info("inference node stopped")

    async def serve_until_signalled(self) -> None:
        await self.start()
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await self.stop()
