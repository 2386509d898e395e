"""bench.tensor_parallel on the CPU. steps (gloo): one node per tensor-parallel size, its
full-batch decode steps timed and tabled beside each rank's floor; a size whose node hangs in
teardown is killed. allreduce (gloo, 2 processes): the table, sums verified on every rank, the
methods this machine lacks printed as n/a with their reason, a wrong sum stopping the run, and
the variables that keep NVLink multicast off."""
from __future__ import annotations

import datetime
import json
import os
import re
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from bench import tensor_parallel as tp


def test_steps_at_each_size_beside_their_floors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    results = tp.main(["steps", "--device", "cpu", "--model", "tiny", "--tp", "1,2", "--batch", "4", "--output", "12",
                       "--rounds", "1", "--rows", "base,c2", "--workdir", str(tmp_path),
                       # one bandwidth for every size: a busy CPU's measurements would order the floors
                       "--copy-bandwidth", "1e10"])
    assert [(r["tp"], r["row"]) for r in results] == [(1, "base"), (1, "c2"), (2, "base"), (2, "c2")]
    for r in results:  # every answer's steps after the first few were decodes of the whole batch
        assert r["steps"] >= 8 and r["step_ms"] > 0 and r["tok_s"] > 0
    floors = {(r["tp"], r["row"]): r["floor_ms"] for r in results}
    # Without an all-reduce report a rank's floor is its bytes alone: each rank reads its part.
    assert 0 < floors[(2, "base")] < floors[(1, "base")] < floors[(1, "c2")]
    assert results[2]["floor_note"] and not results[0]["floor_note"]
    out = capsys.readouterr().out
    assert "x tp1" in out and any(line.split()[:2] == ["2", "c2"] for line in out.splitlines())


def test_steps_build_the_node_once_per_mode_and_label_its_rows(tmp_path: Path) -> None:
    results = tp.main(["steps", "--device", "cpu", "--model", "tiny", "--tp", "1", "--batch", "4", "--output", "12",
                       "--rounds", "1", "--rows", "c2", "--workdir", str(tmp_path), "--mode", "default",
                       "--mode", "side_expand_segments=0/fold_groups=none"])
    assert [r["row"] for r in results] == ["c2", "c2@side_expand_segments=0/fold_groups=none"]
    assert all(r["floor_ms"] > 0 for r in results)


def test_a_size_whose_node_hangs_while_stopping_keeps_its_rows_and_is_killed() -> None:
    hang = ("import sys, time; print('a log line'); print('@rows ' + '[{\"tp\": 2}]', flush=True); "
            "time.sleep(120)")
    started = time.monotonic()
    rows = tp.run_child([], "2,nccl,default", wait_s=1.0, command=(sys.executable, "-c", hang))
    assert rows == [{"tp": 2}] and time.monotonic() - started < 30
    with pytest.raises(SystemExit, match="gave no rows"):
        tp.run_child([], "2,nccl,default", command=(sys.executable, "-c", "raise SystemExit(3)"))


def test_allreduce_gloo_prints_the_table_with_verified_sums(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json = tmp_path / "ar.json"
    report = tp.main(["allreduce", "--device", "cpu", "--nproc", "2", "--sizes", "small", "--ops", "6",
                      "--repeats", "3", "--warmup", "1", "--json", str(out_json)])
    out = capsys.readouterr().out
    assert report["world_size"] == 2 and report["backend"] == "gloo"
    assert json.loads(out_json.read_text()) == report
    header = next(line for line in out.splitlines() if line.lstrip().startswith("rows"))
    for name in ("gloo eager", "gloo graph", "symm eager", "symm graph", "symm/gloo eager", "fused eager",
                 "fused graph", "fused/gloo eager"):
        assert name in header, out
    cells = {(r["method"], r["rows"], r["hidden"]): r for r in report["results"]}
    assert len(cells) == 6 * 2  # every method and mode at both sizes: none dropped
    for rows in (1, 8):
        line = next(line for line in out.splitlines() if line.split()[:2] == [str(rows), "256"])
        eager = cells[("gloo eager", rows, 256)]
        assert eager["seconds"] > 0 and eager["reason"] is None, eager
        assert eager["verified"] == 2 * 6  # every output, before and after timing, on the slowest rank
        assert eager["bus_bandwidth"] == pytest.approx(2 * (2 - 1) / 2 * rows * 256 * 2 / eager["seconds"])
        assert f"{eager['seconds'] * 1e6:.1f}" in line and line.count("n/a [") == 5, line
        for method in ("gloo graph", "symm eager", "symm graph", "fused eager", "fused graph"):
            cell = cells[(method, rows, 256)]
            assert cell["seconds"] is None and cell["verified"] == 0 and cell["reason"], cell
    assert "n/a (RuntimeError: CUDA graphs need CUDA): gloo graph" in out, out
    assert ("n/a (RuntimeError: symmetric memory needs CUDA): fused eager, fused graph, symm eager, symm graph"
            in out), out
    assert report["env"] == tp.MULTICAST_OFF  # what the workers ran with


def test_check_sums_names_a_wrong_element() -> None:
    ops, ranks, numel, cpu = 3, 4, 50, torch.device("cpu")
    good = [tp.expected_sum(numel, k, ranks, cpu) for k in range(ops)]
    for k in range(ops):  # the expected sum is the ranks' patterns' sum, exact in bf16, and differs per op
        assert torch.equal(good[k].float(), sum(tp.pattern(numel, k, r, cpu).float() for r in range(ranks)))
    assert not torch.equal(good[0], good[1])
    assert tp.check_sums([g.clone() for g in good], ranks, "test") == ops
    wrong = [g.clone() for g in good]
    wrong[2][17] += 1
    with pytest.raises(AssertionError, match="all-reduce 2 of 3 gave .* at element 17"):
        tp.check_sums(wrong, ranks, "test")
    with pytest.raises(AssertionError, match="all-reduce 1 of 3"):  # a rank that read a peer's previous message
        tp.check_sums([good[0], good[0], good[2]], ranks, "test")


def _wrong_count_worker(rank: int, folder: str) -> None:
    """Two ranks whose settings claim three: every sum is short by one rank's input."""
    dist.init_process_group("gloo", init_method=f"file://{folder}/rdv", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        s = tp.Settings("cpu", 3, (2,), (16,), ops=2, repeats=1, warmup=0)
        tp.run_case("nccl", "eager", torch.empty(2, 2, 16, dtype=tp.DTYPE), None, s, rank)
    except AssertionError as exc:
        Path(folder, f"rank{rank}.txt").write_text(str(exc))
        raise
    finally:
        dist.destroy_process_group()


def test_a_wrong_sum_stops_every_rank(tmp_path: Path) -> None:
    # Each rank writes why it stopped: which rank's failure spawn() reports first is a race.
    with pytest.raises(Exception):
        torch.multiprocessing.spawn(_wrong_count_worker, args=(str(tmp_path),), nprocs=2, join=True)
    for rank in range(2):
        assert re.search("all-reduce 0 of 2 gave", (tmp_path / f"rank{rank}.txt").read_text())


def test_multicast_stays_off() -> None:
    env: dict[str, str] = {"NCCL_NVLS_ENABLE": "0"}
    tp.keep_multicast_off(env)
    assert env == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    for name in tp.MULTICAST_OFF:
        bad = dict(tp.MULTICAST_OFF, **{name: "1" if tp.MULTICAST_OFF[name] == "0" else "0"})
        with pytest.raises(SystemExit, match=name):
            tp.keep_multicast_off(bad)
    tp.keep_multicast_off()
    assert all(os.environ[k] == v for k, v in tp.MULTICAST_OFF.items())
    source = Path(tp.__file__).read_text()  # and no multimem operation is called
    assert [line for line in source.splitlines() if "multimem" in line and "no multimem" not in line] == []


def test_more_ranks_than_the_exact_check_holds_are_refused() -> None:
    with pytest.raises(SystemExit, match="--nproc 9"):
        tp.main(["allreduce", "--device", "cpu", "--nproc", "9"])
    sums = [tp.expected_sum(64, k, tp.MAX_RANKS, torch.device("cpu")) for k in range(8)]
    assert tp.check_sums(sums, tp.MAX_RANKS, "8 ranks") == 8


def test_report_of_a_gpu_run_has_the_ratios() -> None:
    """The GPU-only columns, from a report shaped as the workers write it on CUDA."""
    times = {"nccl eager": 20e-6, "nccl graph": 10e-6, "symm eager": 8e-6, "symm graph": None,
             "fused eager": 6e-6, "fused graph": 4e-6}
    results = [{"method": m, "rows": 64, "hidden": 4096, "seconds": t, "reason": None if t else "RuntimeError: x",
                "verified": 40 if t else 0, "bytes": 524288, "bus_bandwidth": 524288 / t if t else None}
               for m, t in times.items()]
    report = {"world_size": 2, "device": "NVIDIA H100 80GB HBM3", "backend": "nccl", "versions": "torch",
              "env": dict(tp.MULTICAST_OFF), "results": results}
    lines = tp.format_report(report, tp.Settings("cuda", 2, (64,), (4096,)))
    row = next(line for line in lines if line.split()[:2] == ["64", "4096"])
    assert "20.0 (  26.2)" in row and "8.0 (  65.5)" in row  # 2 * 1/2 * 524288 B / 20 us
    assert row.split()[-4:] == ["0.40", "-", "0.30", "0.40"], row
    assert any(line.startswith("[1] n/a (RuntimeError: x): symm graph") for line in lines), lines


@pytest.mark.gpu
def test_cuda_every_method_verified_or_explained(capsys: pytest.CaptureFixture[str]) -> None:
    """On 2+ GPUs: NCCL eager and graph verified at decode sizes; symmetric memory too, or n/a
    with a reason (never dropped)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    report = tp.main(["allreduce", "--nproc", "2", "--rows", "1,64", "--hidden", "4096", "--repeats", "5"])
    print(capsys.readouterr().out)
    for cell in report["results"]:
        if cell["method"].startswith("nccl"):
            assert cell["seconds"] > 0 and cell["verified"] == 2 * 20, cell
        else:
            assert (cell["seconds"] and cell["verified"] == 2 * 20) or cell["reason"], cell
