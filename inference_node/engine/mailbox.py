"""The engine loop's commands: other threads put them, the loop takes them between steps, so
nothing the loop owns needs a lock."""
from __future__ import annotations

import queue
from typing import Any, Iterator


class Mailbox:
    def __init__(self) -> None:
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue()

    def put(self, command: tuple[str, Any]) -> None:
        self._queue.put(command)

    def empty(self) -> bool:
        return self._queue.empty()

    def take(self, block: bool, timeout: float) -> Iterator[tuple[str, Any]]:
        """Every command queued now (waiting up to timeout for the first where block), in order."""
        try:
            yield self._queue.get(timeout=timeout) if block else self._queue.get_nowait()
        except queue.Empty:
            return
        while True:
            try:
                yield self._queue.get_nowait()
            except queue.Empty:
                return
