"""Which resident adapters leave the GPU first when memory is wanted: the eviction policies.

A policy gives each resident adapter a value; the adapter manager evicts the cheapest (the
lowest total value among those whose rows make the room, arena.RowArena.window).

- `lru`: the time of its last request. Plain least recently used.
- `gdsf`: GreedyDual-Size-Frequency (Cherkasova, 1998): L + requests / size, where requests
  counts those bound since it came onto the GPU, size is its GPU bytes, and L is the value of
  the last adapter evicted (so values of adapters long idle age against newcomers). Under a
  skewed (Zipf) popularity with mixed ranks it keeps the small popular adapters and lets a
  large rarely used one go first, which LRU does not see: `python -m bench.adapters churn` compares both.
"""
from __future__ import annotations

import time
from typing import Protocol

POLICIES = ("lru", "gdsf")


class Evictable(Protocol):
    last_used: float
    hits: int
    value: float
    gpu_nbytes: int


class EvictionPolicy(Protocol):
    name: str

    def placed(self, entry: Evictable) -> None:
        """The adapter came onto the GPU."""

    def touched(self, entry: Evictable) -> None:
        """A request bound to it."""

    def evicted(self, entry: Evictable) -> None:
        """It left the GPU."""

    def value(self, entry: Evictable) -> float:
        """What keeping it is worth (>= 0): the cheapest goes first."""


class LeastRecentlyUsed:
    name = "lru"

    def __init__(self) -> None:
        self.start = time.monotonic()

    def placed(self, entry: Evictable) -> None:
        return None

    def touched(self, entry: Evictable) -> None:
        return None

    def evicted(self, entry: Evictable) -> None:
        return None

    def value(self, entry: Evictable) -> float:
        return max(0.0, entry.last_used - self.start)


class GreedyDualSizeFrequency:
    name = "gdsf"

    def __init__(self) -> None:
        self.clock = 0.0  # L: the value of the last adapter evicted

    def _update(self, entry: Evictable) -> None:
        entry.value = self.clock + entry.hits / max(entry.gpu_nbytes / 1e6, 1e-6)

    def placed(self, entry: Evictable) -> None:
        entry.hits = max(entry.hits, 1)
        self._update(entry)

    def touched(self, entry: Evictable) -> None:
        entry.hits += 1
        self._update(entry)

    def evicted(self, entry: Evictable) -> None:
        self.clock = max(self.clock, entry.value)
        entry.hits = 0

    def value(self, entry: Evictable) -> float:
        return entry.value


def make_policy(name: str) -> EvictionPolicy:
    if name == "lru":
        return LeastRecentlyUsed()
    if name == "gdsf":
        return GreedyDualSizeFrequency()
    raise ValueError(f"unknown adapter eviction policy {name!r}; choose one of {', '.join(POLICIES)}")
