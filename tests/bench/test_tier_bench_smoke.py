"""The adapter tier benchmark runs end to end on a tiny random model (CPU): every probe met
the tier it was set up for, by the adapter manager's own account (so a host-tier probe whose
adapter was already on the GPU fails here), and the table and target lines print. With
`--disk disk-tier` the store refuses connections, so a disk probe that did not read the
node's disk tier fails. The bench quiets the store source's log for its run only: tests after
it in the same process read that log."""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest

TIERS = ("gpu", "host", "disk")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", [[], ["--disk", "disk-tier", "--background-adapter", "--decode-graphs", "on",
                                       "--mixed-graphs", "on"]],
                         ids=["folder-base-background", "disk-tier-adapter-background-graphs"])
def test_tier_bench_tiny(tmp_path: Path, capsys: pytest.CaptureFixture[str], mode: list[str]) -> None:
    from bench import tier_bench

    store_source = logging.getLogger("inference_node.adapters.store_source")
    level = store_source.level
    result = tier_bench.main(["--device", "cpu", "--model", "tiny", "--probes", "2", "--background", "3",
                              "--background-tokens", "48", "--threads", "1", "--workdir", str(tmp_path),
                              "--json", str(tmp_path / "tiers.json"), *mode])
    out = capsys.readouterr().out
    assert result["ok"], out
    assert store_source.level == level
    probes = result["probes"]
    assert sorted(p["tier"] for p in probes if p["timed"]) == sorted(TIERS * 2)
    for p in probes:  # the untimed first probe of each tier too
        assert p["error"] is None, p
        assert p["met"] == p["tier"] and p["hits"] == {p["tier"]: 1}, p
        assert p["first"] > p["submit"] and p["done"] >= p["first"] and math.isfinite(p["ttft"]), p
        if p["tier"] == "disk":  # the page cache was asked, and the probe's load read the files
            assert p["cached_after_drop"] is not None and 0.0 <= p["cached_after_drop"] <= 1.0, p
        if p["tier"] != "gpu":
            assert p["load_seconds"] > 0, p
    # The short background must have been restarted, and never ended under a probe.
    assert result["background_restarts"] > 0
    assert result["decode_steps"] > 0 and result["decode_step_p50"] > 0
    rows = {r["tier"]: r for r in result["rows"]}
    assert all(len(rows[t]["ttft"]) == 2 for t in TIERS) and all(rows[t]["adapter_mb"] > 0 for t in TIERS)
    table = out[out.index("\ntier "):].splitlines()
    for tier in TIERS:
        line = next(line for line in table if line.startswith(tier))
        assert len(line.split()) == 9 and "no probe" not in line, line
    assert "target host - gpu <= one decode step:" in out and "target disk - host <= 50 ms:" in out, out
    written = json.loads((tmp_path / "tiers.json").read_text())
    assert [r["tier"] for r in written["rows"]] == list(TIERS) and written["ok"]
