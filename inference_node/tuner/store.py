"""Where the node's tuning tables come from, torch-free: the seeds kept in the repository
(kernels/configs/), then the tables the node tuned for itself in its cache directory, else a
tuning now, within a budget, under a lock so that nodes starting together on one host tune a
key once. A table that cannot be read, or that is for another key, is refused with a warning
and never used.

Seeds are version-free: each was measured and reviewed with the code it ships with, and every
choice in it is a launch parameter the node's kernels take on any torch or Triton (a tiling
that does not fit falls back by itself), so a newer compiler can cost it speed but never
correctness; the tool re-makes them when the pinned versions move. A cached table was made by
a node on its own, unreviewed: it is used only by the torch and Triton it was tuned with,
and re-tuned when they change.
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from kernels.tuning_table import TableKey, TuningTable, TuningTableError

log = logging.getLogger(__name__)

LOCK_MARGIN_S = 120.0  # waited beyond the other node's budget: its last case, its write


@dataclass(frozen=True)
class Found:
    """The table a node runs with and where it came from: "seed" (the repository's), "cache"
    (tuned before, by this or another node), "tuned" (now), "given" (--tuning-table PATH), or
    none: "defaults" (none found, none tuned) or "off"."""

    table: TuningTable | None
    source: str
    seconds: float = 0.0          # tuning time spent at this start ("tuned")

    def describe(self) -> str:
        if self.table is None:
            return f"{'off' if self.source == 'off' else 'none'}: default launch choices"
        how = f"tuned now in {self.seconds:.0f} s" if self.source == "tuned" else self.source
        return f"{self.table.path} ({how})"


def usable(path: Path, key: TableKey, check_versions: bool) -> TuningTable | None:
    """The table in `path` if it is `key`'s; None where there is no file, and a warning where
    it is unreadable, malformed, or another key's (it is then never used)."""
    if not path.is_file():
        return None
    try:
        table = TuningTable.read(path)
    except TuningTableError as exc:
        log.warning("%s: refused, not used", exc)
        return None
    why = table.refusal(key, check_versions)
    if why is not None:
        log.warning("tuning table %s refused, not used: %s", path, why)
        return None
    return table


def lookup(key: TableKey, seeds: Path, cache: Path | None) -> Found | None:
    """The seed filed for `key` (versions not checked), else the cached one (versions checked)."""
    seed = usable(seeds / key.name, key, check_versions=False)
    if seed is not None:
        return Found(seed, "seed")
    if cache is not None:
        cached = usable(cache / key.name, key, check_versions=True)
        if cached is not None:
            return Found(cached, "cache")
    return None


@contextlib.contextmanager
def exclusive(path: Path, wait_s: float, poll_s: float = 0.5,
              clock: Callable[[], float] = time.monotonic,
              sleep: Callable[[float], None] = time.sleep,
              waiting: Callable[[], None] = lambda: None) -> Iterator[bool]:
    """Holds the lock file `path` (an advisory flock: released when its holder exits, however
    it exits) while the block runs; yields False where another holder kept it `wait_s`
    (`waiting` is called once, when the first try finds it held)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        deadline = clock() + wait_s
        tries = 0
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = True
                break
            except BlockingIOError:
                if tries == 0:
                    waiting()
                tries += 1
                if clock() >= deadline:
                    held = False
                    break
                sleep(poll_s)
        try:
            yield held
        finally:
            if held:
                fcntl.flock(f, fcntl.LOCK_UN)


def table_at_start(key: TableKey, seeds: Path, cache: Path, budget_s: float,
                   tune: Callable[[float], TuningTable] | None, why_not: str = "",
                   clock: Callable[[], float] = time.monotonic, wait_s: float | None = None) -> Found:
    """The table a node starting with `--tuning-table auto` runs with: the seed, else the
    cached table, else one tuned now within `budget_s` seconds (`tune(budget_s)`), stored in
    `cache` and used from then on. Defaults (no table) where the budget is 0, where tuning
    cannot run here (`tune` None: `why_not` says why, in an info line; the sweep raising
    TuningUnavailable or failing: a warning, nothing stored), or where another node has held
    this key's lock for longer than its budget and a margin, or where `cache` cannot be
    written (a table tuned now could be kept nowhere)."""
    found = lookup(key, seeds, cache)
    if found is not None:
        return found
    if budget_s <= 0:
        log.info("no tuning table for %s, and --tune-budget 0: default launch choices", key)
        return Found(None, "defaults")
    if tune is None:
        log.info("no tuning table for %s: default launch choices (%s)", key, why_not)
        return Found(None, "defaults")
    lock = cache / f"{key.name}.lock"
    try:
        cache.mkdir(parents=True, exist_ok=True)
        with open(lock, "a"):
            pass
    except OSError as exc:  # a table tuned now could be kept nowhere: every start would tune again
        log.warning("cannot keep tuning tables in %s (%s): default launch choices (--tuning-cache-dir names "
                    "a writable folder)", cache, exc)
        return Found(None, "defaults")
    wait = budget_s + LOCK_MARGIN_S if wait_s is None else wait_s
    def waiting() -> None:
        log.info("another node is tuning kernels for %s (lock %s): waiting for its table, up to %.0f s",
                 key, lock, wait)

    with exclusive(lock, wait, clock=clock, waiting=waiting) as held:
        if not held:
            log.warning("another node has been tuning kernels for %s for over %.0f s (lock %s): default "
                        "launch choices", key, wait, lock)
            return Found(None, "defaults")
        cached = usable(cache / key.name, key, check_versions=True)
        if cached is not None:  # tuned by the node that held the lock
            return Found(cached, "cache")
        log.info("no tuning table for %s: tuning its kernels now, within %.0f s (--tune-budget; "
                 "`inference-node tune` does it ahead of time)", key, budget_s)
        started = clock()
        try:
            table = tune(budget_s)
            path = cache / key.name
            table.write(path)
            table = TuningTable.read(path)
        except Exception as exc:  # no Triton, a launch the device refuses, a full disk
            log.warning("tuning kernels for %s failed (%s: %s): default launch choices, nothing stored",
                        key, type(exc).__name__, exc)
            return Found(None, "defaults")
        if table.unmeasured:
            log.warning("the tuning budget (%.0f s) left %d of its cases unmeasured: steps of those "
                        "sizes take the nearest bucket measured, or the defaults (`inference-node tune "
                        "--budget-s` measures them)", budget_s, len(table.unmeasured))
        return Found(table, "tuned", clock() - started)
