"""A generation request as the engine tracks it, and the events it streams back."""
from __future__ import annotations

import enum
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..core.protocol import TokenLogprobs

log = logging.getLogger(__name__)
_ids = itertools.count(1)

# token_at's answer for a position whose token was sampled but is still on the device: the
# step that reads it takes it from the engine's device token buffer (TokenFeedback).
PENDING_TOKEN = -1


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: int = -1          # -1: none; k >= 0: each token's log-probability and the top k
    stop_token_ids: frozenset[int] = frozenset()   # end the answer like EOS (also with ignore_eos)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class StreamEvent:
    """New tokens of one request since its previous event; `finish_reason` on the last. The
    first and the last carry what the answer is computed with (cached prompt, adapter version)."""

    token_ids: list[int]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    adapter_version: str = ""
    error: BaseException | None = None
    logprobs: list[TokenLogprobs] | None = None   # one per token id, when the request asks


@dataclass(eq=False)
class Request:
    prompt_token_ids: list[int]
    params: SamplingParams
    emit: Callable[[StreamEvent], None]
    adapter: str = ""
    request_id: str = ""
    # Structured output: the grammar its answer must follow (llguidance's JSON; "" for none),
    # and once compiled its matcher (engine/grammar.py Grammar), which the loop moves on.
    grammar_source: str = ""
    grammar: Any = None
    # One of n answers to a prompt, after the first: it is admitted once `follows` (the first)
    # has its prompt's full blocks in the prefix cache, so it reuses them instead of computing
    # the prompt again (the scheduler drops the reference then).
    follows: "Request | None" = None
    id: int = field(default_factory=lambda: next(_ids))
    arrival: float = field(default_factory=time.monotonic)

    status: Status = Status.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # KV state: tokens whose KV is in the cache, and the blocks holding them.
    num_computed: int = 0
    block_ids: list[int] = field(default_factory=list)
    # Leading blocks given back behind a sliding window (BlockAllocator.released in block_ids).
    num_released_blocks: int = 0
    num_cached_prompt_tokens: int = 0
    # Prefix cache: the namespace fixed at first admission, the chain hashes of full blocks,
    # and how many leading blocks are already indexed.
    cache_namespace: str = ""
    block_hashes: list[bytes] = field(default_factory=list)
    num_indexed_blocks: int = 0
    # Streaming state: tokens already sent.
    emitted_tokens: int = 0
    generator: torch.Generator | None = None
    # Set by the adapter layer: the slot and version this request is bound to while running.
    lora_slot: int = -1
    adapter_version: str = ""
    adapter_entry: Any = None
    # Where its adapter was when the node first saw the request (gpu, host, disk, store; "?"
    # until a load from the source tells which): the adapter manager's tier hit counts.
    adapter_tier: str = ""
    preemptions: int = 0
    # Sampled tokens still on the device (the engine launches step n+1 before it reads step
    # n's tokens): they count in num_tokens and come after output_token_ids. feedback_row is
    # the newest one's row in the engine's device token buffer; last_token_pending says the
    # newest one ends the request by length, so it is not scheduled again.
    num_pending: int = 0
    feedback_row: int = -1
    last_token_pending: bool = False
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)   # beside output_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        """The tokens known on the host (the pending ones are not)."""
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, index: int) -> int:
        """all_token_ids[index] without building the joined list (a decode step asks this of
        every running request); PENDING_TOKEN for a token still on the device."""
        prompt = len(self.prompt_token_ids)
        if index < prompt:
            return self.prompt_token_ids[index]
        index -= prompt
        return self.output_token_ids[index] if index < len(self.output_token_ids) else PENDING_TOKEN

    @property
    def num_tokens(self) -> int:
        """Known and pending tokens: what the scheduler plans with."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    @property
    def num_known_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def in_prefill(self) -> bool:
        """True while more than the last token still needs its KV computed."""
        return self.num_tokens - self.num_computed > 1

    def computed(self, num_new_tokens: int) -> int:
        """A launched step computes num_new_tokens more of its KV: the prompt tokens among them."""
        prompt = max(0, min(num_new_tokens, len(self.prompt_token_ids) - self.num_computed))
        self.num_computed += num_new_tokens
        return prompt

    def sampling(self, row: int, max_model_len: int) -> None:
        """A launched step samples a token for it at feedback row `row`, known after the step."""
        self.num_pending += 1
        self.feedback_row = row
        self.last_token_pending = (len(self.output_token_ids) + self.num_pending >= self.params.max_tokens
                                   or self.num_tokens >= max_model_len)

    def stop_reason(self, eos_ids: frozenset[int], max_model_len: int) -> str | None:
        """Why the answer ends at its newest token ("stop", "length"), or None: it goes on."""
        token = self.output_token_ids[-1]
        if (token in eos_ids and not self.params.ignore_eos) or token in self.params.stop_token_ids:
            return "stop"
        if self.grammar is not None and self.grammar.complete:
            return "stop"  # the answer is whole: its grammar allows only the end of sequence
        if len(self.output_token_ids) >= self.params.max_tokens or self.num_known_tokens >= max_model_len:
            return "length"
        return None

    def stream(self, reason: str | None = None, error: BaseException | None = None) -> None:
        """Sends the tokens not streamed yet, and with `reason` the end of the answer."""
        new_ids = self.output_token_ids[self.emitted_tokens:]
        first = self.emitted_tokens == 0
        self.emitted_tokens = len(self.output_token_ids)
        event = StreamEvent(token_ids=new_ids, finish_reason=reason, error=error)
        if self.params.logprobs >= 0:
            event.logprobs = self.output_logprobs[len(self.output_token_ids) - len(new_ids):]
        if first or reason is not None:  # what the answer was computed with, known from its start
            event.cached_prompt_tokens = self.num_cached_prompt_tokens
            event.adapter_version = self.adapter_version
        if reason is not None:
            event.prompt_tokens = len(self.prompt_token_ids)
            event.completion_tokens = len(self.output_token_ids)
        if new_ids or reason is not None:
            try:
                self.emit(event)
            except Exception:  # a broken consumer must not stop the engine loop
                log.exception("request %s: emit failed", self.id)
