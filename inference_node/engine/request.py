"""A generation request as the engine tracks it, and the events it streams back."""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .detokenizer import TextStream

_ids = itertools.count(1)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class StreamEvent:
    """New tokens and text of one request since its previous event; `finish_reason` on the last."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    adapter_version: str = ""
    error: BaseException | None = None


@dataclass(eq=False)
class Request:
    prompt_token_ids: list[int]
    params: SamplingParams
    emit: Callable[[StreamEvent], None]
    adapter: str = ""
    request_id: str = ""
    id: int = field(default_factory=lambda: next(_ids))
    arrival: float = field(default_factory=time.monotonic)

    status: Status = Status.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # KV state: tokens whose KV is in the cache, and the blocks holding them.
    num_computed: int = 0
    block_ids: list[int] = field(default_factory=list)
    num_cached_prompt_tokens: int = 0
    # Prefix cache: the namespace fixed at first admission, the chain hashes of full blocks,
    # and how many leading blocks are already indexed.
    cache_namespace: str = ""
    block_hashes: list[bytes] = field(default_factory=list)
    num_indexed_blocks: int = 0
    # Streaming state: tokens already sent, and the text decoder.
    emitted_tokens: int = 0
    text: "TextStream | None" = None
    generator: torch.Generator | None = None
    # Set by the adapter layer: the slot and version this request is bound to while running.
    lora_slot: int = -1
    adapter_version: str = ""
    adapter_entry: Any = None
    preemptions: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, index: int) -> int:
        """all_token_ids[index] without building the joined list (a decode step asks this of
        every running request)."""
        prompt = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < prompt else self.output_token_ids[index - prompt]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def in_prefill(self) -> bool:
        """True while more than the last token still needs its KV computed."""
        return self.num_tokens - self.num_computed > 1
