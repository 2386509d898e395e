"""bench/allreduce_bench.py on the CPU (gloo, 2 processes): the table, sums verified on every
rank, the methods this machine lacks printed as n/a with their reason, a wrong sum stopping
the run, and the variables that keep NVLink multicast off."""
from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from bench import allreduce_bench as ar
from bench import tp_floor


def test_gloo_smoke_prints_the_table_with_verified_sums(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json = tmp_path / "ar.json"
    report = ar.main(["--device", "cpu", "--nproc", "2", "--sizes", "small", "--ops", "6", "--repeats", "3",
                      "--warmup", "1", "--json", str(out_json)])
    out = capsys.readouterr().out
    assert report["world_size"] == 2 and report["backend"] == "gloo"
    assert json.loads(out_json.read_text()) == report
    header = next(line for line in out.splitlines() if line.lstrip().startswith("rows"))
    for name in ("gloo eager", "gloo graph", "symm 1-shot eager", "symm 1-shot graph", "symm 2-shot eager",
                 "symm 2-shot graph", "symm/gloo eager"):
        assert name in header, out
    cells = {(r["method"], r["rows"], r["hidden"]): r for r in report["results"]}
    assert len(cells) == 6 * 2  # every method and mode at both sizes: none dropped
    for rows in (1, 8):
        line = next(line for line in out.splitlines() if line.split()[:2] == [str(rows), "256"])
        eager = cells[("gloo eager", rows, 256)]
        assert eager["seconds"] > 0 and eager["reason"] is None, eager
        assert eager["verified"] == 2 * 6  # every output, before and after timing, on the slowest rank
        assert eager["bus_bandwidth"] == pytest.approx(2 * (2 - 1) / 2 * rows * 256 * 2 / eager["seconds"])
        assert f"{eager['seconds'] * 1e6:.1f}" in line, line
        assert line.count("n/a [") == 5, line
        for method in ("gloo graph", "symm 1-shot eager", "symm 1-shot graph", "symm 2-shot eager",
                       "symm 2-shot graph"):
            cell = cells[(method, rows, 256)]
            assert cell["seconds"] is None and cell["verified"] == 0 and cell["reason"], cell
    assert "n/a (CUDA graphs need CUDA): gloo graph" in out, out
    assert report["env"] == ar.MULTICAST_OFF  # what the workers ran with
    assert "n/a (symmetric memory needs CUDA): symm 1-shot eager, symm 1-shot graph" in out, out
    # What tp_floor reads from the report.
    assert tp_floor.all_reduce_times(report, "gloo eager") == {
        (rows, 256): cells[("gloo eager", rows, 256)]["seconds"] for rows in (1, 8)}


def test_check_sums_names_a_wrong_element() -> None:
    ops, ranks, numel = 3, 4, 50  # 4 ranks: a sum that must still differ per op
    device = torch.device("cpu")
    good = torch.stack([ar.expected_sum(numel, k, ranks, device) for k in range(ops)])
    # The expected sum is the sum of the ranks' patterns, exact in bf16, and differs per op.
    for k in range(ops):
        total = sum(ar.pattern(numel, k, r, device).float() for r in range(ranks))
        assert torch.equal(good[k].float(), total)
    assert not torch.equal(good[0], good[1])
    assert ar.check_sums(good.clone(), ranks, "test") == ops
    wrong = good.clone()
    wrong[2, 17] += 1
    with pytest.raises(AssertionError, match="all-reduce 2 of 3 gave .* at element 17"):
        ar.check_sums(wrong, ranks, "test")
    stale = good.clone()
    stale[1] = good[0]  # a rank that read a peer's previous message
    with pytest.raises(AssertionError, match="all-reduce 1 of 3"):
        ar.check_sums(stale, ranks, "test")


def _wrong_count_worker(rank: int, rendezvous: str) -> None:
    """Two ranks whose settings claim three: every sum is short by one rank's input."""
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        s = ar.Settings("cpu", 3, (2,), (16,), ops=2, repeats=1, warmup=0)
        buf = ar.Buffers(torch.empty(2, 2, 16, dtype=ar.DTYPE), torch.empty(2, 2, 16, dtype=ar.DTYPE), None)
        ar.run_case("nccl", "eager", buf, None, s, rank, lambda: None)
    finally:
        dist.destroy_process_group()


def test_a_wrong_sum_stops_every_rank(tmp_path: Path) -> None:
    with pytest.raises(Exception, match="all-reduce 0 of 2 gave"):
        torch.multiprocessing.spawn(_wrong_count_worker, args=(str(tmp_path / "rdv"),), nprocs=2, join=True)


def test_multicast_stays_off() -> None:
    env: dict[str, str] = {"NCCL_NVLS_ENABLE": "0"}
    ar.keep_multicast_off(env)
    assert env == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    for name in ar.MULTICAST_OFF:
        bad = dict(ar.MULTICAST_OFF, **{name: "1" if ar.MULTICAST_OFF[name] == "0" else "0"})
        with pytest.raises(SystemExit, match=name):
            ar.keep_multicast_off(bad)
    ar.keep_multicast_off()  # this process (and the smoke run's children) run with them set
    assert all(os.environ[k] == v for k, v in ar.MULTICAST_OFF.items())


def test_bench_never_calls_multimem() -> None:
    source = Path(ar.__file__).read_text()
    calls = [line for line in source.splitlines() if "multimem" in line and "no multimem" not in line]
    assert calls == [], calls


def test_more_ranks_than_the_exact_check_holds_are_refused() -> None:
    with pytest.raises(SystemExit, match="--nproc 9"):
        ar.main(["--device", "cpu", "--nproc", "9"])
    sums = torch.stack([ar.expected_sum(64, k, ar.MAX_RANKS, torch.device("cpu")) for k in range(8)])
    assert ar.check_sums(sums, ar.MAX_RANKS, "8 ranks") == 8


def test_table_of_a_gpu_report_has_the_ratios() -> None:
    """The GPU-only columns, from a report shaped as the workers write it on CUDA."""
    times = {"nccl eager": 20e-6, "nccl graph": 10e-6, "symm 1-shot eager": 8e-6, "symm 1-shot graph": 6e-6,
             "symm 2-shot eager": 12e-6, "symm 2-shot graph": None}
    cells = [ar.Cell(m, 64, 4096, t, None if t else "RuntimeError: world size 3", 40 if t else 0)
             for m, t in times.items()]
    report = ar.report_dict(ar.Report(2, "NVIDIA H100 80GB HBM3", "nccl", "torch 2.11.0, NCCL 2.27.3",
                                      dict(ar.MULTICAST_OFF), ["symmetric memory: backend CUDA; ..."], cells))
    lines = ar.format_table(report, ar.Settings("cuda", 2, (64,), (4096,)))
    row = next(line for line in lines if line.split()[:2] == ["64", "4096"])
    assert "20.0 (  26.2)" in row  # 2 * 1/2 * 524288 B / 20 us
    assert "6.0 (  87.4)" in row
    assert row.rstrip().endswith("0.40 1-shot 0.60 1-shot"), row
    assert any(line.startswith("[1] n/a (RuntimeError: world size 3): symm 2-shot graph") for line in lines), lines
    assert report["results"][0]["bus_bandwidth"] == pytest.approx(524288 / 20e-6)


@pytest.mark.gpu
def test_cuda_every_method_verified_or_explained(capsys: pytest.CaptureFixture[str]) -> None:
    """On 2+ GPUs: NCCL eager and graph verified at decode sizes; the symmetric-memory methods
    verified too, or n/a with a reason (never dropped)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    report = ar.main(["--nproc", "2", "--rows", "1,64", "--hidden", "4096", "--repeats", "5"])
    print(capsys.readouterr().out)
    for cell in report["results"]:
        if cell["method"].startswith("nccl"):
            assert cell["seconds"] > 0 and cell["verified"] == 2 * 20, cell
        else:
            assert (cell["seconds"] and cell["verified"] == 2 * 20) or cell["reason"], cell
