"""One generation request from its arrival to its last chunk, for every API a front end serves.

gRPC's Generate and the OpenAI-compatible HTTP routes both run `generate`, so a request is
checked, limited, tokenised, detokenised, stopped, counted in the metrics and logged the same
way whichever door it came in by. Failures are GenerationError carrying the gRPC status the
gRPC API answers with; the HTTP API maps that status to its own codes. Closing the generator
before its last chunk (a client that went away) aborts the engine request, so its KV blocks
and adapter reference are freed at the core's next step.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

import grpc

from lora.v1 import inference_pb2

from ..config import NodeConfig
from ..core.protocol import CoreInfo, ErrorKind
from ..limits import StreamSlots, check_message, check_prompt_tokens
from ..metrics import NodeMetrics
from ..request_builder import BadRequest, build_request
from ..tokenizer import TextCodec
from .detokenizer import TextStream
from .engine_client import EngineClient

log = logging.getLogger(__name__)
DRAINING = "this node is draining and takes no new requests: retry on another node"


@dataclass
class Frontend:
    """What the request handlers of one front-end process share, whatever their API."""

    config: NodeConfig
    client: EngineClient
    info: CoreInfo
    codec: TextCodec
    metrics: NodeMetrics
    draining: bool = False
    streams: StreamSlots = field(init=False)   # open generations of every API together

    def __post_init__(self) -> None:
        self.streams = StreamSlots(self.config.limits.max_concurrent_streams)


class GenerationError(Exception):
    """A request refused or ended with an error; `code` is its gRPC status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class Chunk:
    """New tokens and their text; the last chunk of a request has finish_reason and the counts."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    adapter_version: str = ""


async def generate(frontend: Frontend, request: inference_pb2.GenerateRequest,
                   api: str = "grpc") -> AsyncIterator[Chunk]:
    """Runs `request` (a GenerateRequest, whichever API it came from); yields its chunks.

    Raises GenerationError before the first chunk (draining, a stream limit, bad input, a
    refusal by the core such as an unknown adapter) or after some (the engine failed)."""
    metrics, client, limits = frontend.metrics, frontend.client, frontend.config.limits
    if frontend.draining:
        metrics.request_finished(request.adapter, "unavailable")
        raise GenerationError(grpc.StatusCode.UNAVAILABLE, DRAINING)
    if not frontend.streams.try_acquire():
        metrics.request_finished(request.adapter, "resource_exhausted")
        raise GenerationError(grpc.StatusCode.RESOURCE_EXHAUSTED, frontend.streams.refusal())
    try:
        try:
            check_message(request, limits)
            spec, stop = build_request(request, frontend.codec, frontend.info,
                                       limits.max_tokens_default(),
                                       client.new_request_id())
            check_prompt_tokens(len(spec.prompt_token_ids), limits)
        except BadRequest as exc:
            metrics.request_finished(request.adapter, "invalid_argument")
            raise GenerationError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        stream = client.submit(spec)
        text = TextStream(frontend.codec.step_decoder(), stop)
        output_ids: list[int] = []
        finish_reason: str | None = None
        outcome = "cancelled"
        started = last = time.monotonic()
        first_token_at = None
        try:
            while finish_reason is None:
                new_ids = await stream.next()
                if stream.error is not None:
                    error = stream.error
                    outcome = error.code.name.lower()
                    if error.kind == ErrorKind.CUT_SHORT:
                        metrics.cut_short.inc()
                        log.warning("request %s cut short at shutdown after %d tokens",
                                    spec.client_request_id or spec.request_id, len(output_ids))
                    raise GenerationError(error.code, error.message)
                finish_reason = stream.finish_reason
                if stop:  # token by token: the answer ends with the token that completed a stop string
                    for i, token in enumerate(new_ids):
                        output_ids.append(token)
                        text.push(token)
                        if text.stopped:
                            new_ids, finish_reason = new_ids[:i + 1], "stop"
                            client.abort(spec.request_id)
                            break
                elif new_ids:
                    output_ids.extend(new_ids)
                    for token in new_ids:
                        text.push(token)
                now = time.monotonic()
                if new_ids:
                    if first_token_at is None:
                        first_token_at = now
                        metrics.first_token(spec.adapter, now - started, len(new_ids))
                    else:
                        metrics.tokens_streamed(spec.adapter, len(new_ids), now - last)
                    last = now
                chunk = Chunk(new_ids, text.take(final=finish_reason is not None))
                if finish_reason is not None:
                    outcome = finish_reason
                    chunk.finish_reason = finish_reason
                    chunk.prompt_tokens = len(spec.prompt_token_ids)
                    chunk.completion_tokens = len(output_ids)
                    chunk.cached_prompt_tokens = stream.cached_prompt_tokens
                    chunk.adapter_version = stream.adapter_version
                    log.info("request %s api=%s adapter=%s finished=%s prompt=%d completion=%d cached=%d "
                             "ttft=%.3fs total=%.3fs", spec.client_request_id or spec.request_id, api,
                             spec.adapter or "-", finish_reason, len(spec.prompt_token_ids), len(output_ids),
                             stream.cached_prompt_tokens, (first_token_at or now) - started, now - started)
                if new_ids or chunk.text or finish_reason is not None:
                    yield chunk
        finally:
            metrics.request_finished(spec.adapter, outcome,
                                     len(spec.prompt_token_ids) if finish_reason else 0, len(output_ids))
            if finish_reason is None:  # the client went away, its deadline passed, or the engine failed
                client.abort(spec.request_id)
    finally:
        frontend.streams.release()
