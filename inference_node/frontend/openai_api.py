"""The OpenAI-compatible HTTP API of a front end (Starlette): /v1/completions,
/v1/chat/completions (streamed as server-sent events or whole), /v1/models and
/v1/models/{id}.

Every generation goes through `generation.generate`, the same path as gRPC's Generate:
validation, limits, tokenising, stop strings, metrics and the request log are one code. The
answer's status is decided by its first chunk: a request refused before its first token
(bad input, unknown adapter, overload, drain) gets its HTTP error code even when streamed.
A client that goes away, while waiting or while streaming, aborts the engine request.
Every error is an answer in OpenAI's error shape on a connection that stays open: a fault of
the node's own is a logged 500 (`ErrorsAsJson`), never a closed keep-alive connection.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
from pathlib import Path
from typing import Any, AsyncGenerator, AsyncIterator, Awaitable, TypeVar

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .engine_client import CoreError
from .generation import SHOULD_RETRY, Chunk, Frontend, GenerationError, generate
from .openai_protocol import ApiError, ApiRequest, ResponseWriter, model_list, model_not_found, parse_request

log = logging.getLogger(__name__)
T = TypeVar("T")
RETRY_AFTER_S = "1"           # 429 and 503: what the openai client waits before its own retry
CATALOG_TIMEOUT_S = 10.0
CLIENT_CLOSED = 499           # never read by anyone: the client is gone


class ClientGone(Exception):
    """The HTTP client closed its connection before its answer was ready."""


def error_response(error: ApiError) -> JSONResponse:
    if not error.retry:
        headers = {SHOULD_RETRY: "false"}
    else:
        headers = {"Retry-After": RETRY_AFTER_S} if error.status in (429, 503) else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class EventStream(StreamingResponse):
    """Server-sent events whose generators (the events' and the generation's) are closed as
    soon as the response ends, also when the client went away mid-stream or before the
    first event, so its engine request is aborted now, not at garbage collection."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncGenerator[str, None], generation: AsyncGenerator[Chunk, None]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.generation = generation

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            await self.generation.aclose()


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Awaits `work`, or cancels it (and waits until it has unwound) and raises ClientGone if
    the client hangs up first."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def _next(stream: AsyncIterator[Chunk]) -> Chunk:
    return await stream.__anext__()


async def _rest(stream: AsyncIterator[Chunk], first: Chunk, writer: ResponseWriter) -> None:
    """Gathers every answer's chunks into the writer, up to the last answer's last chunk."""
    writer.add(first)
    while not writer.done:
        writer.add(await stream.__anext__())


class OpenAIApi:
    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend
        self.token = frontend.config.server.generate_token
        config = Path(frontend.info.checkpoint) / "config.json"
        self.created = int(config.stat().st_mtime) if config.exists() else 0

    # -- the routes ------------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def models(self, request: Request) -> Response:
        try:
            self._authorize(request)
            adapters = await self._adapters()
        except ApiError as exc:
            return error_response(exc)
        return JSONResponse(model_list(self.frontend.info.model_name, self.created, adapters))

    async def model(self, request: Request) -> Response:
        """GET /v1/models/{id}: one entry of the list (openai's models.retrieve), else 404."""
        model = request.path_params["model"]
        base = self.frontend.info.model_name
        try:
            self._authorize(request)
            adapters = [] if model == base else await self._adapters()
        except ApiError as exc:
            return error_response(exc)
        found = [m for m in model_list(base, self.created, adapters)["data"] if m["id"] == model]
        if not found:
            return error_response(model_not_found(model, base))
        return JSONResponse(found[0])

    # -- the pieces --------------------------------------------------------------------------------
    def _authorize(self, request: Request) -> None:
        if not self.token:
            return
        sent = request.headers.get("authorization", "")
        if not hmac.compare_digest(sent.encode(), f"Bearer {self.token}".encode()):
            raise ApiError(401, "this node's HTTP API needs 'Authorization: Bearer <token>' with its generate "
                                "token (the openai client's api_key)", code="invalid_api_key")

    async def _body(self, request: Request) -> Any:
        """The JSON body, refused above --max-request-mb before it is all read."""
        limit = self.frontend.config.limits.max_request_bytes
        too_large = ApiError(413, f"the request body is larger than this node's limit of {limit} bytes "
                                  "(--max-request-mb)", code="request_too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > limit:
                raise too_large
        try:
            return json.loads(body)
        except ValueError as exc:
            raise ApiError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
        except RecursionError:
            raise ApiError(400, "the request body nests JSON arrays or objects too deeply", code="invalid_json") from None

    async def _parse(self, request: Request, chat: bool) -> ApiRequest:
        self._authorize(request)
        body = await self._body(request)
        try:
            return parse_request(body, chat, self.frontend.info.model_name, request.headers.get("x-request-id", ""),
                                 self.frontend.info.max_model_len)
        except ApiError as exc:  # counted as the gRPC API counts its refusals
            model = body.get("model") if isinstance(body, dict) else None
            adapter = "" if model == self.frontend.info.model_name or not isinstance(model, str) else model
            self.frontend.metrics.request_finished(adapter, "not_found" if exc.status == 404 else "invalid_argument")
            raise

    async def _generate(self, request: Request, chat: bool) -> Response:
        try:
            parsed = await self._parse(request, chat)
        except ApiError as exc:
            return error_response(exc)
        stream = generate(self.frontend, parsed.generate, "http", parsed.n)
        handed_over = False  # to the event stream, which closes it when its response ends
        try:
            first = await unless_disconnected(request, _next(stream))
            writer = ResponseWriter(parsed, self.frontend.codec.token_bytes)
            if parsed.stream:
                handed_over = True
                return EventStream(self._events(stream, first, writer), stream)
            await unless_disconnected(request, _rest(stream, first, writer))
            return JSONResponse(writer.response())
        except GenerationError as exc:
            return error_response(ApiError.from_generation(exc))
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        finally:
            if not handed_over:
                await stream.aclose()

    async def _events(self, stream: AsyncIterator[Chunk], first: Chunk, writer: ResponseWriter) -> AsyncIterator[str]:
        chunk = first
        try:
            while True:
                for obj in writer.chunks(chunk):
                    yield sse(obj)
                if writer.streamed_all:
                    break
                chunk = await stream.__anext__()
            yield "data: [DONE]\n\n"
        except GenerationError as exc:  # after part of the answer: the status is sent already
            yield sse(ApiError.from_generation(exc).body())
        finally:
            await stream.aclose()

    async def _adapters(self) -> list[tuple[str, int]]:
        """The adapters this node holds and those its source can serve (store catalog or
        directory); without the source's answer (a store that is down) the held ones only."""
        if not self.frontend.info.lora_enabled:
            return []
        client = self.frontend.client
        names: dict[str, int] = {}
        try:
            for row in await client.call("list_adapters", timeout=CATALOG_TIMEOUT_S):
                names.setdefault(row["name"], 0)
        except CoreError as exc:
            raise ApiError.from_grpc(exc.code, exc.message) from None
        except asyncio.TimeoutError:
            raise ApiError(503, "the engine did not answer in time: retry later", code="unavailable") from None
        try:
            for name, updated in await client.call("adapter_catalog", timeout=CATALOG_TIMEOUT_S):
                names[name] = updated
        except (CoreError, asyncio.TimeoutError) as exc:
            log.warning("GET /v1/models lists loaded adapters only: the adapter source did not answer (%s)",
                        getattr(exc, "message", "timed out"))
        return sorted(names.items())


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Unknown paths and methods in OpenAI's error shape too."""
    return error_response(ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                   code="not_found" if exc.status_code == 404 else "method_not_allowed"))


INTERNAL_ERROR = ApiError(500, "the node failed to answer this request (a fault of the node's, logged there); "
                               "retrying it may not help", code="internal_error")


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    return error_response(INTERNAL_ERROR)


class ErrorsAsJson:
    """The outermost ASGI layer. Starlette answers an unexpected exception with a 500 (in
    OpenAI's shape: `_internal_error`) and then raises it again for the server to log; uvicorn
    then closes the connection, which resets the next request a client sends on it. Here the
    exception is logged and ends with its answer, so the connection stays usable. An
    exception after the answer began (mid-stream) still goes up: that answer is broken."""

    def __init__(self, app: Starlette) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        state = {"started": False, "complete": False}

        async def tracked(message) -> None:
            if message["type"] == "http.response.start":
                state["started"] = True
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                state["complete"] = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception:
            if state["started"] and not state["complete"]:
                raise
            log.exception("HTTP %s %s failed", scope.get("method", ""), scope.get("path", ""))
            if not state["started"]:
                await error_response(INTERNAL_ERROR)(scope, receive, send)


def build_app(frontend: Frontend) -> ErrorsAsJson:
    api = OpenAIApi(frontend)
    return ErrorsAsJson(Starlette(routes=[
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/models/{model:path}", api.model, methods=["GET"]),
    ], exception_handlers={HTTPException: _http_error, Exception: _internal_error}))
