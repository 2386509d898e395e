"""The wire between front ends and the engine core: ZeroMQ sockets carrying typed messages,
msgspec Structs encoded as MessagePack.

Front ends PUSH to the core's one PULL socket; the core PUSHes to each front end's own PULL
socket (learned from its Hello). Every message is one Struct of a tagged union, encoded as an
array (its tag first, then its fields in order: as compact as positional lists, and decoded
into typed objects that say what each field is). Nothing here imports torch, so front ends
stay light.

To the core (ToCore), each naming the front end it comes from:
  Hello  its output address; answered by Welcome with the core's limits (CoreInfo)
  Add    a GenerateSpec (n answers to one prompt: n engine requests, ids request_id ..
         request_id + n - 1, each streamed as its own)
  Abort  a request id
  Call   a method of the core's, run between steps; answered by a Reply in a later Batch
From the core (FromCore):
  Welcome  CoreInfo
  Batch    everything for one front end since the last step: an Output per request with
           news (the first and the last of a request carry cached_prompt_tokens and
           adapter_version; with logprobs asked, one TokenLogprobs per token id) and a Reply
           per finished call
"""
from __future__ import annotations

from typing import Any, Union

import msgspec


class ErrorKind:
    """Why a request ended with an error, beyond its status code."""

    FAILED = ""                 # anything else: the status says it
    NOT_STARTED = "not_started"  # a drain refused it before its first token: safe to retry
    CUT_SHORT = "cut_short"      # shutdown ended it after part of its answer was streamed
    NO_RETRY = "no_retry"        # asking this node again soon fails the same way (its store is down)


class WireError(msgspec.Struct, array_like=True, frozen=True):
    """An error that ended a request or a call: its gRPC status by name, and its kind."""

    code: str
    message: str
    kind: str = ErrorKind.FAILED


# A sampled token's log-probability, and the most likely tokens at its position with theirs
# (most likely first): what a request that asks for logprobs gets beside each token, built
# by the engine and sent as it is.
TokenLogprobs = tuple[float, list[int], list[float]]
MAX_TOP_LOGPROBS = 20   # most likely alternatives a request may ask for at each position


class GenerateSpec(msgspec.Struct, array_like=True, frozen=True):
    """A validated, tokenised request as the engine core takes it."""

    request_id: int
    prompt_token_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Union[int, None] = None
    ignore_eos: bool = False
    adapter: str = ""
    client_request_id: str = ""   # the caller's own id, for logs
    n: int = 1                    # answers to this prompt (engine requests request_id + 0..n-1)
    logprobs: int = -1            # -1: none; k >= 0: each token's log-probability and the top k
    stop_token_ids: list[int] = []
    grammar: str = ""             # structured output: an llguidance grammar ("" for none)


class CoreInfo(msgspec.Struct, frozen=True):
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
    device: str               # cuda or cpu: the launcher sizes its front ends by it


# -- to the core --------------------------------------------------------------------------------
class Hello(msgspec.Struct, tag="hello", array_like=True, frozen=True):
    frontend: str
    address: str


class Add(msgspec.Struct, tag="add", array_like=True, frozen=True):
    frontend: str
    spec: GenerateSpec


class Abort(msgspec.Struct, tag="abort", array_like=True, frozen=True):
    frontend: str
    request_id: int


class Call(msgspec.Struct, tag="call", array_like=True, frozen=True):
    frontend: str
    call_id: int
    method: str
    args: dict[str, Any] = {}


ToCore = Union[Hello, Add, Abort, Call]


# -- from the core ------------------------------------------------------------------------------
class Output(msgspec.Struct, array_like=True, gc=False):
    """One request's news since the previous batch."""

    request_id: int
    token_ids: list[int]
    finish_reason: Union[str, None] = None
    error: Union[WireError, None] = None
    cached_prompt_tokens: int = 0
    adapter_version: str = ""
    logprobs: Union[list[TokenLogprobs], None] = None   # beside token_ids, when asked


class Reply(msgspec.Struct, array_like=True):
    """A call's result, or the error it ended with."""

    call_id: int
    result: Any = None
    error: Union[WireError, None] = None


class Welcome(msgspec.Struct, tag="welcome", array_like=True, frozen=True):
    info: CoreInfo


class Batch(msgspec.Struct, tag="batch", array_like=True):
    outputs: list[Output]
    replies: list[Reply]


FromCore = Union[Welcome, Batch]


def encoder() -> msgspec.msgpack.Encoder:
    """An encoder for one thread's messages (each thread that sends keeps its own)."""
    return msgspec.msgpack.Encoder()


def core_decoder() -> msgspec.msgpack.Decoder:
    """Decodes what front ends send (ToCore)."""
    return msgspec.msgpack.Decoder(ToCore)


def frontend_decoder() -> msgspec.msgpack.Decoder:
    """Decodes what the core sends (FromCore)."""
    return msgspec.msgpack.Decoder(FromCore)
