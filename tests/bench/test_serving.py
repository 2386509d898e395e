"""bench.serving runs end to end on a tiny random model (CPU): every row of the engine path
with positive numbers, the targets' lines, and the served node's gRPC and HTTP rows in the
same table as the engine's, on the same requests (the numbers are meaningless on CPU; the
paths are the GPU benchmark's)."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from bench import serving

ROWS = ("a", "a2", "b", "c-1", "c-8", "c-32", "c-128", "d", "e")


def table_lines(out: str) -> dict[tuple[str, str], str]:
    table = out[out.index("\nrow "):].splitlines()[4:]
    return {tuple(line.split()[:2]): line for line in table if line.strip() and not line.startswith("-")
            and len(line.split()) > 2 and line.split()[1] in ("engine", "grpc", "http", "peft")}


@pytest.mark.parametrize("mode", [[], ["--poisson", "200"], ["--decode-graphs", "on", "--mixed-graphs", "on"]],
                         ids=["closed", "poisson", "graphs"])
def test_engine_rows_tiny(tiny_llama_path: Path, capsys: pytest.CaptureFixture[str], mode: list[str]) -> None:
    summaries = serving.main(["--device", "cpu", "--model", str(tiny_llama_path), "--requests", "4",
                              "--concurrency", "2", "--prompt-len", "4:8", "--output-len", "3",
                              "--threads", "1", "--control", *mode])
    out = capsys.readouterr().out
    lines = table_lines(out)
    for key in ROWS:
        path = "peft" if key == "e" else "engine"
        assert (key, path) in lines, out
        assert "FAILED" not in lines[(key, path)], lines[(key, path)]
        s = summaries[(key, path)]
        for value in (s.decode_tps, s.e2e_tps, s.ttft_p50, s.ttft_p99, s.tpot_p50, s.tpot_p99,
                      s.step_p50, s.floor_p50, s.over_floor):
            assert value > 0 and math.isfinite(value), (key, s)
        assert s.output_tokens == 4 * 3, s
    if not mode:  # closed loop: two requests in flight, round robin: two adapters per step
        assert summaries[("c-8", "engine")].adapters_per_step == 2
    assert summaries[("a", "engine")].adapters_per_step == 0
    if "--mixed-graphs" in mode:  # every prompt step replayed piece by piece, none eager
        for key in ("a", "b", "c-8", "d"):
            kinds = summaries[(key, "engine")].step_kinds
            assert kinds["piecewise"] > 0 and kinds["eager_prefill"] == 0 and kinds["graph"] > 0, kinds
    for phrase in ("b/a throughput", "d/a throughput", "c-32 extra decode step", "/ PEFT (e)", "control a2/a",
                   "JIT compiles during timed runs", "steps by kind"):
        assert phrase in out, out


def test_served_paths_share_the_table_with_the_engine(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One served node (LoRA on) takes rows b and c through gRPC and HTTP after the engine
    ran them in process: the same requests, the same tokens, the ratio lines printed."""
    summaries = serving.main(["--device", "cpu", "--model", "tiny", "--paths", "engine,grpc,http", "--rows", "b,c",
                              "--adapter-counts", "2", "--requests", "4", "--concurrency", "2", "--prompt-len", "4:8",
                              "--output-len", "5", "--clients", "1", "--threads", "1", "--workdir", str(tmp_path)])
    out = capsys.readouterr().out
    lines = table_lines(out)
    assert set(summaries) == set(lines) == {(k, p) for k in ("b", "c-2") for p in ("engine", "grpc", "http")}, out
    for (key, path), s in summaries.items():
        assert s.error is None and s.output_tokens == 4 * 5 and s.e2e_tps > 0 and s.ttft_p50 > 0, s
        assert sum(s.step_kinds.values()) > 0, s  # the node's own step counts of the timed run
        if path != "engine":  # the step columns are the engine path's
            assert math.isnan(s.step_p50) and lines[(key, path)].split()[-7:] == ["-"] * 7, lines[(key, path)]
    for phrase in ("b: grpc/engine tok/s", "c-2: grpc/engine tok/s", "c-2: http/grpc tok/s", "b@grpc", "c-2@http"):
        assert phrase in out, out
    assert (tmp_path / "node-lora.log").exists() and not (tmp_path / "node-base.log").exists()


def test_prefill_row_and_quantizations_side_by_side(tiny_llama_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--rows a,c,p --quantization none,fp8: every row once for each value on nodes of its own
    (the second's keys suffixed), row p's prompts with one new token each timed as prefill, and
    a last table with a line per value, the first's ratios 1."""
    summaries = serving.main(["--device", "cpu", "--model", str(tiny_llama_path), "--rows", "a,c,p",
                              "--adapter-counts", "32", "--requests", "4", "--concurrency", "2", "--prompt-len", "4:8",
                              "--output-len", "3", "--threads", "1", "--quantization", "none,fp8"])
    out = capsys.readouterr().out
    assert set(summaries) == {(k, "engine") for k in ("a", "c-32", "p", "a/fp8", "c-32/fp8", "p/fp8")}, summaries
    for key in ("p", "p/fp8"):
        s = summaries[(key, "engine")]
        assert s.error is None and s.output_tokens == 4 and s.prefill_tps > 0 and s.ttft_p50 > 0, s
    assert summaries[("a/fp8", "engine")].output_tokens == 4 * 3
    assert out.count("p: prefill") == 2 and "FP8 projections" in out, out
    table = out[out.index("--quantization side by side"):].splitlines()
    lines = {line.split()[0]: line.split() for line in table[4:] if line.strip()}
    assert set(lines) == {"none", "fp8"}, table
    assert lines["none"][2] == "1.000" and lines["none"][-1] == "1.000", lines  # a step and prefill: x first
    assert all(cell != "-" for cell in lines["fp8"][1:]), lines  # every column measured for the second value


def test_an_unknown_quantization_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        serving.parse_args(["--device", "cpu", "--quantization", "none,int4"])
    assert "--quantization: comma-separated, from none, fp8, fp8-w8a8" in capsys.readouterr().err
