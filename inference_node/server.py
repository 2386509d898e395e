"""gRPC surface of the node, served by each front-end process: InferenceNode, standard health
checking and reflection, and beside it the OpenAI-compatible HTTP API when --http-port is set
(frontend/openai_api.py, on the same event loop).

Handlers validate and tokenise, hand requests to the engine core (EngineClient) and turn
its token ids into text (detokenising and watching stop strings here, never in the engine's
process). A client that goes away, or whose deadline passes, aborts its request: the core
frees its KV blocks and adapter reference at its next step.
"""
from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from lora.v1 import inference_pb2, inference_pb2_grpc
from lora_common.tls import EXCLUSIVE_PORT, add_port

from .auth import TokenAuth
from .config import NodeConfig
from .frontend.engine_client import CoreError, EngineClient
from .frontend.generation import SHOULD_RETRY, Frontend, GenerationError, generate
from .metrics import NodeMetrics
from .request_builder import ADAPTER_NAME
from .tokenizer import TextCodec

log = logging.getLogger(__name__)
SERVICE_NAME = inference_pb2.DESCRIPTOR.services_by_name["InferenceNode"].full_name
TIERS = {"gpu": inference_pb2.ADAPTER_TIER_GPU, "host": inference_pb2.ADAPTER_TIER_HOST,
         "loading": inference_pb2.ADAPTER_TIER_LOADING, "disk": inference_pb2.ADAPTER_TIER_DISK}


class InferenceNodeService(inference_pb2_grpc.InferenceNodeServicer):
    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend
        self.metrics = frontend.metrics

    async def Generate(self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        stream = generate(self.frontend, request, "grpc")
        try:
            async for chunk in stream:
                reply = inference_pb2.GenerateResponse(token_ids=chunk.token_ids, text=chunk.text)
                if chunk.logprobs is not None:
                    reply.logprobs.extend(inference_pb2.TokenLogprob(logprob=logprob, top_token_ids=ids,
                                                                     top_logprobs=values)
                                          for logprob, ids, values in chunk.logprobs)
                if chunk.finish_reason is not None:
                    reply.finish_reason = chunk.finish_reason
                    reply.prompt_tokens = chunk.prompt_tokens
                    reply.completion_tokens = chunk.completion_tokens
                    reply.cached_prompt_tokens = chunk.cached_prompt_tokens
                    reply.adapter_version = chunk.adapter_version
                yield reply
        except GenerationError as exc:
            await context.abort(exc.code, exc.message, () if exc.retry else ((SHOULD_RETRY, "false"),))
        finally:
            await stream.aclose()  # now, not at garbage collection: it aborts the engine request

    async def LoadAdapter(self, request: inference_pb2.LoadAdapterRequest, context: grpc.aio.ServicerContext):
        await self._check_name(request.name, context)
        try:
            version, tier = await self.frontend.client.call(
                "load_adapter", name=request.name, version=request.version, pin=request.pin)
        except CoreError as exc:
            self.metrics.admin_calls.labels(method="LoadAdapter", outcome=exc.code.name).inc()
            await context.abort(exc.code, exc.message)
        self.metrics.admin_calls.labels(method="LoadAdapter", outcome="OK").inc()
        return inference_pb2.LoadAdapterResponse(name=request.name, version=version, tier=TIERS[tier])

    async def UnloadAdapter(self, request: inference_pb2.UnloadAdapterRequest, context: grpc.aio.ServicerContext):
        await self._check_name(request.name, context)
        try:
            deferred = await self.frontend.client.call("unload_adapter", name=request.name)
        except CoreError as exc:
            self.metrics.admin_calls.labels(method="UnloadAdapter", outcome=exc.code.name).inc()
            await context.abort(exc.code, exc.message)
        self.metrics.admin_calls.labels(method="UnloadAdapter", outcome="OK").inc()
        return inference_pb2.UnloadAdapterResponse(deferred=deferred)

    async def ListAdapters(self, request: inference_pb2.ListAdaptersRequest, context: grpc.aio.ServicerContext):
        info = self.frontend.info
        reply = inference_pb2.ListAdaptersResponse()
        if not info.lora_enabled:
            return reply
        reply.max_loras, reply.max_cpu_loras = info.max_loras, info.max_cpu_loras
        rows = await self._core_call("list_adapters", context)
        reply.adapters.extend(inference_pb2.AdapterStatus(**(row | {"tier": TIERS[row["tier"]]})) for row in rows)
        return reply

    async def GetStats(self, request: inference_pb2.GetStatsRequest, context: grpc.aio.ServicerContext):
        snap = await self._core_call("stats", context)
        rows = [inference_pb2.PrefixCacheStats(adapter=adapter, version=version, lookups=lookups, hits=hits,
                                               hit_tokens=hit_tokens, blocks=blocks)
                for adapter, version, lookups, hits, hit_tokens, blocks in snap["prefix_cache"]]
        return inference_pb2.GetStatsResponse(
            kv_blocks_total=snap["kv_blocks_total"], kv_blocks_free=snap["kv_blocks_free"],
            kv_blocks_cached=snap["kv_blocks_cached"],
            running_requests=snap["running"], waiting_requests=snap["waiting"],
            steps=snap["steps"], generated_tokens=snap["generated_tokens"],
            prompt_tokens=snap["prompt_tokens"], cached_prompt_tokens=snap["cached_prompt_tokens"],
            block_size=self.frontend.info.block_size, model=self.frontend.info.model_name,
            preemptions=snap["preemptions"], prefix_cache=rows, graph_steps=snap["graph_steps"],
            eager_decode_steps=snap["eager_decode_steps"], eager_prefill_steps=snap["eager_prefill_steps"],
            piecewise_graph_steps=snap["piecewise_graph_steps"], tensor_parallel_size=snap["tensor_parallel_size"],
            slot_table_checks=snap["slot_table_checks"])

    async def _core_call(self, method: str, context: grpc.aio.ServicerContext, **args):
        try:
            return await self.frontend.client.call(method, **args)
        except CoreError as exc:
            await context.abort(exc.code, exc.message)

    async def _check_name(self, name: str, context: grpc.aio.ServicerContext) -> None:
        if not ADAPTER_NAME.match(name):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"adapter name {name!r} is not allowed: 1-128 letters, digits, '.', '_', '-'")
        if not self.frontend.info.lora_enabled:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "LoRA is disabled on this node (--max-loras 0)")


class NodeServer:
    """One front end's grpc.aio server (and HTTP API), health state and graceful shutdown.

    The front end that owns the core (`owns_core`) drains it on stop: the core refuses what
    has not started, running answers finish within drain_seconds, and only those still
    running at the deadline are cut (and counted). Other front ends only stop taking work and
    wait for their streams to end."""

    def __init__(self, config: NodeConfig, client: EngineClient, host: str, port: int,
                 drain_seconds: float = 10.0, owns_core: bool = True, reuse_port: bool = False,
                 metrics_dir: str | None = None, http_port: int | None = None,
                 unhealthy_seconds: float = 0.0) -> None:
        self.config = config
        self.client = client
        self.host = host
        self.requested_port = port
        self.drain_seconds = drain_seconds
        # A proxy keeps sending work until its health checks see NOT_SERVING; the listener
        # stays open (refusing with UNAVAILABLE, which clients retry) at least this long, so
        # no request reaches a connection that is closing (--drain-min-seconds).
        self.unhealthy_seconds = unhealthy_seconds
        self.owns_core = owns_core
        self.reuse_port = reuse_port
        self.metrics_dir = metrics_dir   # several front ends: their metrics summed from here
        self.requested_http_port = http_port  # the OpenAI-compatible API; None: off, 0: a free port
        self.http = None                 # its HttpServer once started
        self.server: grpc.aio.Server | None = None
        self.health: health_aio.HealthServicer | None = None
        self.frontend: Frontend | None = None
        self.port = 0
        self.address = ""
        self.core_failed = False
        self._stopped = False
        self._stop_requested: asyncio.Event | None = None

    @property
    def http_port(self) -> int:
        """The port of the OpenAI-compatible HTTP API (0 when off)."""
        return self.http.port if self.http is not None else 0

    def _build(self) -> grpc.aio.Server:
        """Creates the grpc.aio server (it must be made inside the running event loop)."""
        config = self.config
        interceptors = []
        if config.server.admin_token or config.server.generate_token:
            interceptors.append(TokenAuth(config.server.admin_token, config.server.generate_token))
        server = grpc.aio.server(interceptors=interceptors, options=[
            # A larger request is refused by gRPC itself with RESOURCE_EXHAUSTED (--max-request-bytes).
            ("grpc.max_receive_message_length", config.limits.max_request_bytes),
            ("grpc.max_send_message_length", 16 << 20),
            # Several front-end processes share one port (the kernel spreads connections);
            # one alone holds it exclusively, so a second node on the port fails to start.
            ("grpc.so_reuseport", 1) if self.reuse_port else EXCLUSIVE_PORT,
        ])
        inference_pb2_grpc.add_InferenceNodeServicer_to_server(InferenceNodeService(self.frontend), server)
        self.health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            [SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME], server)
        self.port = add_port(server, f"{self.host}:{self.requested_port}", config.server.tls)
        self.address = f"{self.host}:{self.port}"
        return server

    async def start(self, metrics: NodeMetrics | None = None, serving: bool = True) -> None:
        """Listens; health says SERVING now, or at `set_serving` (once other front ends are up)."""
        loop = asyncio.get_running_loop()
        self._stop_requested = asyncio.Event()
        info, server_options = self.client.info, self.config.server
        if metrics is None:
            metrics = NodeMetrics(lambda: asyncio.run_coroutine_threadsafe(self.client.call("snapshot"), loop).result(2.0),
                                  max_adapter_labels=server_options.metrics_max_adapters)
        self.frontend = Frontend(self.config, self.client, info, TextCodec(Path(info.checkpoint)), metrics)
        self.client.watch_core(info.pid)
        self.client.on_core_exit = self._on_core_exit
        self.server = self._build()
        await self.server.start()
        if self.requested_http_port is not None:
            from .frontend.http_server import HttpServer  # uvicorn and Starlette only when asked for
            from .frontend.openai_api import build_app

            self.http = HttpServer(build_app(self.frontend), self.host, self.requested_http_port,
                                   server_options.tls, self.reuse_port)
            await self.http.start()
        if server_options.metrics_port and self.owns_core:
            metrics.serve(server_options.metrics_port, self.host, self.metrics_dir)
        if serving:
            await self.set_serving()
        else:  # grpc's health servicer starts the whole server as SERVING
            await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)

    async def set_serving(self) -> None:
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        log.info("inference node serving on %s (%s)", self.address, self.config.server.tls.describe())

    async def _set_health(self, status: int) -> None:
        for service in ("", SERVICE_NAME):
            await self.health.set(service, status)

    def _on_core_exit(self, error: CoreError) -> None:
        self.core_failed = True
        self.frontend.draining = True
        asyncio.get_running_loop().create_task(self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING))
        self.request_stop()

    def request_stop(self) -> None:
        if self._stop_requested is not None:
            self._stop_requested.set()

    async def stop(self) -> None:
        """Refuses new work, lets running requests finish (up to drain_seconds), then exits."""
        if self._stopped or self.server is None:
            return
        self._stopped = True
        self.frontend.draining = True
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        loop = asyncio.get_running_loop()
        unhealthy_since = loop.time()
        deadline = unhealthy_since + self.drain_seconds
        closes_at = unhealthy_since + self.unhealthy_seconds
        if self.owns_core and not self.core_failed:
            await self._drain_core(deadline, closes_at)
        while self.client.streams and loop.time() < deadline + 2.0:  # their last messages
            await asyncio.sleep(0.02)
        self.client.unwatch_core()  # nothing left to fail: the core may exit before this front end
        await asyncio.sleep(max(0.0, closes_at - loop.time()))
        # Both ports close together: the HTTP server's exit takes a tick of its own loop (0.1 s).
        closing = [self.server.stop(grace=1.0)] + ([self.http.stop()] if self.http is not None else [])
        await asyncio.gather(*closing)
        self.client.close()
        log.info("inference node front end stopped")

    async def _drain_core(self, deadline: float, closes_at: float) -> None:
        """Drains the core, and stops it once nothing runs and the port is about to close
        (closes_at: the other front ends keep refusing through it until then)."""
        loop = asyncio.get_running_loop()
        try:
            await self.client.call("drain", timeout=5.0)
            inflight = await self.client.call("inflight", timeout=5.0)
            log.info("draining: %d requests still running", inflight)
            while inflight and loop.time() < deadline:
                await asyncio.sleep(0.05)
                inflight = await self.client.call("inflight", timeout=5.0)
            await asyncio.sleep(max(0.0, closes_at - loop.time()))
            self.client.unwatch_core()  # it exits as soon as it has stopped, before this front end
            await self.client.call("shutdown", timeout=5.0)
        except (CoreError, asyncio.TimeoutError) as exc:
            log.error("the engine core did not drain cleanly: %s", exc)

    async def wait_for_stop(self) -> None:
        await self._stop_requested.wait()

    async def serve_until_signalled(self) -> None:
        await self.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        await self.wait_for_stop()
        await self.stop()
