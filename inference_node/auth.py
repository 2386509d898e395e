"""Bearer-token authentication of the node's RPCs.

Loading and unloading adapters is an administrative act: when an admin token is set,
LoadAdapter and UnloadAdapter need `authorization: Bearer <token>` metadata. Generate can
require its own token. Tokens are compared in constant time and never logged.
"""
from __future__ import annotations

import hmac
from typing import Awaitable, Callable

import grpc

ADMIN_METHODS = frozenset({"LoadAdapter", "UnloadAdapter"})
GENERATE_METHODS = frozenset({"Generate"})


class TokenAuth(grpc.aio.ServerInterceptor):
    def __init__(self, admin_token: str | None, generate_token: str | None) -> None:
        self.required: dict[str, str] = {}
        for methods, token in ((ADMIN_METHODS, admin_token), (GENERATE_METHODS, generate_token)):
            if token:
                self.required.update({m: token for m in methods})

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable],
                                details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        method = details.method.rsplit("/", 1)[-1]
        token = self.required.get(method)
        if token is None or handler is None:
            return handler
        sent = dict(details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(sent.encode(), f"Bearer {token}".encode()):
            return handler
        return _denied(handler, method)


def _denied(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    message = (f"{method} needs 'authorization: Bearer <token>' metadata with this node's "
               f"{'admin' if method in ADMIN_METHODS else 'generate'} token")

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
