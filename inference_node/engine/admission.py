"""What the engine takes in, decided on the caller's thread before a request reaches the loop:
a prompt that can never run is refused, a full node answers QueueFull and a draining one
NotStarted. The count of requests in flight is the one piece of engine state other threads
touch, so it has a lock of its own."""
from __future__ import annotations

import threading

from .config import EngineConfig
from .errors import InvalidRequest, NotStarted, QueueFull
from .request import Request


class Admission:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
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
        capacity = cfg.num_kv_blocks * cfg.block_size
        if prompt_len + 1 > capacity:
            raise InvalidRequest(f"the prompt needs {prompt_len + 1} KV slots; the whole KV "
                                 f"cache holds {capacity}")

    def finished(self) -> None:
        with self._lock:
            self._inflight -= 1

    @property
    def inflight(self) -> int:
        with self._lock:
            return self._inflight
