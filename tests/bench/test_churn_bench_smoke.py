"""The churn benchmark runs end to end on a tiny random model (CPU): every row of its table, and
numbers that follow from the setup (resident rows all GPU hits, churn rows cold from the
disk tier with evictions, every request counted in exactly one tier)."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

ALPHAS = (0.5, 1.0, 1.5)
KEYS = ("resident", "lru", "gdsf")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", [[], ["--decode-graphs", "on", "--mixed-graphs", "on"]], ids=["eager", "graphs"])
def test_churn_bench_tiny(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                          mode: list[str]) -> None:
    from bench import churn_bench

    drops: list[int] = []  # each churn row drops every adapter file from the page cache first
    real_drop = churn_bench.drop_page_cache
    monkeypatch.setattr(churn_bench, "drop_page_cache",
                        lambda root, names: drops.append(len(names)) or real_drop(root, names))
    requests = 24
    results = churn_bench.main(["--device", "cpu", "--model", "tiny", "--adapters", "30", "--ranks", "2,4,8",
                                "--requests", str(requests), "--rate", "40", "--concurrency", "4",
                                "--prompt-len", "4:12", "--output-len", "2:4", "--threads", "1",
                                "--workdir", str(tmp_path), *mode])
    out = capsys.readouterr().out
    table = out[out.index("\nalpha "):].splitlines()[3:]
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
            # an adapter no earlier request named was only on disk when its first request came
            assert 0 < r.first_touch <= r.tiers["disk"], r
            resident = by[(alpha, "resident")]
            assert r.output_tokens == resident.output_tokens, "the same traffic on every row"
    assert by[(1.0, "lru")].ratio == pytest.approx(4.0, rel=0.15)  # the adapter memory: a quarter
    assert by[(0.5, "lru")].ratio > by[(1.5, "lru")].ratio          # flatter popularity, more adapters
    assert by[(0.5, "lru")].gpu_evictions > 0 and by[(0.5, "gdsf")].gpu_evictions > 0
    assert "alpha 1.0 lru: throughput" in out and "alpha 1.0 gdsf: throughput" in out, out
    assert "before each churn row its files are flushed and dropped from the OS page cache" in out, out
    assert drops == [30] * len(ALPHAS) * (len(KEYS) - 1), drops  # not before the resident rows


def test_every_adapter_file_is_dropped_from_the_page_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before a churn row, each file of every adapter folder is flushed and dropped (the bench
    wrote them all, so without this every disk-tier load would read memory)."""
    from bench import churn_bench, page_cache

    names = churn_bench.adapter_names(3)
    for name in names:
        (tmp_path / name).mkdir()
        for file in ("adapter_config.json", "adapter_model.safetensors"):
            (tmp_path / name / file).write_bytes(b"x" * (10 if file.endswith("json") else 9000))
    dropped: list[Path] = []
    monkeypatch.setattr(page_cache, "drop", lambda path: dropped.append(path) or True)
    share = churn_bench.drop_page_cache(tmp_path, names)
    assert sorted(dropped) == sorted(tmp_path.glob("churn-*/*"))
    assert share is None or 0.0 <= share <= 1.0
    monkeypatch.setattr(page_cache, "drop", lambda path: False)  # no posix_fadvise here
    assert churn_bench.drop_page_cache(tmp_path, names) is None
