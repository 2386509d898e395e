"""One generation request from its arrival to its last chunk, for every API a front end serves.

gRPC's Generate and the OpenAI-compatible HTTP routes both run `generate`, so a request is
checked, limited, tokenised, detokenised, stopped, counted in the metrics and logged the same
way whichever door it came in by. Failures are GenerationError carrying the gRPC status the
gRPC API answers with; the HTTP API maps that status to its own codes. Closing the generator
before its last chunk (a client that went away) aborts the engine request, so its KV blocks
and adapter reference are freed at the core's next step.

A request may ask for n answers to its prompt (the OpenAI API's `n`): n engine requests, whose
chunks come interleaved, each with its answer's index; each answer has its own text, stop
strings and end, and the request ends when all of them have.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

import grpc

from lora.v1 import inference_pb2

from ..config import NodeConfig
from ..core.protocol import CoreInfo, ErrorKind, TokenLogprobs
from ..limits import StreamSlots, check_message, check_prompt_tokens
from ..metrics import NodeMetrics
from ..request_builder import BadRequest, build_request
from ..tokenizer import TextCodec
from .detokenizer import TextStream
from .engine_client import EngineClient, RequestStream
from .response_format import grammar_of

log = logging.getLogger(__name__)
DRAINING = "this node is draining and takes no new requests: retry on another node"
# Sent as "false" (an HTTP header, gRPC trailing metadata) with an error that a retry on this
# node would meet again soon, such as an adapter store that cannot be reached; the openai
# client and lora_client's RetryPolicy then do not retry it.
SHOULD_RETRY = "x-should-retry"


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
    """A request refused or ended with an error; `code` is its gRPC status, `param` the
    request field at fault when there is one (the OpenAI API's error `param`), `retry` False
    when asking this node again soon would fail the same way (SHOULD_RETRY)."""

    def __init__(self, code: grpc.StatusCode, message: str, param: str | None = None, retry: bool = True) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.retry = retry


@dataclass
class Chunk:
    """New tokens of one answer and their text; the last chunk of an answer has finish_reason
    and its counts."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    adapter_version: str = ""
    index: int = 0                                   # which of the request's n answers
    logprobs: list[TokenLogprobs] | None = None      # one per token id, when the request asks
    text_offsets: list[int] | None = None            # with logprobs: where each token's text starts in the answer


class Answer:
    """One of a request's answers as its tokens arrive: text, stop strings, end."""

    __slots__ = ("index", "stream", "text", "output_ids", "finish_reason")

    def __init__(self, index: int, stream: RequestStream, text: TextStream) -> None:
        self.index = index
        self.stream = stream
        self.text = text
        self.output_ids: list[int] = []
        self.finish_reason: str | None = None


async def response_grammar(request: inference_pb2.GenerateRequest) -> str:
    """The request's structured-output grammar ("" for none), checked off the event loop (a
    large schema takes a while)."""
    if not request.HasField("response_format"):
        return ""
    if request.response_format.type == inference_pb2.ResponseFormat.TEXT:
        return grammar_of(request.response_format)
    return await asyncio.to_thread(grammar_of, request.response_format)


async def generate(frontend: Frontend, request: inference_pb2.GenerateRequest,
                   api: str = "grpc", n: int = 1) -> AsyncIterator[Chunk]:
    """Runs `request` (a GenerateRequest, whichever API it came from) for n answers; yields
    their chunks.

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
            grammar = await response_grammar(request)
            spec, stop = build_request(request, frontend.codec, frontend.info,
                                       limits.max_tokens_default(),
                                       client.new_request_id(n), grammar, n)
            check_prompt_tokens(len(spec.prompt_token_ids), limits)
        except BadRequest as exc:
            metrics.request_finished(request.adapter, "invalid_argument")
            raise GenerationError(grpc.StatusCode.INVALID_ARGUMENT, str(exc), exc.param) from None
        streams = client.submit(spec)
        ready = streams[0].ready
        answers = [Answer(i, s, TextStream(frontend.codec.step_decoder(), stop)) for i, s in enumerate(streams)]
        stop_ids = frozenset(spec.stop_token_ids)
        with_offsets = spec.logprobs >= 0
        open_answers = n
        outcome = "cancelled"
        started = last = time.monotonic()
        first_token_at = None
        request_name = spec.client_request_id or spec.request_id

        def completion_tokens() -> int:
            return sum(len(a.output_ids) for a in answers)

        def log_request(ended: str) -> None:
            now = time.monotonic()
            log.info("request %s api=%s adapter=%s finished=%s prompt=%d completion=%d cached=%d "
                     "ttft=%.3fs total=%.3fs%s", request_name, api, spec.adapter or "-", ended,
                     len(spec.prompt_token_ids), completion_tokens(), streams[0].cached_prompt_tokens,
                     (first_token_at or now) - started, now - started, f" n={n}" if n > 1 else "")

        try:
            while open_answers:
                await ready.wait()
                ready.clear()
                for answer in answers:
                    if answer.finish_reason is not None:
                        continue
                    stream = answer.stream
                    new_ids, logprobs = stream.take()
                    error = stream.error
                    # Tokens that came with an error were sampled before it: the client gets them
                    # first, so what it holds is what the error's count says.
                    finish_reason = stream.finish_reason if error is None else None
                    if not new_ids and finish_reason is None and error is None:
                        continue
                    text, output_ids = answer.text, answer.output_ids
                    offsets: list[int] | None = [] if with_offsets else None
                    for i, token in enumerate(new_ids):
                        output_ids.append(token)
                        if offsets is not None:
                            offsets.append(len(text.text))
                        if token in stop_ids and finish_reason == "stop" and i == len(new_ids) - 1:
                            break  # a stop token ends the answer's tokens but not its text
                        text.push(token)
                        if text.stopped:  # the answer ends with the token that completed a stop string
                            new_ids, finish_reason = new_ids[:i + 1], "stop"
                            if logprobs is not None:
                                logprobs = logprobs[:i + 1]
                            client.abort(stream.request_id)
                            break
                    now = time.monotonic()
                    if new_ids:
                        if first_token_at is None:
                            first_token_at = now
                            metrics.first_token(spec.adapter, now - started, len(new_ids))
                        else:
                            metrics.tokens_streamed(spec.adapter, len(new_ids), now - last)
                        last = now
                    chunk = Chunk(new_ids, text.take(final=finish_reason is not None), index=answer.index,
                                  logprobs=logprobs, text_offsets=offsets)
                    if finish_reason is not None:
                        answer.finish_reason = finish_reason
                        open_answers -= 1
                        chunk.finish_reason = finish_reason
                        chunk.prompt_tokens = len(spec.prompt_token_ids)
                        chunk.completion_tokens = len(output_ids)
                        chunk.cached_prompt_tokens = stream.cached_prompt_tokens
                        chunk.adapter_version = stream.adapter_version
                        if not open_answers:
                            outcome = answers[0].finish_reason
                            log_request(outcome)
                    if new_ids or chunk.text or finish_reason is not None:
                        yield chunk
                    if error is not None and finish_reason is None:
                        outcome = error.code.name.lower()
                        message = error.message
                        if error.kind == ErrorKind.CUT_SHORT:
                            metrics.cut_short.inc()
                            message = f"the node shut down after {len(output_ids)} tokens of this answer"
                            log.warning("request %s cut short at shutdown after %d tokens", request_name,
                                        len(output_ids))
                        raise GenerationError(error.code, message, retry=error.kind != ErrorKind.NO_RETRY)
        finally:
            done = not open_answers
            metrics.request_finished(spec.adapter, outcome, len(spec.prompt_token_ids) if done else 0,
                                     completion_tokens())
            if not done:  # the client went away, its deadline passed, or the engine failed
                for answer in answers:
                    if answer.finish_reason is None:
                        client.abort(answer.stream.request_id)
                log_request(outcome)
    finally:
        frontend.streams.release()
