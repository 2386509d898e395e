"""Runs of rank rows in one module's arena: which adapter slot holds which rows.

Every adapter holds one contiguous run per module it targets, as long as its rank, so the
kernels find its rows from (rank, first row) alone (kernels/lora/rows.py). Free runs are
taken best fit (the smallest gap that holds the run), which keeps large gaps for large ranks.
When no gap is long enough, `window` finds the run of rows whose holders cost least to evict
(free rows cost nothing), so fragmentation is paid for by evicting idle adapters, never by
moving one a running request reads.
"""
from __future__ import annotations

import bisect
from typing import Callable

# An owner's eviction cost; None: it may not be evicted for this placement.
Cost = Callable[[int], "float | None"]


class RowArena:
    def __init__(self, rows: int) -> None:
        self.rows = rows
        self._firsts: list[int] = []            # sorted first rows of the runs
        self._runs: dict[int, tuple[int, int, int]] = {}  # first -> (first, length, owner)
        self._of: dict[int, int] = {}           # owner -> its run's first row

    @property
    def used(self) -> int:
        return sum(length for _, length, _ in self._runs.values())

    def run_of(self, owner: int) -> tuple[int, int] | None:
        """(first row, length) of an owner's run, or None."""
        first = self._of.get(owner)
        return None if first is None else self._runs[first][:2]

    def runs(self) -> list[tuple[int, int, int]]:
        """(first, length, owner) of every run, in row order."""
        return [self._runs[f] for f in self._firsts]

    def gaps(self) -> list[tuple[int, int]]:
        """(first, length) of every free run, in row order."""
        gaps, at = [], 0
        for first in self._firsts:
            if first > at:
                gaps.append((at, first - at))
            at = first + self._runs[first][1]
        if at < self.rows:
            gaps.append((at, self.rows - at))
        return gaps

    def fit(self, length: int) -> int | None:
        """The first row of the smallest free run that holds `length` rows, or None."""
        best = None
        for first, gap in self.gaps():
            if gap >= length and (best is None or gap < best[1]):
                best = (first, gap)
        return None if best is None else best[0]

    def take(self, owner: int, first: int, length: int) -> None:
        assert owner not in self._of, f"slot {owner} already holds rows"
        assert 0 <= first and first + length <= self.rows, "run outside the arena"
        i = bisect.bisect_left(self._firsts, first)
        if i > 0:
            prev = self._runs[self._firsts[i - 1]]
            assert prev[0] + prev[1] <= first, "run overlaps the one before it"
        if i < len(self._firsts):
            assert first + length <= self._firsts[i], "run overlaps the one after it"
        self._firsts.insert(i, first)
        self._runs[first] = (first, length, owner)
        self._of[owner] = first

    def free(self, owner: int) -> None:
        first = self._of.pop(owner, None)
        if first is None:
            return
        del self._runs[first]
        self._firsts.pop(bisect.bisect_left(self._firsts, first))

    def window(self, length: int, cost: Cost) -> tuple[int, list[int]] | None:
        """(first row, owners to evict) of the run of `length` rows whose owners cost least in
        total to evict, or None when every such run holds an owner that may not go. A free run
        costs nothing, so a gap that fits wins."""
        if length > self.rows:
            return None
        runs = self.runs()
        ends = [f + n for f, n, _ in runs]
        costs = [cost(owner) for _, _, owner in runs]
        candidates = {0, *(f for f, _, _ in runs), *ends}
        best: tuple[float, int, int, list[int]] | None = None
        for start in sorted(candidates):
            stop = start + length
            if stop > self.rows:
                break
            lo = bisect.bisect_right(ends, start)       # first run ending after `start`
            hi = bisect.bisect_left(self._firsts, stop)  # first run starting at or after `stop`
            if any(costs[i] is None for i in range(lo, hi)):
                continue
            total = sum(costs[i] for i in range(lo, hi))
            key = (total, hi - lo, start)
            if best is None or key < best[:3]:
                best = (total, hi - lo, start, [runs[i][2] for i in range(lo, hi)])
        return None if best is None else (best[2], best[3])
