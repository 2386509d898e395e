"""What the engine takes in, decided on the caller's thread before a request reaches the loop:
a prompt that can never run is refused, a full node answers QueueFull and a draining one
NotStarted. The count of requests in flight is the one piece of engine state other threads
touch, so it has a lock of its own."""
from __future__ import annotations

import threading

from .config import EngineConfig
from .errors import InvalidRequest, NotStarted, QueueFull
from .request import Request


def kv_capacity_tokens(config: EngineConfig, window: int = 0) -> int:
    """The longest context (prompt and the token it samples) the KV cache can hold. With a
    window on every layer (`window`) a request holds its window and a chunk at most (blocks
    behind it go back as it moves, engine/scheduler.py): any length the model allows, where
    those fit."""
    capacity = config.num_kv_blocks * config.block_size
    if window and window + config.max_num_batched_tokens + 2 * config.block_size <= capacity:
        return max(capacity, config.max_model_len)
    return capacity


class Admission:
    def __init__(self, config: EngineConfig, window: int = 0) -> None:
        """window: the model's sliding window where every layer has one (0: none)."""
        self.config = config
        self.capacity_tokens = kv_capacity_tokens(config, window)
        self.accepting = True     # False once the node drains or shuts down
        self._inflight = 0
        self._lock = threading.Lock()

    def admit(self, request: Request) -> None:
        """Counts the request in flight, or raises why the node does not take it."""
        if not self.accepting:
            raise NotStarted("the node is draining and takes no new requests: retry on another node")
        self.validate(len(request.prompt_token_ids))
        with self._lock:
            if self._inflight >= self.config.max_queue + self.config.max_num_seqs:
                raise QueueFull(f"{self._inflight} requests in flight: the node's queue is full, "
                                "retry later")
            self._inflight += 1

    def validate(self, prompt_len: int) -> None:
        cfg = self.config
        if prompt_len == 0:
            raise InvalidRequest("the prompt is empty")
        if prompt_len >= cfg.max_model_len:
            raise InvalidRequest(f"the prompt has {prompt_len} tokens; this node's limit is "
                                 f"{cfg.max_model_len - 1} (max model length {cfg.max_model_len})")
        if prompt_len + 1 > self.capacity_tokens:
            raise InvalidRequest(f"the prompt needs {prompt_len + 1} KV slots; the whole KV "
                                 f"cache holds {self.capacity_tokens}")

    def finished(self) -> None:
        with self._lock:
            self._inflight -= 1

    @property
    def inflight(self) -> int:
        with self._lock:
            return self._inflight
