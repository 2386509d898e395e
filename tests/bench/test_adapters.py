"""bench.adapters on a tiny random model (CPU). churn: every row of its table, and numbers that
follow from the setup (resident rows all GPU hits, churn rows cold from the disk tier with
evictions, every request counted in exactly one tier). tiers: every probe met the tier it was
set up for, by the adapter manager's own account (with `--disk disk-tier` the store refuses
connections, so a disk probe that did not read the node's disk tier fails). fetch --disk-tier:
a row per reader count and read kind, the older-entry rows rewriting the same chunk digests."""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest

from bench import adapters

ALPHAS = (0.5, 1.0, 1.5)
KEYS = ("resident", "lru", "gdsf")
TIERS = ("gpu", "host", "disk")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", [[], ["--decode-graphs", "on", "--mixed-graphs", "on"]], ids=["eager", "graphs"])
def test_churn_tiny(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                    mode: list[str]) -> None:
    drops: list[int] = []  # each churn row drops every adapter file from the page cache first
    real_drop = adapters.drop_page_cache
    monkeypatch.setattr(adapters, "drop_page_cache",
                        lambda root, names: drops.append(len(names)) or real_drop(root, names))
    requests = 24
    results = adapters.main(["churn", "--device", "cpu", "--model", "tiny", "--adapters", "30", "--ranks", "2,4,8",
                             "--requests", str(requests), "--rate", "40", "--concurrency", "4", "--prompt-len", "4:12",
                             "--output-len", "2:4", "--threads", "1", "--workdir", str(tmp_path), *mode])
    out = capsys.readouterr().out
    table = out[out.index("\nalpha "):].splitlines()[4:]
    rows = {(float(line.split()[0]), line.split()[1]): line for line in table if line[:5].strip()[:1].isdigit()}
    assert set(rows) == {(a, k) for a in ALPHAS for k in KEYS}, out
    assert not any("FAILED" in line for line in rows.values()), out
    by = {(r.alpha, r.key): r for r in results}
    for (alpha, key), r in by.items():
        assert r.error is None, r
        assert r.requests == requests and sum(r.tiers.values()) == requests, r
        assert r.output_tokens >= 2 * requests and r.tok_s > 0 and math.isfinite(r.tok_s), r
        assert all(t > 0 and math.isfinite(t) for t in r.ttft), r
        if key == "resident":  # every adapter pinned before timing
            assert r.tiers["gpu"] == requests and r.gpu_loads == 0 and r.gpu_evictions == 0, r
        else:  # every row starts with nothing loaded: the first request of each adapter is cold
            assert r.tiers["disk"] > 0 and r.gpu_loads > 0, r
            assert 0 < r.first_touch <= r.tiers["disk"], r
            assert r.output_tokens == by[(alpha, "resident")].output_tokens, "the same traffic on every row"
    assert by[(1.0, "lru")].ratio == pytest.approx(4.0, rel=0.15)  # the adapter memory: a quarter
    assert by[(0.5, "lru")].ratio > by[(1.5, "lru")].ratio          # flatter popularity, more adapters
    assert by[(0.5, "lru")].gpu_evictions > 0 and by[(0.5, "gdsf")].gpu_evictions > 0
    assert "alpha 1.0 lru: throughput" in out and "alpha 1.0 gdsf: throughput" in out, out
    assert drops == [30] * len(ALPHAS) * (len(KEYS) - 1), drops  # not before the resident rows


def test_every_adapter_file_is_dropped_from_the_page_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    names = adapters.adapter_names(3)
    for name in names:
        (tmp_path / name).mkdir()
        for file in ("adapter_config.json", "adapter_model.safetensors"):
            (tmp_path / name / file).write_bytes(b"x" * (10 if file.endswith("json") else 9000))
    dropped: list[Path] = []
    monkeypatch.setattr(adapters, "drop_cached", lambda path: dropped.append(path) or True)
    share = adapters.drop_page_cache(tmp_path, names)
    assert sorted(dropped) == sorted(tmp_path.glob("churn-*/*"))
    assert share is None or 0.0 <= share <= 1.0
    monkeypatch.setattr(adapters, "drop_cached", lambda path: False)  # no posix_fadvise here
    assert adapters.drop_page_cache(tmp_path, names) is None


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", [[], ["--disk", "disk-tier", "--background-adapter", "--decode-graphs", "on",
                                       "--mixed-graphs", "on"]],
                         ids=["folder-base-background", "disk-tier-adapter-background-graphs"])
def test_tiers_tiny(tmp_path: Path, capsys: pytest.CaptureFixture[str], mode: list[str]) -> None:
    store_source = logging.getLogger("inference_node.adapters.store_source")
    level = store_source.level
    result = adapters.main(["tiers", "--device", "cpu", "--model", "tiny", "--probes", "2", "--background", "3",
                            "--background-tokens", "48", "--threads", "1", "--workdir", str(tmp_path),
                            "--json", str(tmp_path / "tiers.json"), *mode])
    out = capsys.readouterr().out
    assert result["ok"], out
    assert store_source.level == level  # quieted for the run only: later tests read that log
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
    assert result["background_restarts"] > 0  # the short background was restarted, never under a probe
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


@pytest.mark.timeout(120)
def test_fetch_disk_tier_small(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = adapters.main(["fetch", "--disk-tier", "--mb", "9", "--runs", "2", "--read-threads", "1,3",
                          "--workdir", str(tmp_path)])
    out = capsys.readouterr().out
    kinds = ("cold (page cache dropped)", "warm (page cache)", "cold, older entry (whole-file sha256)")
    assert [label for label, _ in rows] == [f"{n:>2} readers, {kind}" for n in (1, 3) for kind in kinds], out
    for label, r in rows:
        assert r["size"] > 9e6 and 0 < r["median"] <= r["best"] and r["cpu_ms"][0] >= 0, (label, r)
        assert label in out
    assert list(tmp_path.iterdir()) == []  # its files are gone


@pytest.mark.timeout(300)
def test_fetch_from_s3_through_the_store(capsys: pytest.CaptureFixture[str]) -> None:
    """The whole path on loopback: an embedded SeaweedFS, the store in a child process, every
    row received and checked as the node does it."""
    rows = dict(adapters.main(["fetch", "--mb", "4", "--runs", "1"]))
    out = capsys.readouterr().out
    assert len(rows) == 9 and all(r["median"] > 0 and r["size"] > 4e6 for r in rows.values()), rows
    for label in ("boto3 get_object (one stream)", "store -> node cold (S3 -> store -> node host memory)",
                  "store -> node warm, into one reused host buffer", "host -> slot copy (CPU slot buffers)"):
        assert label in rows and label in out
    assert all(len(r["cpu_ms"]) == 3 for r in rows.values())  # CPU per run of this process, the store and S3
    assert "targets (issue 32): cold >=" in out
