"""bench.tp_bench on CPU (gloo): one node per tensor-parallel size, its full-batch decode steps
timed and tabled side by side (the numbers are meaningless on CPU; the path is the GPU's)."""
from __future__ import annotations

import sys
import time

import pytest

from bench import tp_bench


def test_tp_bench_times_full_batch_decode_steps_at_each_size(tmp_path, capsys):
    results = tp_bench.main(["--device", "cpu", "--shape", "tiny", "--tp", "1,2", "--batch", "4",
                             "--output", "12", "--rounds", "1", "--rows", "base,c2", "--workdir", str(tmp_path),
                             # one bandwidth for every size: a busy CPU's measurements would order the floors
                             "--copy-bandwidth", "1e10"])
    assert [(r["tp"], r["row"]) for r in results] == [(1, "base"), (1, "c2"), (2, "base"), (2, "c2")]
    for r in results:  # every answer's steps after the first few were decodes of the whole batch
        assert r["steps"] >= 8 and r["step_ms"] > 0 and r["tok_s"] > 0
    floors = {(r["tp"], r["row"]): r["floor_ms"] for r in results}
    # Without an all-reduce report a rank's floor is its bytes alone: each rank reads its part.
    assert 0 < floors[(2, "base")] < floors[(1, "base")] < floors[(1, "c2")]
    table = capsys.readouterr().out
    assert "| 2 | c2 |" in table and "× tp 1 step" in table


def test_tp_bench_builds_the_node_once_per_mode_and_labels_its_rows(tmp_path, capsys):
    results = tp_bench.main(["--device", "cpu", "--shape", "tiny", "--tp", "1", "--batch", "4",
                             "--output", "12", "--rounds", "1", "--rows", "c2", "--workdir", str(tmp_path),
                             "--mode", "default", "--mode", "side_expand_segments=0/fold_groups=none"])
    assert [r["row"] for r in results] == ["c2", "c2@side_expand_segments=0/fold_groups=none"]
    assert all(r["floor_ms"] > 0 for r in results)  # a mode's row has its row's floor
    assert "| 1 | c2@side_expand_segments=0/fold_groups=none |" in capsys.readouterr().out


def test_a_mode_names_tuning_choices() -> None:
    assert tp_bench.mode_choices("default") == {}
    assert tp_bench.mode_choices("pdl=off/fold_tilings=o=16.128.4") == {"pdl": "off", "fold_tilings": "o=16.128.4"}


def test_a_size_whose_node_hangs_while_stopping_keeps_its_rows_and_is_killed() -> None:
    """Each size runs in a child; one stuck in teardown (NCCL's, on GPUs) is killed after a
    bounded wait instead of holding up the sizes after it."""
    hang = ("import sys, time; print('a log line'); print('@rows ' + '[{\"tp\": 2}]', flush=True); "
            "time.sleep(120)")
    started = time.monotonic()
    rows = tp_bench.run_child([], "2,nccl,default", wait_s=1.0, command=(sys.executable, "-c", hang))
    assert rows == [{"tp": 2}] and time.monotonic() - started < 30
    with pytest.raises(SystemExit, match="gave no rows"):
        tp_bench.run_child([], "2,nccl,default", command=(sys.executable, "-c", "raise SystemExit(3)"))
