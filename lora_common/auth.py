"""Bearer tokens on gRPC calls, shared by the store and the node.

A server interceptor checks `authorization: Bearer <token>` metadata on the methods that
need it (compared in constant time) and answers UNAUTHENTICATED otherwise, with a message
that says what to send but never the token. Health checks and reflection stay open, so
container health checks work without the secret.
"""
from __future__ import annotations

import hmac
from typing import Awaitable, Callable, Mapping, Sequence

import grpc


def bearer_metadata(token: str | None) -> list[tuple[str, str]]:
    """The metadata a client sends for `token` (none when unset)."""
    return [("authorization", f"Bearer {token}")] if token else []


def bearer_matches(metadata: Sequence[tuple[str, str | bytes]] | None, token: str) -> bool:
    sent = dict(metadata or ()).get("authorization", "")
    if isinstance(sent, bytes):
        sent = sent.decode("latin-1")
    return hmac.compare_digest(sent.encode(), f"Bearer {token}".encode())


def denied_handler(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that answers UNAUTHENTICATED."""

    async def deny(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def deny_stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator

    kwargs = dict(request_deserializer=handler.request_deserializer,
                  response_serializer=handler.response_serializer)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(deny_stream, **kwargs)
    return grpc.unary_unary_rpc_method_handler(deny, **kwargs)


class BearerAuth(grpc.aio.ServerInterceptor):
    """Requires a token on the methods `token_of` gives one for (full method names)."""

    def __init__(self, token_of: Callable[[str], str | None], message_of: Callable[[str], str]) -> None:
        self.token_of = token_of
        self.message_of = message_of

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable],
                                details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        token = self.token_of(details.method)
        if token is None or handler is None or bearer_matches(details.invocation_metadata, token):
            return handler
        return denied_handler(handler, self.message_of(details.method))


def method_tokens(tokens: Mapping[str, str]) -> Callable[[str], str | None]:
    """token_of for a map of short method names (Generate, LoadAdapter...) to tokens."""
    return lambda method: tokens.get(method.rsplit("/", 1)[-1])
