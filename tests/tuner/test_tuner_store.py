"""inference_node/tuner/store.py and the node's first start (no GPU: the sweep runs on the CPU
through the reference, timed by a fake timer and clock): a seed wins, then this host's cached
table; without either the node tunes within its budget, stores the table (atomically, under a
lock: two nodes starting together tune once) and the next start uses it without tuning; a
corrupt table, another key's, or one tuned with other torch/Triton versions is refused with a
warning and never used; where tuning cannot run (budget 0, no CUDA, no Triton, a failure
mid-sweep) the node runs the defaults and still starts."""
from __future__ import annotations

import dataclasses
import json
import logging
import re
import threading
import time
from pathlib import Path

import pytest
import torch

from inference_node.tuner import store
from inference_node.tuner.store import Found, exclusive, lookup, table_at_start
from inference_node.tuner.sweep import TuningError, TuningUnavailable
from inference_node.tuner.tune import tune_table, versions
from kernels.tuning_table import Bucket, ModelShape, TableKey, TuningTable

TINY = ModelShape(hidden=64, intermediate=160, heads=4, kv_heads=2, head_dim=16)  # tiny_llama's
KEY = TableKey("cpu", TINY, "float32", **versions())


class FakeTimer:
    """Deterministic, varied microseconds (so the sweep finds winners), each call moving the
    fake clock on by `cost_s` (a candidate's compile and timing on a GPU)."""

    def __init__(self, cost_s: float = 1.0) -> None:
        self.now, self.cost_s, self.calls = 0.0, cost_s, 0

    def clock(self) -> float:
        return self.now

    def __call__(self, calls_for, copies) -> float:
        self.calls += 1
        self.now += self.cost_s
        calls_for(copies[0])()  # it runs (the reference on the CPU)
        return 10.0 + self.calls % 7  # deterministic, varied


def small_tune(timer: FakeTimer | None = None, batches=(4, 1), adapters=(0,), **kw):
    """A tune(budget_s) as the node builds it (tune.node_tuner), on the CPU with a fake timer."""
    timer = timer or FakeTimer()
    calls = []

    def tune(budget_s: float) -> TuningTable:
        calls.append(budget_s)
        table, _ = tune_table(TINY, torch.device("cpu"), torch.float32, budget_s=budget_s, batches=batches,
                              adapters=adapters, timer=timer, clock=timer.clock, max_candidates=3,
                              produced_by="test", **kw)
        return table
    return tune, calls


def a_table(**changes) -> TuningTable:
    table = TuningTable("cpu", TINY, "float32", {}, (Bucket(4, 0, {"pdl": False}),), "test", versions(), 12.0)
    return dataclasses.replace(table, **changes)


def test_a_seed_wins_over_the_cache_and_neither_tunes(tmp_path: Path) -> None:
    seeds, cache = tmp_path / "seeds", tmp_path / "cache"
    a_table(produced_by="cached").write(cache / KEY.name)
    tune, calls = small_tune()
    found = table_at_start(KEY, seeds, cache, 60, tune)
    assert found.source == "cache" and found.table.produced_by == "cached" and calls == []
    assert found.describe() == f"{cache / KEY.name} (cache)"
    # A seed is version-free: one tuned with other versions (or none recorded) is still taken.
    a_table(produced_by="seed", versions={}).write(seeds / KEY.name)
    found = table_at_start(KEY, seeds, cache, 60, tune)
    assert found.source == "seed" and found.table.produced_by == "seed" and calls == []


def test_the_first_start_tunes_and_stores_and_the_second_uses_the_cache(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.INFO)
    timer = FakeTimer()
    tune, calls = small_tune(timer)
    first = table_at_start(KEY, tmp_path / "seeds", tmp_path / "cache", 600, tune, clock=timer.clock)
    assert first.source == "tuned" and calls == [600]
    assert first.table.path == tmp_path / "cache" / KEY.name and first.table.path.is_file()
    assert first.table.versions == versions() and first.table.dtype == "float32"
    assert first.table.tuning_s == pytest.approx(timer.calls * timer.cost_s)  # the fake clock's seconds
    assert first.seconds == pytest.approx(first.table.tuning_s)
    assert [(b.batch, b.adapters) for b in first.table.buckets] == [(1, 0), (4, 0)]
    assert "tuning its kernels now, within 600 s" in caplog.text
    # The progress line: 3 candidates of each of 3 groups (down's K takes no tiling) at 2 batches.
    assert f"tuning kernels for cpu {TINY.key} float32: 18/18 candidates, 582 s left" in caplog.text
    assert first.describe().endswith(f"(tuned now in {first.seconds:.0f} s)")
    assert list((tmp_path / "cache").glob("*.tmp")) == []  # written beside it, renamed over it
    timed = timer.calls
    again = table_at_start(KEY, tmp_path / "seeds", tmp_path / "cache", 600, tune, clock=timer.clock)
    assert again.source == "cache" and calls == [600] and timer.calls == timed  # no tuning
    assert again.table == first.table


@pytest.mark.parametrize("spoil, why", [
    (lambda path: path.write_text("{\"format\": 2, "), "cannot be read"),
    (lambda path: path.write_text(json.dumps({**a_table().to_json(), "buckets": [{"rows": 4}]})),
     r"buckets\[0\]: expected an object with batch"),
    (lambda path: a_table(shape=ModelShape(2048, 8192, 32, 8, 64)).write(path),
     f"refused, not used: it is for cpu h2048_i8192_q32_kv8_d64 float32, not cpu {TINY.key} float32"),
    (lambda path: a_table(dtype="bfloat16").write(path), "it is for cpu .* bfloat16, not"),
    (lambda path: a_table(device="NVIDIA H200").write(path), "it is for NVIDIA H200"),
    (lambda path: a_table(versions={"torch": "2.4.0", "triton": "3.0.0"}).write(path),
     "it was tuned with torch 2.4.0, triton 3.0.0; this node runs torch"),
    (lambda path: a_table(versions={}).write(path), "it was tuned with unrecorded versions"),
])
def test_a_cached_table_that_is_not_the_keys_is_refused_and_retuned(tmp_path: Path, caplog, spoil, why) -> None:
    caplog.set_level(logging.INFO)
    cache = tmp_path / "cache"
    cache.mkdir()
    spoil(cache / KEY.name)
    tune, calls = small_tune()
    found = table_at_start(KEY, tmp_path / "seeds", cache, 600, tune)
    assert found.source == "tuned" and calls == [600]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(cache / KEY.name) in w and "refused" in w for w in warnings), warnings
    assert any(re.search(why, w) for w in warnings), warnings
    assert found.table.refusal(KEY) is None  # replaced by the key's own
    assert TuningTable.read(cache / KEY.name).refusal(KEY) is None


def test_a_bad_seed_is_refused_and_the_cache_used(tmp_path: Path, caplog) -> None:
    seeds, cache = tmp_path / "seeds", tmp_path / "cache"
    seeds.mkdir()
    (seeds / KEY.name).write_text("not json")
    a_table(produced_by="cached").write(cache / KEY.name)
    found = lookup(KEY, seeds, cache)
    assert found.source == "cache" and found.table.produced_by == "cached"
    assert "cannot be read" in caplog.text and "refused, not used" in caplog.text


def test_where_tuning_cannot_run_the_node_takes_the_defaults(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.INFO)
    cache = tmp_path / "cache"
    tune, calls = small_tune()
    assert table_at_start(KEY, tmp_path, cache, 0, tune) == Found(None, "defaults")  # --tune-budget 0
    assert calls == [] and "--tune-budget 0: default launch choices" in caplog.text
    found = table_at_start(KEY, tmp_path, cache, 600, None, "cpu: launch choices are tuned on CUDA devices only")
    assert found == Found(None, "defaults") and found.describe() == "none: default launch choices"
    assert "(cpu: launch choices are tuned on CUDA devices only)" in caplog.text
    caplog.clear()

    def no_triton(budget_s: float) -> TuningTable:
        raise TuningUnavailable("Triton is not installed")

    assert table_at_start(KEY, tmp_path, cache, 600, no_triton) == Found(None, "defaults")
    assert [r.levelno for r in caplog.records if "Triton is not installed" in r.getMessage()] == [logging.WARNING]
    caplog.clear()

    def fails_midway(budget_s: float) -> TuningTable:
        raise TuningError("qkv batch 8: the default tiling (32, 64, 4) failed: ['rel err 1.0e+00']")

    assert table_at_start(KEY, tmp_path, cache, 600, fails_midway) == Found(None, "defaults")
    assert "tuning kernels for cpu" in caplog.text and "failed (TuningError: qkv batch 8" in caplog.text
    assert "nothing stored" in caplog.text
    assert not (cache / KEY.name).exists() and list(cache.glob("*.tmp")) == []


def test_a_cache_that_cannot_be_written_leaves_the_defaults_untuned(tmp_path: Path, caplog) -> None:
    (tmp_path / "file").write_text("not a folder")
    tune, calls = small_tune()
    found = table_at_start(KEY, tmp_path, tmp_path / "file" / "tuning", 600, tune)
    assert found == Found(None, "defaults") and calls == []
    assert f"cannot keep tuning tables in {tmp_path / 'file' / 'tuning'}" in caplog.text
    assert "--tuning-cache-dir names a writable folder" in caplog.text


def test_two_nodes_starting_together_tune_once(tmp_path: Path, caplog) -> None:
    """The second waits on the key's lock (saying so), then takes the table the first stored."""
    caplog.set_level(logging.INFO)
    cache = tmp_path / "cache"
    started, release = threading.Event(), threading.Event()
    tune, calls = small_tune()

    def slow(budget_s: float) -> TuningTable:
        started.set()
        assert release.wait(30)
        return tune(budget_s)

    found: dict[str, Found] = {}
    first = threading.Thread(target=lambda: found.setdefault("a", table_at_start(KEY, tmp_path, cache, 600, slow)))
    first.start()
    assert started.wait(30)
    second = threading.Thread(target=lambda: found.setdefault("b", table_at_start(KEY, tmp_path, cache, 600, slow)))
    second.start()
    time.sleep(0.3)
    assert second.is_alive()  # waiting for the lock, not tuning beside the first
    release.set()
    first.join(30)
    second.join(30)
    assert calls == [600]
    assert found["a"].source == "tuned" and found["b"].source == "cache"
    assert "another node is tuning kernels for cpu" in caplog.text and "waiting for its table" in caplog.text
    assert found["a"].table == found["b"].table


def test_a_node_waits_on_anothers_tuning_no_longer_than_its_budget(tmp_path: Path, caplog) -> None:
    cache = tmp_path / "cache"
    tune, calls = small_tune()
    with exclusive(cache / f"{KEY.name}.lock", 0) as held:
        assert held
        found = table_at_start(KEY, tmp_path, cache, 600, tune, wait_s=0.2)
    assert found == Found(None, "defaults") and calls == []
    assert "another node has been tuning kernels for cpu" in caplog.text


def test_a_table_is_written_whole_or_not_at_all(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / KEY.name
    a_table(produced_by="old").write(path)
    before = path.read_text()

    def broken(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr("os.replace", broken)
    with pytest.raises(OSError, match="disk full"):
        a_table(produced_by="new").write(path)
    assert path.read_text() == before and [p.name for p in tmp_path.iterdir()] == [KEY.name]


def test_the_budget_bounds_the_sweep_and_the_rest_is_recorded_unmeasured(caplog) -> None:
    """Each candidate costs 10 fake seconds; a 95 s budget starts no candidate after 95 s: the
    cases never started are the table's `unmeasured`, the progress lines count candidates and
    the seconds left, and the table's tuning time is what the sweep spent."""
    caplog.set_level(logging.INFO)
    timer = FakeTimer(cost_s=10.0)
    tune, _ = small_tune(timer, batches=(16, 4, 1))
    table = tune(95.0)
    assert timer.now <= 95 + 10  # at most one candidate past the budget
    assert table.tuning_s == pytest.approx(timer.now)
    measured = {(b.batch, b.adapters) for b in table.buckets}
    assert measured and (1, 0) not in measured  # the smallest batch comes last: cut
    assert table.unmeasured and all(batch in (1, 4) for group, batch, _ in table.unmeasured if group != "attention")
    assert ("attention", 8, 0) in table.unmeasured  # attention's launches come after every GEMM case
    progress = [r.getMessage() for r in caplog.records if "candidates," in r.getMessage()]
    assert progress and all(m.startswith(f"tuning kernels for cpu {TINY.key} float32: ") for m in progress)
    assert "s left" in progress[0]
    assert "the budget of 95 s is spent after" in caplog.text


def test_the_default_budget_tunes_one_shape_in_under_five_minutes() -> None:
    """The node's --tune-budget: no candidate starts after it, so a shape's tuning ends within
    it plus one candidate (seconds); the default leaves a minute of margin under 5 minutes."""
    from inference_node.config import NodeConfig

    assert 0 < NodeConfig().kernels.tune_budget <= 240
    assert store.LOCK_MARGIN_S >= 60
