"""The wire between front ends and the engine core: ZeroMQ sockets carrying msgpack lists.

Front ends PUSH to the core's one PULL socket; the core PUSHes to each front end's own PULL
socket (learned from its HELLO). Nothing here imports torch, so front ends stay light.

To the core: [kind, frontend_id, payload]
  HELLO  payload: the front end's output address; answered by WELCOME with the core's limits
  ADD    payload: GenerateSpec.pack()
  ABORT  payload: a request id
  CALL   payload: [call_id, method, args]; answered in the next batch's replies
From the core: [WELCOME, info] or [BATCH, outputs, replies]
  outputs: [request_id, token_ids, finish_reason | None, error | None, cached_prompt_tokens,
            adapter_version] per request with news since the last batch; the first and the
            last of a request carry cached_prompt_tokens and adapter_version
  error:   [grpc status name, message, kind]; kind tells drains and cuts apart (ErrorKind)
  replies: [call_id, ok, result | [grpc status name, message]]
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

HELLO, ADD, ABORT, CALL = "hello", "add", "abort", "call"
WELCOME, BATCH = "welcome", "batch"


class ErrorKind:
    """Why a request ended with an error, beyond its status code."""

    FAILED = ""                 # anything else: the status says it
    NOT_STARTED = "not_started"  # a drain refused it before its first token: safe to retry
    CUT_SHORT = "cut_short"      # shutdown ended it after part of its answer was streamed
    NO_RETRY = "no_retry"        # asking this node again soon fails the same way (its store is down)


@dataclass(frozen=True)
class GenerateSpec:
    """A validated, tokenised request as the engine core takes it."""

    request_id: int
    prompt_token_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = False
    adapter: str = ""
    client_request_id: str = ""   # the caller's own id, for logs

    def pack(self) -> list[Any]:
        return [self.request_id, self.prompt_token_ids, self.max_tokens, self.temperature,
                self.top_p, self.top_k, self.seed, self.ignore_eos, self.adapter,
                self.client_request_id]

    @classmethod
    def unpack(cls, fields: list[Any]) -> "GenerateSpec":
        return cls(*fields)


@dataclass(frozen=True)
class CoreInfo:
    """What a front end needs to validate requests the way the engine would."""

    model_name: str
    checkpoint: str           # directory of the tokenizer and chat template
    vocab_size: int
    max_model_len: int        # prompt + output tokens
    kv_capacity_tokens: int   # the whole KV cache: no prompt may need more
    block_size: int
    lora_enabled: bool
    max_loras: int
    max_cpu_loras: int
    pid: int                  # the core process, watched by front ends


def pack(message: list[Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(data: bytes) -> list[Any]:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)
