"""The serving benchmark runs end to end on a tiny random model (CPU): every row, positive numbers."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

ROWS = ("a", "a2", "b", "c-1", "c-8", "c-32", "c-128", "d", "e")


def load_bench():
    from bench import serving_bench

    return serving_bench


@pytest.mark.parametrize("mode", [[], ["--poisson", "200"], ["--decode-graphs", "on", "--mixed-graphs", "on"]],
                         ids=["closed", "poisson", "graphs"])
def test_serving_bench_tiny(tiny_llama_path: Path, capsys: pytest.CaptureFixture[str], mode: list[str]) -> None:
    bench = load_bench()
    summaries = bench.main(["--device", "cpu", "--model", str(tiny_llama_path), "--requests", "4",
                            "--concurrency", "2", "--prompt-len", "4:8", "--output-len", "3",
                            "--threads", "1", "--control", *mode])
    out = capsys.readouterr().out
    table = out[out.index("\nrow "):]
    lines = {line.split()[0]: line for line in table.splitlines()[3:] if line.strip() and not line.startswith("-")}
    for key in ROWS:
        assert key in lines, out
        assert "FAILED" not in lines[key], lines[key]
        s = summaries[key]
        for value in (s.decode_tps, s.e2e_tps, s.ttft_p50, s.ttft_p99, s.tpot_p50, s.tpot_p99,
                      s.step_p50, s.floor_p50, s.over_floor):
            assert value > 0 and math.isfinite(value), (key, s)
        assert s.output_tokens == 4 * 3, s
    if not mode:  # closed loop: two requests in flight, round robin: two adapters per step
        assert summaries["c-8"].adapters_per_step == 2
    assert summaries["a"].adapters_per_step == 0
    if "--mixed-graphs" in mode:  # every prompt step replayed piece by piece, none eager
        for key in ("a", "b", "c-8", "d"):
            assert summaries[key].piecewise_steps > 0 and summaries[key].eager_steps == 0, summaries[key]
        assert "replayed piece by piece / eager: a " in out, out
    for phrase in ("b/a throughput", "d/a throughput", "c-32 extra decode step", "/ PEFT (e)", "control a2/a",
                   "JIT compiles during timed runs"):
        assert phrase in out, out
