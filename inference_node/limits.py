"""Per-node request limits, checked before work reaches the engine.

Each refusal names the limit and the flag that sets it, so a client (or its operator) knows
whether to shorten the request or raise the limit: RESOURCE_EXHAUSTED for capacity (streams,
message size), INVALID_ARGUMENT for a request that no retry will make acceptable.
"""
from __future__ import annotations

from lora.v1 import inference_pb2

from .config import RequestLimits
from .request_builder import BadRequest


def check_message(msg: inference_pb2.GenerateRequest, limits: RequestLimits) -> None:
    """Cheap checks on the raw message, before any tokenizing (which costs CPU per character)."""
    if limits.max_tokens and msg.max_tokens > limits.max_tokens:
        raise BadRequest(f"max_tokens {msg.max_tokens} is above this node's limit of {limits.max_tokens} "
                         "(--max-tokens-limit); 0 asks for the default")
    chars = len(msg.prompt) if msg.prompt else sum(len(m.content) + len(m.role) for m in msg.messages)
    if limits.max_prompt_chars and chars > limits.max_prompt_chars:
        raise BadRequest(f"the prompt has {chars} characters; this node accepts at most "
                         f"{limits.max_prompt_chars} (--max-prompt-chars)")


def check_prompt_tokens(num_tokens: int, limits: RequestLimits) -> None:
    if limits.max_prompt_tokens and num_tokens > limits.max_prompt_tokens:
        raise BadRequest(f"the prompt has {num_tokens} tokens; this node accepts at most "
                         f"{limits.max_prompt_tokens} (--max-prompt-tokens)")


class StreamSlots:
    """Counts open generations, gRPC and HTTP alike (all on the front end's event loop, so no lock)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open = 0

    def try_acquire(self) -> bool:
        if self.limit and self.open >= self.limit:
            return False
        self.open += 1
        return True

    def release(self) -> None:
        self.open -= 1

    def refusal(self) -> str:
        return (f"this node serves at most {self.limit} concurrent Generate streams and HTTP completions "
                f"(--max-concurrent-streams) and all are in use; retry later")
