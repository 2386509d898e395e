"""Checks a GenerateRequest and turns it into what the engine core takes (INVALID_ARGUMENT on
bad input), in the front end: the engine never sees a request it would refuse as malformed."""
from __future__ import annotations

import math
import re

from lora.v1 import inference_pb2

from .core.protocol import MAX_TOP_LOGPROBS, CoreInfo, GenerateSpec
from .tokenizer import ChatTemplateError, TextCodec

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_PROMPT_CHARS = 1 << 20
ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MAX_TEMPERATURE = 2.0   # the OpenAI API's range, on both APIs: a larger one samples noise
# Chat roles the node renders; "developer" is OpenAI's newer name for a system message.
CHAT_ROLES = ("system", "developer", "user", "assistant")


class BadRequest(ValueError):
    """A client error; the message is shown to the caller, `param` names the field at fault
    (the OpenAI API's error `param`)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def check_role(role: str, index: int) -> str:
    """The role the chat template is given for a message of `role` (developer -> system)."""
    if role in ("tool", "function"):
        raise BadRequest(f"messages[{index}] has role {role!r}: tool results are not supported by this node "
                         "(it does no function calling)", param=f"messages[{index}].role")
    if role not in CHAT_ROLES:
        raise BadRequest(f"messages[{index}] has role {role!r}; the roles are {', '.join(CHAT_ROLES)}",
                         param=f"messages[{index}].role")
    return "system" if role == "developer" else role


def output_budget(asked: int, prompt_len: int, max_model_len: int, default: int) -> int:
    """The tokens a request may generate. An explicit max_tokens that the context cannot hold
    is refused, never quietly shortened: a client asking for 10**9 tokens would otherwise hold
    a sequence slot until the context is full. 0 takes the default, cut to what is left."""
    room = max_model_len - prompt_len
    if asked > room:
        raise BadRequest(f"max_tokens {asked} does not fit: this node's limit is {max_model_len} tokens of "
                         f"prompt + output (--max-model-len) and the prompt has {prompt_len}, so at most "
                         f"{room} (0 asks for the default)", "max_tokens")
    return asked or min(default, room)


def build_request(msg: inference_pb2.GenerateRequest, codec: TextCodec, core: CoreInfo,
                  default_max_tokens: int, request_id: int, grammar: str = "",
                  n: int = 1) -> tuple[GenerateSpec, tuple[str, ...]]:
    """The engine's request and the stop strings the front end watches for. grammar: the
    response format's (frontend/response_format.py, "" for none); n: answers to the prompt
    (engine requests request_id .. request_id + n - 1)."""
    vocab_size, max_model_len = core.vocab_size, core.max_model_len
    if msg.adapter and not ADAPTER_NAME.match(msg.adapter):
        raise BadRequest("adapter names are 1-128 characters of letters, digits, '.', '_' and '-', "
                         "starting with a letter or digit", "model")
    if msg.max_tokens < 0:
        raise BadRequest(f"max_tokens must be >= 0 (0 means the default), got {msg.max_tokens}", "max_tokens")
    if not math.isfinite(msg.temperature) or not 0.0 <= msg.temperature <= MAX_TEMPERATURE:
        raise BadRequest(f"temperature must be in [0, {MAX_TEMPERATURE:g}] (0 means greedy), got {msg.temperature:g}",
                         "temperature")
    if not math.isfinite(msg.top_p) or not 0.0 <= msg.top_p <= 1.0:
        raise BadRequest(f"top_p must be in [0, 1] (0 or 1 means off), got {msg.top_p:g}", "top_p")
    if msg.top_k < 0:
        raise BadRequest(f"top_k must be >= 0 (0 means off), got {msg.top_k}", "top_k")
    if len(msg.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in msg.stop):
        raise BadRequest(f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_CHARS} characters", "stop")
    if not 0 <= msg.top_logprobs <= MAX_TOP_LOGPROBS:
        raise BadRequest(f"top_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {msg.top_logprobs}",
                         "top_logprobs")
    if msg.top_logprobs and not msg.logprobs:
        raise BadRequest("top_logprobs needs logprobs set to true", "top_logprobs")
    if len(msg.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise BadRequest(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(msg.stop_token_ids)}", "stop_token_ids")
    outside = [t for t in msg.stop_token_ids if not 0 <= t < vocab_size]
    if outside:
        raise BadRequest(f"stop_token_ids holds ids outside the vocabulary [0, {vocab_size}), e.g. {outside[0]}",
                         "stop_token_ids")
    if grammar and msg.ignore_eos:
        raise BadRequest("ignore_eos cannot be used with a response_format: a constrained answer ends when its "
                         "JSON is whole", "ignore_eos")

    if msg.prompt_token_ids:
        ids = list(msg.prompt_token_ids)
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise BadRequest(f"prompt_token_ids holds {len(bad)} ids outside the vocabulary "
                             f"[0, {vocab_size}), e.g. {bad[0]}", "prompt")
    elif msg.messages:
        messages = [{"role": check_role(m.role, i), "content": m.content} for i, m in enumerate(msg.messages)]
        try:
            ids = codec.encode_chat(messages)
        except ChatTemplateError as exc:
            raise BadRequest(str(exc), "messages") from exc
    elif msg.prompt:
        if len(msg.prompt) > MAX_PROMPT_CHARS:
            raise BadRequest(f"the prompt has {len(msg.prompt)} characters; the limit is {MAX_PROMPT_CHARS}")
        ids = codec.encode(msg.prompt)
    else:
        raise BadRequest("the request has no prompt: set prompt, messages or prompt_token_ids")
    if not ids:
        raise BadRequest("the prompt encodes to no tokens")
    if len(ids) >= max_model_len:
        raise BadRequest(f"the prompt has {len(ids)} tokens; the limit is {max_model_len - 1}")
    if len(ids) + 1 > core.kv_capacity_tokens:
        raise BadRequest(f"the prompt needs {len(ids) + 1} KV slots; the whole KV cache holds "
                         f"{core.kv_capacity_tokens}")

    max_tokens = output_budget(msg.max_tokens, len(ids), max_model_len, default_max_tokens)
    top_p = msg.top_p if msg.top_p > 0 else 1.0
    spec = GenerateSpec(request_id=request_id, prompt_token_ids=ids, max_tokens=max_tokens,
                        temperature=msg.temperature, top_p=top_p, top_k=msg.top_k,
                        seed=msg.seed if msg.HasField("seed") else None, ignore_eos=msg.ignore_eos,
                        adapter=msg.adapter, client_request_id=msg.request_id, n=n,
                        logprobs=msg.top_logprobs if msg.logprobs else -1,
                        stop_token_ids=list(dict.fromkeys(msg.stop_token_ids)), grammar=grammar)
    return spec, tuple(s for s in msg.stop if s)
