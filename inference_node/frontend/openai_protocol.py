"""The OpenAI API's requests and responses as the node reads and writes them (no I/O here).

A completion or chat request becomes the GenerateRequest the gRPC API takes, so both APIs
run one validation path (request_builder, limits) and answer alike; this module checks only
the JSON's shape and what the OpenAI API has that gRPC does not (`model`, `n`, ...). Errors
are ApiError: OpenAI's error object with an HTTP status, mapped from the gRPC status the
gRPC API answers the same request with.

Logprobs come in the API's two shapes: a completion's {tokens, token_logprobs, top_logprobs,
text_offset} and a chat answer's {content: [{token, logprob, bytes, top_logprobs}]}, a token's
text being the bytes it stands for (`TokenBytes`, the tokenizer's).
"""
from __future__ import annotations

import json
import math
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import grpc

from lora.v1 import inference_pb2

from ..core.protocol import MAX_TOP_LOGPROBS
from ..request_builder import ADAPTER_NAME, MAX_STOP_TOKEN_IDS
from .generation import Chunk, GenerationError

TokenBytes = Callable[[int], bytes]   # a token id's bytes in the text (TextCodec.token_bytes)

# The gRPC status of a refused or failed request -> the HTTP status the OpenAI API answers.
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,   # an adapter this node cannot serve (rank, shapes, weights)
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error"}
SEED_MODULUS = 1 << 64   # the engine's seeds are unsigned 64-bit; OpenAI's are signed
INT32_MAX = (1 << 31) - 1   # max_tokens and top_k are int32 in the GenerateRequest they become
OWNER = "lora-serving"
MAX_N = 128              # answers per request (OpenAI's bound)
SCHEMA_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")   # OpenAI's json_schema.name
FORMAT_TYPES = {"json_object": inference_pb2.ResponseFormat.JSON_OBJECT,
                "json_schema": inference_pb2.ResponseFormat.JSON_SCHEMA}


class ApiError(Exception):
    """An answer of the OpenAI API's error shape: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry: bool = True) -> None:
        """retry=False: a retry here would fail the same way soon (x-should-retry: false)."""
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry = retry

    @classmethod
    def from_grpc(cls, code: grpc.StatusCode, message: str, param: str | None = None,
                  retry: bool = True) -> "ApiError":
        """The answer to a request the gRPC API answers with `code` (NOT_FOUND: the adapter
        that `model` names is unknown)."""
        if code == grpc.StatusCode.NOT_FOUND:
            return cls(404, message, param="model", code="model_not_found")
        return cls(HTTP_STATUS.get(code, 500), message, param=param, code=code.name.lower(), retry=retry)

    @classmethod
    def from_generation(cls, error: GenerationError) -> "ApiError":
        return cls.from_grpc(error.code, error.message, error.param, error.retry)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


@dataclass
class ApiRequest:
    """A parsed /v1/completions or /v1/chat/completions request."""

    generate: inference_pb2.GenerateRequest
    model: str            # echoed in every response object
    chat: bool
    stream: bool
    include_usage: bool   # stream_options.include_usage: a last chunk with the usage
    n: int = 1            # answers to the prompt


# -- reading -------------------------------------------------------------------------------------
def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _int(body: dict, name: str, default: int | None = None, low: int | None = None,
         high: int | None = None, hint: str = "") -> int | None:
    """The integer field `name`, refused outside [low, high] before it reaches protobuf (whose
    int32 fields raise on larger values) or the engine."""
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value):
        raise bad(name, f"{name} must be an integer, got {_show(value)}")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"from {low} to {high}" if low is not None and high is not None else (
            f"of at least {low}" if low is not None else f"of at most {high}")
        raise bad(name, f"{name} must be an integer {bounds}{hint}, got {_show(value)}")
    return value


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not _is_number(value) or not math.isfinite(value):
        raise bad(name, f"{name} must be a finite number, got {_show(value)}")
    return float(value)


def _show(value: Any) -> str:
    """A value as an error message quotes it: never thousands of characters."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def _refuse_unsupported(body: dict, chat: bool, n: int) -> None:
    """Parameters this node does not implement: refused unless left at their no-op value,
    so no client silently gets something other than it asked for."""
    best_of = _int(body, "best_of", n)
    if best_of != n:
        raise bad("best_of", f"best_of must equal n ({n}) or be left out: this node returns every answer it samples")
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(body, name, 0.0) != 0.0:
            raise bad(name, f"{name} is not supported by this node: leave it out or at 0")
    if body.get("logit_bias"):
        raise bad("logit_bias", "logit_bias is not supported by this node")
    if body.get("echo"):
        raise bad("echo", "echo is not supported by this node")
    if body.get("suffix"):
        raise bad("suffix", "suffix is not supported by this node")
    if chat:
        for name in ("tools", "functions"):
            if body.get(name):
                raise bad(name, f"{name} (function calling) is not supported by this node")


def _logprobs(body: dict, chat: bool, msg: inference_pb2.GenerateRequest) -> None:
    """Chat: logprobs (true/false) and top_logprobs (0-20, with logprobs). Completions:
    logprobs, the number of alternatives (0-20)."""
    top = _int(body, "top_logprobs", None, low=0, high=MAX_TOP_LOGPROBS)
    if chat:
        logprobs = body.get("logprobs")
        if logprobs is not None and not isinstance(logprobs, bool):
            raise bad("logprobs", f"logprobs must be true or false, got {_show(logprobs)}")
        msg.logprobs = bool(logprobs)   # top_logprobs without it: request_builder's refusal, as gRPC's
        msg.top_logprobs = top or 0
        return
    if top is not None:
        raise bad("top_logprobs", f"completions take the number of alternatives as logprobs (0-{MAX_TOP_LOGPROBS}), "
                                  "not top_logprobs")
    count = _int(body, "logprobs", None, low=0, high=MAX_TOP_LOGPROBS)
    if count is not None:
        msg.logprobs, msg.top_logprobs = True, count


def _response_format(body: dict, msg: inference_pb2.GenerateRequest) -> None:
    """{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema":
    {"name", "schema", "strict"?, "description"?}}; the schema itself is checked where gRPC's
    is (frontend/response_format.py)."""
    fmt = body.get("response_format")
    if fmt is None:
        return
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise bad("response_format", "response_format must be an object with a type: \"text\", \"json_object\" "
                                     "or \"json_schema\"")
    kind = fmt["type"]
    if kind == "text":
        return
    if kind not in FORMAT_TYPES:
        raise bad("response_format", f"response_format type {_show(kind)} is not one of \"text\", \"json_object\", "
                                     "\"json_schema\"")
    msg.response_format.type = FORMAT_TYPES[kind]
    if kind == "json_object":
        return
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise bad("response_format.json_schema", "response_format of type json_schema needs \"json_schema\": "
                                                 "{\"name\": ..., \"schema\": {...}}")
    name = spec.get("name")
    if not isinstance(name, str) or not SCHEMA_NAME.match(name):
        raise bad("response_format.json_schema.name", "response_format.json_schema.name must be 1-64 letters, "
                                                      f"digits, '_' or '-', got {_show(name)}")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise bad("response_format.json_schema.schema", "response_format.json_schema.schema must be a JSON Schema "
                                                        f"object, got {_show(schema)}")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad("response_format.json_schema.strict", "response_format.json_schema.strict must be true or false")
    msg.response_format.json_schema = json.dumps(schema)


def _stop_token_ids(body: dict, msg: inference_pb2.GenerateRequest) -> None:
    """stop_token_ids (an extension, as vLLM's): ids the answer ends after, beside EOS."""
    ids = body.get("stop_token_ids")
    if ids is None:
        return
    if not (isinstance(ids, list) and all(_is_int(t) and 0 <= t <= INT32_MAX for t in ids)):
        raise bad("stop_token_ids", "stop_token_ids must be a list of token ids")
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise bad("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(ids)}")
    msg.stop_token_ids.extend(ids)


def resolve_model(model: Any, base_model: str) -> str:
    """The adapter that `model` names ("" for the base model); 404 for a name no adapter can have."""
    if not isinstance(model, str) or not model:
        raise bad("model", "model is required: the base model's name or an adapter's (GET /v1/models lists them)")
    if model == base_model:
        return ""
    if not ADAPTER_NAME.match(model):
        raise model_not_found(model, base_model)
    return model


def _prompt(body: dict, msg: inference_pb2.GenerateRequest) -> None:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]   # a batch of one
    if isinstance(prompt, str):
        msg.prompt = prompt
        if not prompt:
            raise bad("prompt", "prompt is empty")
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        if any(t < 0 or t >= 1 << 31 for t in prompt):
            raise bad("prompt", "prompt token ids must be in [0, 2**31)")
        msg.prompt_token_ids.extend(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise bad("prompt", f"one prompt per request: got {len(prompt)} (send them as separate requests)")
    else:
        raise bad("prompt", "prompt must be a string or a list of token ids")


def _messages(body: dict, msg: inference_pb2.GenerateRequest) -> None:
    """The messages' shape; their roles are checked where gRPC's are (request_builder)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "messages must be a non-empty list of {role, content}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}]", f"messages[{i}] must be an object with a string role")
        if m.get("tool_calls") or m.get("function_call"):
            raise bad(f"messages[{i}]", f"messages[{i}] holds tool calls: function calling is not supported "
                                        "by this node")
        content = m.get("content")
        if content is None:
            raise bad(f"messages[{i}].content", f"messages[{i}].content is required: a string or a list of "
                                                "text parts")
        if isinstance(content, list):  # content parts: text only
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, dict) else None
                    raise bad(f"messages[{i}].content[{j}]",
                              f"messages[{i}].content[{j}] is {_show(kind) if kind else 'not a text part'}: only "
                              "{\"type\": \"text\", \"text\": ...} parts are supported by this node")
                texts.append(part["text"])
            content = "".join(texts)
        elif not isinstance(content, str):
            raise bad(f"messages[{i}].content", f"messages[{i}].content must be a string or a list of text parts, "
                                                f"got {_show(content)}")
        msg.messages.add(role=m["role"], content=content)


def parse_request(body: Any, chat: bool, base_model: str, request_id: str = "",
                  max_model_len: int = 0) -> ApiRequest:
    """A completion (chat=False) or chat completion request as the node's GenerateRequest.

    Defaults are the OpenAI API's: temperature 1, top_p 1, max_tokens absent = the node's
    default (--default-max-tokens, cut to the context). `ignore_eos` and `top_k` are accepted
    as extensions (as vLLM does). Integers are bounded here, before protobuf holds them;
    the ranges both APIs share (temperature, top_p, roles, the context) are request_builder's."""
    if not isinstance(body, dict):
        raise bad("body", "the request body must be a JSON object")
    n = _int(body, "n", 1, low=1, high=MAX_N)
    _refuse_unsupported(body, chat, n)
    msg = inference_pb2.GenerateRequest(adapter=resolve_model(body.get("model"), base_model),
                                        request_id=request_id)
    _logprobs(body, chat, msg)
    _response_format(body, msg)
    _stop_token_ids(body, msg)
    if chat:
        _messages(body, msg)
    else:
        _prompt(body, msg)
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, name, 0, low=1, hint=" (leave it out for the node's default)")
    if max_tokens > INT32_MAX:  # more than protobuf holds; request_builder names the room left for less
        limit = f"{max_model_len} tokens of prompt + output (--max-model-len)" if max_model_len else "its context"
        raise bad(name, f"{name} {max_tokens} does not fit: this node's limit is {limit}")
    msg.max_tokens = max_tokens
    msg.temperature = _number(body, "temperature", 1.0)
    msg.top_p = _number(body, "top_p", 1.0)
    top_k = _int(body, "top_k", 0, low=-1, high=INT32_MAX, hint=" (0 or -1: off)")
    msg.top_k = 0 if top_k == -1 else top_k   # vLLM spells "off" -1
    seed = _int(body, "seed", low=-(1 << 63), high=SEED_MODULUS - 1)
    if seed is not None:
        msg.seed = seed % SEED_MODULUS
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise bad("stop", "stop must be a string or a list of strings")
    msg.stop.extend(stop or [])
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise bad("ignore_eos", "ignore_eos must be true or false")
    msg.ignore_eos = ignore_eos
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad("stream", "stream must be true or false")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad("stream_options", "stream_options must be an object")
    include_usage = (options or {}).get("include_usage", False)
    if include_usage is not None and not isinstance(include_usage, bool):
        raise bad("stream_options", "stream_options.include_usage must be true or false")
    return ApiRequest(msg, body["model"], chat, bool(stream), bool(stream and include_usage), n)


# -- writing -------------------------------------------------------------------------------------
def token_text(data: bytes) -> str:
    """A token's text (a token holding part of a character shows U+FFFD for it)."""
    return data.decode("utf-8", errors="replace")


@dataclass
class AnswerState:
    """What a whole (non-streamed) answer has gathered so far."""

    texts: list[str] = field(default_factory=list)
    last: Chunk | None = None
    logprobs: list[dict[str, Any]] = field(default_factory=list)   # chat: content entries
    completion: dict[str, list] | None = None                       # completions: the four lists


class ResponseWriter:
    """The OpenAI objects of one request: whole responses, or stream chunks that share its id."""

    def __init__(self, request: ApiRequest, token_bytes: TokenBytes) -> None:
        self.request = request
        self.token_bytes = token_bytes
        self.id = f"{'chatcmpl' if request.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.answers = [AnswerState() for _ in range(request.n)]
        self._started: set[int] = set()      # streamed answers that sent their role
        self._finished: list[Chunk] = []     # streamed answers' last chunks

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.request.model}

    @staticmethod
    def usage(lasts: list[Chunk]) -> dict[str, Any]:
        """Prompt tokens once, completion tokens of every answer."""
        prompt = lasts[0].prompt_tokens
        completion = sum(last.completion_tokens for last in lasts)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": max(last.cached_prompt_tokens for last in lasts)}}

    # -- logprobs --------------------------------------------------------------------------------
    def _entry(self, token: int, logprob: float) -> dict[str, Any]:
        data = self.token_bytes(token)
        return {"token": token_text(data), "logprob": logprob, "bytes": list(data)}

    def chat_logprobs(self, chunk: Chunk) -> list[dict[str, Any]]:
        """The chunk's tokens as chat logprobs' content entries."""
        return [{**self._entry(token, logprob), "top_logprobs": [self._entry(t, v) for t, v in zip(ids, values)]}
                for token, (logprob, ids, values) in zip(chunk.token_ids, chunk.logprobs)]

    def completion_logprobs(self, chunk: Chunk) -> dict[str, list]:
        """The chunk's tokens as a completion's logprobs lists (the top alternatives with the
        sampled token among them)."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, (logprob, ids, values), offset in zip(chunk.token_ids, chunk.logprobs, chunk.text_offsets):
            text = token_text(self.token_bytes(token))
            out["tokens"].append(text)
            out["token_logprobs"].append(logprob)
            top = {token_text(self.token_bytes(t)): v for t, v in zip(ids, values)}
            top.setdefault(text, logprob)
            out["top_logprobs"].append(top)
            out["text_offset"].append(offset)
        return out

    def _chunk_logprobs(self, chunk: Chunk) -> dict[str, Any] | None:
        if chunk.logprobs is None or not chunk.token_ids:
            return None
        if self.request.chat:
            return {"content": self.chat_logprobs(chunk)}
        return self.completion_logprobs(chunk)

    # -- whole answers ---------------------------------------------------------------------------
    def add(self, chunk: Chunk) -> None:
        """Gathers a chunk of an answer that is not streamed."""
        answer = self.answers[chunk.index]
        answer.texts.append(chunk.text)
        if chunk.finish_reason is not None:
            answer.last = chunk
        if chunk.logprobs is None or not chunk.token_ids:
            return
        if self.request.chat:
            answer.logprobs += self.chat_logprobs(chunk)
        else:
            part = self.completion_logprobs(chunk)
            if answer.completion is None:
                answer.completion = part
            else:
                for key, values in part.items():
                    answer.completion[key] += values

    @property
    def done(self) -> bool:
        return all(answer.last is not None for answer in self.answers)

    def response(self) -> dict[str, Any]:
        """The whole answers (stream: false), once every one has its last chunk."""
        asked = self.request.generate.logprobs
        choices = []
        for index, answer in enumerate(self.answers):
            text = "".join(answer.texts)
            if self.request.chat:
                logprobs = {"content": answer.logprobs} if asked else None
                choices.append({"index": index, "message": {"role": "assistant", "content": text},
                                "logprobs": logprobs, "finish_reason": answer.last.finish_reason})
            else:
                logprobs = (answer.completion or {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                                  "text_offset": []}) if asked else None
                choices.append({"index": index, "text": text, "logprobs": logprobs,
                                "finish_reason": answer.last.finish_reason})
        lasts = [answer.last for answer in self.answers]
        head = self._head("chat.completion" if self.request.chat else "text_completion")
        return {**head, "choices": choices, "usage": self.usage(lasts),
                "system_fingerprint": lasts[0].adapter_version or None}

    # -- streams ---------------------------------------------------------------------------------
    @property
    def streamed_all(self) -> bool:
        """Every answer's last chunk has been written (stream: true)."""
        return len(self._finished) == self.request.n

    def chunks(self, chunk: Chunk) -> list[dict[str, Any]]:
        """The stream objects for one chunk of an answer (stream: true); after the last answer's
        last chunk, the usage when asked."""
        out = []
        usage = {"usage": None} if self.request.include_usage else {}
        index = chunk.index
        logprobs = self._chunk_logprobs(chunk)
        if self.request.chat:
            head = self._head("chat.completion.chunk")
            if index not in self._started:
                self._started.add(index)
                out.append({**head, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None}], **usage})
            if chunk.text or logprobs is not None:
                out.append({**head, "choices": [{"index": index, "delta": {"content": chunk.text},
                                                 "logprobs": logprobs, "finish_reason": None}], **usage})
            if chunk.finish_reason is not None:
                out.append({**head, "choices": [{"index": index, "delta": {}, "logprobs": None,
                                                 "finish_reason": chunk.finish_reason}], **usage})
        else:
            head = self._head("text_completion")
            if chunk.text or chunk.finish_reason is not None or logprobs is not None:
                out.append({**head, "choices": [{"index": index, "text": chunk.text, "logprobs": logprobs,
                                                 "finish_reason": chunk.finish_reason}], **usage})
        if chunk.finish_reason is not None:
            self._finished.append(chunk)
            if self.request.include_usage and len(self._finished) == self.request.n:
                out.append({**head, "choices": [], "usage": self.usage(self._finished)})
        return out


def model_list(base_model: str, created: int, adapters: list[tuple[str, int]]) -> dict[str, Any]:
    """GET /v1/models: the base model, then each adapter (its `parent` is the base model)."""
    data = [{"id": base_model, "object": "model", "created": created, "owned_by": OWNER, "root": base_model,
             "parent": None}]
    data += [{"id": name, "object": "model", "created": updated or created, "owned_by": OWNER,
              "root": base_model, "parent": base_model} for name, updated in adapters if name != base_model]
    return {"object": "list", "data": data}


def model_not_found(model: str, base_model: str) -> ApiError:
    return ApiError(404, f"the model {model!r} does not exist on this node: GET /v1/models lists the base "
                         f"model ({base_model}) and its adapters", param="model", code="model_not_found")
