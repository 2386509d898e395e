"""A small typed client of the InferenceNode gRPC API, for services and scripts.

It talks to one node or to a fleet behind a proxy (lora_client/haproxy.py): every call that
names an adapter carries it in the `x-lora-adapter` header too, the proxy's routing key.
With a RetryPolicy, an answer refused with UNAVAILABLE before its first token (a draining
node, a node that went away, no node up) is asked again; an answer that already streamed
tokens is never asked again, so no token is ever sent twice.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import grpc

from lora_common.auth import bearer_metadata
from lora_common.tls import ClientTLS, open_channel
from lora.v1 import inference_pb2, inference_pb2_grpc


@dataclass
class Completion:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    adapter_version: str = ""
    node: str = ""        # the node that answered, as the proxy names it (x-lora-node); "" direct
    attempts: int = 1     # 1 + the refusals retried before the first token
    # With GenerateRequest.logprobs: one per token id.
    logprobs: list[inference_pb2.TokenLogprob] = field(default_factory=list)


ADAPTER_HEADER = "x-lora-adapter"
NODE_HEADER = "x-lora-node"
# "false" in an error's trailing metadata: the node says a retry would fail the same way soon
# (e.g. its adapter store is down); the openai client honours the same header over HTTP.
SHOULD_RETRY = "x-should-retry"


@dataclass(frozen=True)
class RetryPolicy:
    """Asks again for an answer refused with UNAVAILABLE before its first token: up to
    `attempts` tries in all, waiting first_backoff_s, then twice as long each time, at most
    max_backoff_s. Never after a token was streamed, nor when the node said a retry would
    not help (SHOULD_RETRY)."""

    attempts: int = 5
    first_backoff_s: float = 0.1
    max_backoff_s: float = 2.0

    def backoff(self, attempt: int) -> float:
        return min(self.first_backoff_s * 2 ** (attempt - 1), self.max_backoff_s)


class NodeLost(grpc.RpcError):
    """UNAVAILABLE: the node serving this answer went away while it streamed.

    Straight from a node, gRPC reports a lost connection as UNAVAILABLE. Through a proxy,
    the proxy ends the client's stream when its node's connection breaks; HAProxy ends it
    without gRPC trailers, which gRPC reports as UNKNOWN "Stream removed" (other proxies
    reset it: INTERNAL with an RST_STREAM code). Both mean the same thing as the direct
    case, and are raised as this UNAVAILABLE, with the node and the tokens already streamed."""

    def __init__(self, cause: grpc.RpcError, node: str, tokens: int) -> None:
        super().__init__()
        self.cause, self.node, self.tokens = cause, node, tokens

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        where = f"node {self.node}" if self.node else "the node"
        return (f"{where} went away after streaming {self.tokens} tokens of this answer "
                f"({self.cause.code().name}: {self.cause.details()})")

    def __str__(self) -> str:
        return f"UNAVAILABLE: {self.details()}"


def lost_in_transit(exc: grpc.RpcError) -> bool:
    """The stream ended without a gRPC status from the node (see NodeLost)."""
    details = exc.details() or ""
    return ((exc.code() == grpc.StatusCode.UNKNOWN and details.startswith("Stream removed"))
            or (exc.code() == grpc.StatusCode.INTERNAL and "RST_STREAM" in details))


class AnswerStream:
    """The messages of one answer, retried under a RetryPolicy until its first token.

    Iterate it for GenerateResponse messages; `node` is the node that answered (through a
    proxy), `attempts` how many tries it took; `cancel()` ends it."""

    def __init__(self, client: "NodeClient", request: inference_pb2.GenerateRequest,
                 timeout: float | None, retry: RetryPolicy | None) -> None:
        self.client, self.request, self.timeout = client, request, timeout
        self.retry = retry
        self.attempts = 0
        self.node = ""
        self.tokens = 0
        self._call = None
        self._cancelled = False

    def cancel(self) -> None:
        self._cancelled = True
        if self._call is not None:
            self._call.cancel()

    def __iter__(self) -> Iterator[inference_pb2.GenerateResponse]:
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while True:
            self.attempts += 1
            left = None if deadline is None else max(deadline - time.monotonic(), 0.001)
            self._call = self.client.stream(self.request, left)
            try:
                for msg in self._call:
                    self.node = self.node or _header(self._call, NODE_HEADER)
                    self.tokens += len(msg.token_ids)
                    yield msg
                return
            except GeneratorExit:  # the reader stopped early: the node stops too
                self._call.cancel()
                raise
            except grpc.RpcError as exc:
                self.node = self.node or _header(self._call, NODE_HEADER)
                if lost_in_transit(exc):
                    exc = NodeLost(exc, self.node, self.tokens)
                if not self._may_retry(exc, deadline):
                    raise exc from None
                time.sleep(self.retry.backoff(self.attempts))
                self.node = ""

    def _may_retry(self, exc: grpc.RpcError, deadline: float | None) -> bool:
        return (self.retry is not None and not self._cancelled and self.tokens == 0
                and exc.code() == grpc.StatusCode.UNAVAILABLE and self.attempts < self.retry.attempts
                and not said_no_retry(exc)
                and (deadline is None or time.monotonic() + self.retry.backoff(self.attempts) < deadline))


def said_no_retry(exc: grpc.RpcError) -> bool:
    """The node marked this error as one a retry would meet again (SHOULD_RETRY: false)."""
    trailing = getattr(exc, "trailing_metadata", None)
    try:
        return dict((trailing() if trailing else None) or ()).get(SHOULD_RETRY) == "false"
    except grpc.RpcError:
        return False


def _header(call: grpc.Call, name: str) -> str:
    try:
        return dict(call.initial_metadata() or ()).get(name, "")
    except grpc.RpcError:
        return ""


def adapter_metadata(adapter: str) -> list[tuple[str, str]]:
    """The proxy's routing header for an adapter (none for the base model)."""
    return [(ADAPTER_HEADER, adapter)] if adapter else []


class NodeClient:
    def __init__(self, target: str, channel: grpc.Channel | None = None,
                 metadata: Sequence[tuple[str, str]] = (), token: str | None = None,
                 tls: ClientTLS | None = None, retry: RetryPolicy | None = None) -> None:
        """token: sent as `authorization: Bearer <token>` (nodes started with a token need it);
        tls: for nodes serving TLS (a CA to trust, and a client certificate for mutual TLS);
        retry: how `answer` and `generate` retry refusals before the first token (None: never)."""
        self.channel = channel or open_channel(target, tls)
        self.stub = inference_pb2_grpc.InferenceNodeStub(self.channel)
        self.metadata = list(metadata) + bearer_metadata(token)
        self.retry = retry

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "NodeClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def request(prompt: str = "", *, adapter: str = "", chat: bool = True, max_tokens: int = 0,
                temperature: float = 0.0, top_p: float = 0.0, top_k: int = 0,
                seed: int | None = None, stop: Sequence[str] = (),
                prompt_token_ids: Sequence[int] = (), system: str | None = None,
                ignore_eos: bool = False) -> inference_pb2.GenerateRequest:
        """Builds a GenerateRequest; with chat=True the prompt is one user message."""
        req = inference_pb2.GenerateRequest(
            adapter=adapter, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
            top_k=top_k, stop=list(stop), prompt_token_ids=list(prompt_token_ids),
            ignore_eos=ignore_eos)
        if seed is not None:
            req.seed = seed
        if not prompt_token_ids:
            if chat:
                if system is not None:
                    req.messages.add(role="system", content=system)
                req.messages.add(role="user", content=prompt)
            else:
                req.prompt = prompt
        return req

    def stream(self, request: inference_pb2.GenerateRequest,
               timeout: float | None = None) -> Iterator[inference_pb2.GenerateResponse]:
        """One Generate call as gRPC gives it (no retry): its messages, code(), cancel()."""
        return self.stub.Generate(request, timeout=timeout, metadata=self.metadata + adapter_metadata(request.adapter))

    def answer(self, request: inference_pb2.GenerateRequest, timeout: float | None = None) -> AnswerStream:
        """The messages of one answer, retried under this client's RetryPolicy; timeout covers
        every attempt."""
        return AnswerStream(self, request, timeout, self.retry)

    def generate(self, request: inference_pb2.GenerateRequest, timeout: float | None = None) -> Completion:
        result = Completion()
        answer = self.answer(request, timeout)
        for msg in answer:
            result.text += msg.text
            result.token_ids += msg.token_ids
            result.logprobs += msg.logprobs
            if msg.finish_reason:
                result.finish_reason = msg.finish_reason
                result.prompt_tokens = msg.prompt_tokens
                result.completion_tokens = msg.completion_tokens
                result.cached_prompt_tokens = msg.cached_prompt_tokens
                result.adapter_version = msg.adapter_version
        result.node, result.attempts = answer.node, answer.attempts
        return result

    def load_adapter(self, name: str, version: str = "", pin: bool = False,
                     timeout: float | None = None) -> inference_pb2.LoadAdapterResponse:
        """Through a proxy, this loads it on the node its requests are routed to."""
        return self.stub.LoadAdapter(inference_pb2.LoadAdapterRequest(name=name, version=version, pin=pin),
                                     timeout=timeout, metadata=self.metadata + adapter_metadata(name))

    def unload_adapter(self, name: str, timeout: float | None = None) -> inference_pb2.UnloadAdapterResponse:
        return self.stub.UnloadAdapter(inference_pb2.UnloadAdapterRequest(name=name), timeout=timeout,
                                       metadata=self.metadata + adapter_metadata(name))

    def list_adapters(self, timeout: float | None = None) -> inference_pb2.ListAdaptersResponse:
        return self.stub.ListAdapters(inference_pb2.ListAdaptersRequest(), timeout=timeout, metadata=self.metadata)

    def stats(self, timeout: float | None = None) -> inference_pb2.GetStatsResponse:
        return self.stub.GetStats(inference_pb2.GetStatsRequest(), timeout=timeout, metadata=self.metadata)
