"""The engine core: one loop owns the model, the KV cache, the scheduler and the adapter tiers,
and talks to front ends only through ZeroMQ (inference_node.core.protocol).

Its main thread runs the engine loop; after every iteration it sends each front end one
message with everything that happened for it (new tokens, finished requests, call replies),
so the cost of streaming is one encode per front end per step, whatever the number of
requests. A second thread only receives: it decodes front-end messages and hands them to the
engine as commands, so the loop never waits on a socket.

It runs as a process of its own (`run_engine_core_process`, started by the launcher, which
builds the node there through LLM), or on a thread of the caller's process (tests that want
to look inside the engine).
"""
from __future__ import annotations

import logging
import os
import sys
import threading
from collections import deque
from functools import partial
from typing import Any, Callable

import grpc
import msgspec
import zmq

from lora_common.malloc import keep_freed_buffers

from ..adapters.errors import AdapterError, AdapterNotFound
from ..config import CONFIG_EXIT, ConfigError, NodeConfig
from ..engine.errors import CutShort, EngineStopped, InvalidRequest, NonFiniteLogits, NotStarted, QueueFull
from ..engine.request import Request, SamplingParams, StreamEvent
from ..engine.stats import prefix_cache_rows
from ..node import Node
from ..parent_watch import die_with_parent, parent_alive
from . import protocol as wire
from .protocol import Abort, Add, Batch, Call, CoreInfo, ErrorKind, GenerateSpec, Hello, Output, Reply, WireError

log = logging.getLogger(__name__)
SEED_MODULUS = 1 << 64   # seeds are uint64 (the gRPC field)


def wire_error(error: BaseException) -> WireError:
    """The status, message and kind of an error that ended a request or a call."""
    if isinstance(error, NotStarted):
        return WireError(grpc.StatusCode.UNAVAILABLE.name, str(error), ErrorKind.NOT_STARTED)
    if isinstance(error, CutShort):
        return WireError(grpc.StatusCode.UNAVAILABLE.name, str(error), ErrorKind.CUT_SHORT)
    if isinstance(error, AdapterError):
        return WireError(error.status.name, str(error),
                         ErrorKind.FAILED if error.retry_may_help else ErrorKind.NO_RETRY)
    if isinstance(error, InvalidRequest):
        return WireError(grpc.StatusCode.INVALID_ARGUMENT.name, str(error))
    if isinstance(error, QueueFull):
        return WireError(grpc.StatusCode.RESOURCE_EXHAUSTED.name, str(error))
    if isinstance(error, EngineStopped):
        return WireError(grpc.StatusCode.UNAVAILABLE.name, str(error))
    if isinstance(error, NonFiniteLogits):
        return WireError(grpc.StatusCode.INTERNAL.name, str(error))
    return WireError(grpc.StatusCode.INTERNAL.name, f"generation failed: {error}")


TIER_NAMES = ("gpu", "host", "loading")


class EngineCore:
    """Serves one node's engine to front ends over `address` (a ZeroMQ PULL endpoint)."""

    def __init__(self, node: Node, address: str, context: zmq.Context | None = None) -> None:
        self.node = node
        self.engine = node.engine
        self.address = address
        self.context = context or zmq.Context.instance()
        self.inbox = self.context.socket(zmq.PULL)
        self.inbox.setsockopt(zmq.LINGER, 0)
        self.inbox.bind(address)
        self.outputs: dict[str, zmq.Socket] = {}               # front end -> its PULL socket
        # Filled and sent by the loop thread alone (requests emit and calls reply there).
        self.outbox: dict[str, list[Output]] = {}
        self.replies: dict[str, deque[Reply]] = {}
        self._encode = wire.encoder().encode                  # the loop thread's
        self._encode_refusal = wire.encoder().encode          # the receiver thread's
        self._decode = wire.core_decoder().decode
        self.requests: dict[tuple[str, int], int] = {}        # (front end, its id) -> engine id
        # The receiver's own sockets to the front ends: a refusal goes out at once, even while
        # the loop thread is busy with a step.
        self.refusals: dict[str, zmq.Socket] = {}
        self._receiver = threading.Thread(target=self._receive, name="core-inbox", daemon=True)
        self._stopping = threading.Event()
        # Wakes the receiver's poll when the loop ends, so a stop does not wait out its timeout.
        wake = f"inproc://core-wake-{id(self)}"
        self._wake_in = self.context.socket(zmq.PAIR)
        self._wake_in.bind(wake)
        self._wake_out = self.context.socket(zmq.PAIR)
        self._wake_out.connect(wake)
        self.watch_parent = False                             # set by the process entry point
        self.calls: dict[str, Callable[..., Any]] = {
            "list_adapters": self._list_adapters, "stats": self._stats, "snapshot": node.snapshot,
            "check_consistency": self._check_consistency, "drain": self._drain,
            "inflight": self.engine.num_inflight, "unload_adapter": self._unload_adapter,
            "shutdown": self._shutdown,
        }

    def info(self) -> CoreInfo:
        node, cfg = self.node, self.engine.config
        return CoreInfo(
            model_name=node.model_name, checkpoint=str(node.checkpoint),
            vocab_size=node.model.config.vocab_size, max_model_len=cfg.max_model_len,
            kv_capacity_tokens=self.engine.admission.capacity_tokens, block_size=cfg.block_size,
            lora_enabled=node.adapters is not None,
            max_loras=node.adapters.max_loras if node.adapters is not None else 0,
            max_cpu_loras=node.adapters.max_cpu_loras if node.adapters is not None else 0,
            pid=os.getpid(), device=node.model.device.type)

    # -- running -----------------------------------------------------------------------------
    def run(self) -> None:
        """Prepares the engine, then runs its loop on this thread until `shutdown`."""
        self.engine.prepare()
        if self.node.catalog is not None:
            self.node.catalog.start()
        self._receiver.start()
        try:
            self.engine.run_forever(after_each=self.flush)
        finally:
            self._stopping.set()
            self._wake_out.send(b"")
            if self.node.catalog is not None:
                self.node.catalog.stop()
            if self.node.adapters is not None:
                self.node.adapters.shutdown()
            self._receiver.join(10.0)
            self.node.close()
            for sock in [*self.outputs.values(), *self.refusals.values()]:
                sock.close(linger=1000)  # the last batch (cut answers) still goes out
            for sock in (self.inbox, self._wake_in, self._wake_out):
                sock.close()

    def stop(self) -> None:
        """From another thread: ends the loop (running requests end as at shutdown)."""
        self.engine.shutdown(timeout=0)

    # -- the loop thread ------------------------------------------------------------------------
    def flush(self) -> None:
        """Sends each front end what happened for it since the last flush, as one message."""
        for frontend, sock in self.outputs.items():
            outputs, replies = self.outbox[frontend], self.replies[frontend]
            if not outputs and not replies:
                continue
            self.outbox[frontend] = []
            answered = [replies.popleft() for _ in range(len(replies))]
            sock.send(self._encode(Batch(outputs, answered)))

    def _emit(self, frontend: str, request_id: int, event: StreamEvent) -> None:
        error = wire_error(event.error) if event.error is not None else None
        self.outbox[frontend].append(Output(request_id, event.token_ids, event.finish_reason, error,
                                            event.cached_prompt_tokens, event.adapter_version, event.logprobs))
        if event.finish_reason is not None:
            self.requests.pop((frontend, request_id), None)

    def _connect(self, frontend: str, address: str) -> None:
        if frontend not in self.outputs:
            sock = self.context.socket(zmq.PUSH)
            # The loop never blocks on a slow front end: messages queue in ZeroMQ instead.
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.connect(address)
            self.outbox[frontend], self.replies[frontend] = [], deque()
            self.outputs[frontend] = sock
        log.info("front end %s connected", frontend)
        self.outputs[frontend].send(self._encode(wire.Welcome(self.info())))

    def _call(self, frontend: str, call_id: int, method: str, args: dict[str, Any]) -> None:
        if method == "load_adapter":
            self._load_adapter(frontend, call_id, **args)
            return
        if method == "adapter_catalog":
            self._adapter_catalog(frontend, call_id)
            return
        try:
            result = self.calls[method](**args)
        except Exception as exc:  # handed to the caller as its status
            self.replies[frontend].append(Reply(call_id, error=wire_error(exc)))
            if not isinstance(exc, AdapterError):
                log.exception("core call %s failed", method)
            return
        self.replies[frontend].append(Reply(call_id, result))

    # -- the receiver thread ------------------------------------------------------------------
    def _receive(self) -> None:
        poller = zmq.Poller()
        poller.register(self.inbox, zmq.POLLIN)
        poller.register(self._wake_in, zmq.POLLIN)
        while not self._stopping.is_set():
            try:
                ready = dict(poller.poll(500))  # the timeout only paces the launcher check
            except zmq.ZMQError:  # the socket closed under a stopping core
                if self._stopping.is_set():
                    return
                raise
            if self.inbox not in ready:
                if self.watch_parent and not parent_alive():
                    log.error("the node's launcher is gone: stopping the engine core")
                    os._exit(1)
                continue
            while True:
                try:
                    message = self._decode(self.inbox.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                except msgspec.DecodeError as exc:  # not a front end of this node's version
                    log.error("dropped a message the wire does not describe: %s", exc)
                    continue
                self._dispatch(message)

    def _dispatch(self, message: wire.ToCore) -> None:
        if isinstance(message, Add):
            self._add(message.frontend, message.spec)
        elif isinstance(message, Abort):
            engine_id = self.requests.get((message.frontend, message.request_id))
            if engine_id is not None:
                self.engine.abort(engine_id)
        elif isinstance(message, Call):
            self.engine.call(partial(self._call, message.frontend, message.call_id, message.method, message.args))
        elif isinstance(message, Hello):
            if message.frontend not in self.refusals:
                sock = self.context.socket(zmq.PUSH)
                sock.setsockopt(zmq.SNDHWM, 0)
                sock.connect(message.address)
                self.refusals[message.frontend] = sock
            self.engine.call(partial(self._connect, message.frontend, message.address))

    def _add(self, frontend: str, spec: GenerateSpec) -> None:
        """The spec's n engine requests: the later ones follow the first, whose prompt's KV
        they reuse from the prefix cache, and sample with seeds of their own (seed + i)."""
        first = None
        for i in range(spec.n):
            request_id = spec.request_id + i
            seed = None if spec.seed is None else (spec.seed + i) % SEED_MODULUS
            params = SamplingParams(max_tokens=spec.max_tokens, temperature=spec.temperature,
                                    top_p=spec.top_p, top_k=spec.top_k, seed=seed, ignore_eos=spec.ignore_eos,
                                    logprobs=spec.logprobs, stop_token_ids=frozenset(spec.stop_token_ids))
            request = Request(spec.prompt_token_ids, params, partial(self._emit, frontend, request_id),
                              adapter=spec.adapter, request_id=spec.client_request_id, grammar_source=spec.grammar,
                              follows=first)
            first = first or request
            try:
                if spec.adapter and self.node.adapters is None:
                    raise AdapterNotFound(f"adapter {spec.adapter!r}: LoRA is disabled on this node (--max-loras 0)")
                self.requests[(frontend, request_id)] = request.id
                self.engine.submit(request)
            except Exception as exc:  # refused before it started: tell the front end at once
                self.requests.pop((frontend, request_id), None)
                error = wire_error(exc)  # the later answers are refused with it (the front end aborts the earlier)
                refusals = [Output(spec.request_id + j, [], "error", error) for j in range(i, spec.n)]
                self.refusals[frontend].send(self._encode_refusal(Batch(refusals, [])))
                return

    # -- calls, on the loop thread --------------------------------------------------------------
    def _load_adapter(self, frontend: str, call_id: int, name: str, version: str = "", pin: bool = False) -> None:
        manager = self._manager()

        def done(entry, error) -> None:  # the loop thread
            if error is not None:
                self.replies[frontend].append(Reply(call_id, error=wire_error(error)))
            else:
                self.replies[frontend].append(Reply(call_id, [entry.version, entry.tier]))

        manager.load(name, version, pin, done)

    def _adapter_catalog(self, frontend: str, call_id: int) -> None:
        """[[name, updated unix time]] of the adapters the source can serve (the store's catalog,
        the directory's adapters), listed on a thread of its own: a store's answer takes a
        network round trip, which the loop never waits for. The reply goes out from the loop."""
        source = self.node.adapters.source if self.node.adapters is not None else None
        if source is None:
            self.replies[frontend].append(Reply(call_id, []))
            return

        def reply(answer: Reply) -> None:  # the loop thread
            self.replies[frontend].append(answer)

        def run() -> None:
            try:
                listed = [[name, updated] for name, updated in source.catalog()]
            except Exception as exc:  # handed to the caller as its status
                if not isinstance(exc, AdapterError):
                    log.exception("listing the adapter source failed")
                self.engine.call(partial(reply, Reply(call_id, error=wire_error(exc))))
                return
            self.engine.call(partial(reply, Reply(call_id, listed)))

        threading.Thread(target=run, name="adapter-catalog", daemon=True).start()

    def _unload_adapter(self, name: str) -> bool:
        return self._manager().unload(name)

    def _manager(self):
        if self.node.adapters is None:
            raise AdapterError("LoRA is disabled on this node (--max-loras 0)")
        return self.node.adapters

    def _list_adapters(self) -> list[dict[str, Any]]:
        manager = self.node.adapters
        if manager is None:
            return []
        cache = self.engine.prefix_cache
        rows = []
        for e in manager.entries():
            stats = cache.stats.get(e.namespace) if cache is not None else None
            rows.append({
                "name": e.name, "version": e.version, "tier": e.tier, "pinned": e.pinned,
                "ref_count": e.refs, "pending_eviction": e.draining or e.retired, "slot": e.slot,
                "rank": e.rank,  # disk-only adapters: from the disk tier's manifest
                "target_modules": list(e.target_modules),
                "cache_hit_tokens": stats.hit_tokens if stats else 0,
                "cache_blocks": stats.blocks if stats else 0,
                "unhealthy": manager.health_of(e) > 0, "numerical_faults": manager.health_of(e)})
        return rows

    def _stats(self) -> dict[str, Any]:
        snap: dict[str, Any] = self.engine.snapshot()
        snap["prefix_cache"] = [[adapter, version, s.lookups, s.hits, s.hit_tokens, s.blocks]
                                for (adapter, version), s in prefix_cache_rows(self.engine.prefix_cache)]
        return snap

    def _check_consistency(self) -> dict[str, Any]:
        self.engine.check_consistency()
        return self.engine.snapshot()

    def _drain(self) -> None:
        self.engine.drain()

    def _shutdown(self) -> None:
        self.engine.shutdown(timeout=0)


def run_engine_core_process(config: NodeConfig, address: str) -> None:
    """The engine core process: builds the node (LLM), then serves until the launcher says
    stop. A setting the node cannot run with (ConfigError) ends it with CONFIG_EXIT.

    It ignores SIGINT and SIGTERM: a Ctrl-C reaches the whole process group, and the launcher
    decides how the node drains; if the launcher dies, the receiver notices and exits."""
    import signal

    from ..llm import LLM

    die_with_parent(signal.SIGKILL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=config.server.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    keep_freed_buffers()  # adapters arrive from the store as multi-megabyte messages (lora_common.malloc)
    try:
        llm = LLM(config)
    except ConfigError as exc:
        log.error("%s", exc)
        sys.exit(CONFIG_EXIT)
    core = EngineCore(llm.node, address)
    core.watch_parent = True
    log.info("engine core started (pid %d)", os.getpid())
    core.run()
    core.context.destroy(linger=1000)  # once the sockets' last messages are out
    log.info("engine core stopped")
    logging.shutdown()
    # Nothing is left to close, and the interpreter's own teardown of the model, torch and the
    # objects the loop froze out of the collector takes over a second of CPU: a stop waits for
    # this process, so it ends here.
    os._exit(0)
