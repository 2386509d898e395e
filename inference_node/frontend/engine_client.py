"""A front end's connection to the engine core (asyncio, ZeroMQ).

Requests go out as they come; outputs come back as one message per engine step, which a
reader task spreads over the requests' streams. A stream keeps what arrived since its
reader last looked, so a handler that falls behind sends several tokens in one message
instead of falling further behind.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
from typing import Any, Callable

import grpc
import zmq
import zmq.asyncio

from ..core import protocol as wire
from ..core.protocol import (Abort, Add, Batch, Call, CoreInfo, ErrorKind, GenerateSpec, Hello, Output, Reply,
                             TokenLogprobs, Welcome, WireError)

log = logging.getLogger(__name__)


class CoreError(Exception):
    """A request or call the engine core refused or ended with an error."""

    def __init__(self, code: grpc.StatusCode, message: str, kind: str = ErrorKind.FAILED) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.kind = kind

    @classmethod
    def from_wire(cls, error: WireError) -> "CoreError":
        return cls(getattr(grpc.StatusCode, error.code, grpc.StatusCode.INTERNAL), error.message, error.kind)


class RequestStream:
    """One request's outputs as they arrive from the core. `ready` is set when news arrives;
    the n answers to one prompt share one, so their reader wakes for any of them."""

    __slots__ = ("request_id", "_token_ids", "_logprobs", "finish_reason", "error", "cached_prompt_tokens",
                 "adapter_version", "ready")

    def __init__(self, request_id: int, ready: asyncio.Event | None = None) -> None:
        self.request_id = request_id
        self._token_ids: list[int] = []
        self._logprobs: list[TokenLogprobs] | None = None
        self.finish_reason: str | None = None
        self.error: CoreError | None = None
        self.cached_prompt_tokens = 0
        self.adapter_version = ""
        self.ready = ready or asyncio.Event()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def feed(self, token_ids: list[int], finish_reason: str | None, error: CoreError | None,
             cached_prompt_tokens: int, adapter_version: str, logprobs: list[TokenLogprobs] | None = None) -> None:
        self._token_ids.extend(token_ids)
        if logprobs:
            if self._logprobs is None:
                self._logprobs = []
            self._logprobs.extend(logprobs)
        if adapter_version:
            self.cached_prompt_tokens, self.adapter_version = cached_prompt_tokens, adapter_version
        if finish_reason is not None:
            self.cached_prompt_tokens = max(self.cached_prompt_tokens, cached_prompt_tokens)
            self.finish_reason, self.error = finish_reason, error
        self.ready.set()

    def take(self) -> tuple[list[int], list[TokenLogprobs] | None]:
        """The tokens (and their logprobs, when asked) that arrived since the last take."""
        token_ids, self._token_ids = self._token_ids, []
        logprobs, self._logprobs = self._logprobs, None
        return token_ids, logprobs


class EngineClient:
    """Sends requests and calls to the core at `core_address`; receives at `output_address`."""

    def __init__(self, core_address: str, output_address: str, frontend_id: str) -> None:
        self.core_address = core_address
        self.output_address = output_address
        self.frontend_id = frontend_id
        self.context = zmq.asyncio.Context()
        self._to_core = self.context.socket(zmq.PUSH)
        self._to_core.setsockopt(zmq.LINGER, 0)
        self._to_core.setsockopt(zmq.SNDHWM, 0)
        self._from_core = self.context.socket(zmq.PULL)
        self._from_core.setsockopt(zmq.LINGER, 0)
        self._from_core.setsockopt(zmq.RCVHWM, 0)
        self.streams: dict[int, RequestStream] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._reader: asyncio.Task | None = None
        self.info: CoreInfo | None = None
        self.dead: CoreError | None = None   # set once the core is gone: everything fails with it
        self.on_core_exit: Callable[[CoreError], None] = lambda error: None
        self._watch_fd: int | None = None
        self._watching = False
        self._encode = wire.encoder().encode
        self._decode = wire.frontend_decoder().decode

    async def connect(self, timeout: float) -> CoreInfo:
        """Says hello and waits for the core's welcome (its limits), then starts reading."""
        self._from_core.bind(self.output_address)
        self._to_core.connect(self.core_address)
        await self._to_core.send(self._encode(Hello(self.frontend_id, self.output_address)))
        while True:
            if not await self._from_core.poll(timeout * 1000):
                raise TimeoutError(f"the engine core did not answer within {timeout:.0f}s")
            message = self._decode(await self._from_core.recv())
            if isinstance(message, Welcome):
                self.info = message.info
                break
        self._reader = asyncio.get_running_loop().create_task(self._read())
        return self.info

    def watch_core(self, pid: int) -> None:
        """Fails every stream and call with UNAVAILABLE as soon as the core process exits."""
        loop = asyncio.get_running_loop()
        self._watching = True
        try:
            self._watch_fd = os.pidfd_open(pid)
        except (AttributeError, OSError):  # no pidfd (not Linux): look twice a second
            async def poll() -> None:
                while self.dead is None and self._watching:
                    try:
                        os.kill(pid, 0)
                    except ProcessLookupError:
                        self._core_exited(pid)
                        return
                    await asyncio.sleep(0.5)
            loop.create_task(poll())
            return
        loop.add_reader(self._watch_fd, self._core_exited, pid)

    def unwatch_core(self) -> None:
        """Stops watching the core process: it was told to shut down, and its exit is no failure."""
        self._watching = False
        if self._watch_fd is not None:
            asyncio.get_running_loop().remove_reader(self._watch_fd)
            os.close(self._watch_fd)
            self._watch_fd = None

    def _core_exited(self, pid: int) -> None:
        self.unwatch_core()
        if self.dead is not None:
            return
        error = CoreError(grpc.StatusCode.UNAVAILABLE,
                          f"the node's engine process (pid {pid}) exited; this node is going down: "
                          "retry on another node")
        log.error("%s", error.message)
        self.fail_all(error)
        self.on_core_exit(error)

    def fail_all(self, error: CoreError) -> None:
        self.dead = error
        for stream in self.streams.values():
            if not stream.finished:
                stream.feed([], "error", error, 0, "")
        self.streams.clear()
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)
        self._calls.clear()

    # -- requests and calls --------------------------------------------------------------------
    def new_request_id(self, n: int = 1) -> int:
        """A fresh request id, the first of n consecutive ones (n answers to one prompt)."""
        first = next(self._ids)
        for _ in range(n - 1):
            next(self._ids)
        return first

    def submit(self, spec: GenerateSpec) -> list[RequestStream]:
        """The streams of the spec's n answers (ids request_id + 0..n-1), sharing one `ready`."""
        ready = asyncio.Event()
        streams = [RequestStream(spec.request_id + i, ready) for i in range(spec.n)]
        if self.dead is not None:
            for stream in streams:
                stream.feed([], "error", self.dead, 0, "")
            return streams
        for stream in streams:
            self.streams[stream.request_id] = stream
        self._to_core.send(self._encode(Add(self.frontend_id, spec)))
        return streams

    def abort(self, request_id: int) -> None:
        """The client went away: the core frees the request's KV blocks and adapter reference."""
        if self.streams.pop(request_id, None) is not None and self.dead is None:
            self._to_core.send(self._encode(Abort(self.frontend_id, request_id)))

    async def call(self, method: str, timeout: float | None = None, **args: Any) -> Any:
        """Runs `method` on the core between steps; raises CoreError with its status."""
        if self.dead is not None:
            raise self.dead
        call_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        await self._to_core.send(self._encode(Call(self.frontend_id, call_id, method, args)))
        try:
            return await asyncio.wait_for(future, timeout)
        finally:
            self._calls.pop(call_id, None)

    # -- the reader task -------------------------------------------------------------------------
    async def _read(self) -> None:
        while True:
            try:
                message = self._decode(await self._from_core.recv())
            except (asyncio.CancelledError, zmq.ContextTerminated, zmq.ZMQError):
                return
            if isinstance(message, Batch):
                self.deliver(message.outputs, message.replies)

    def deliver(self, outputs: list[Output], replies: list[Reply]) -> None:
        """Spreads one batch from the core over its requests' streams and its calls' futures."""
        streams, calls = self.streams, self._calls
        for out in outputs:
            stream = streams.get(out.request_id)
            if stream is None:  # aborted here already
                continue
            if out.finish_reason is not None:
                del streams[out.request_id]
            stream.feed(out.token_ids, out.finish_reason,
                        CoreError.from_wire(out.error) if out.error is not None else None,
                        out.cached_prompt_tokens, out.adapter_version, out.logprobs)
        for reply in replies:
            future = calls.get(reply.call_id)
            if future is None or future.done():
                continue
            if reply.error is None:
                future.set_result(reply.result)
            else:
                future.set_exception(CoreError.from_wire(reply.error))

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        if self._watch_fd is not None:
            try:
                asyncio.get_running_loop().remove_reader(self._watch_fd)
            except RuntimeError:
                pass
            os.close(self._watch_fd)
            self._watch_fd = None
        self._to_core.close(linger=0)
        self._from_core.close(linger=0)
        self.context.term()
