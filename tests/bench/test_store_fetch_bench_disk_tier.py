"""`store_fetch_bench --disk-tier` runs end to end: a row per reader count and read kind, each
with a rate, and the older-entry rows rewrite the same chunk digests put wrote (the bench
checks that itself)."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.mark.timeout(120)
def test_disk_tier_bench_small(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from bench import store_fetch_bench

    store_fetch_bench.main(["--disk-tier", "--mb", "9", "--runs", "2", "--read-threads", "1,3",
                            "--workdir", str(tmp_path)])
    out = capsys.readouterr().out
    table = out[out.index("\nread "):].strip().splitlines()[1:]
    kinds = ("cold (page cache dropped)", "warm (page cache)", "cold, older entry (whole-file sha256)")
    assert [line.split(" readers, ")[0].strip() for line in table] == ["1"] * 3 + ["3"] * 3, out
    for line, kind in zip(table, kinds * 2):
        assert kind in line, line
        median, best, ms, cpu = (float(v) for v in line.split()[-4:])
        assert 0 < median <= best and ms > 0 and cpu >= 0, line
    assert list(tmp_path.iterdir()) == []  # its files are gone
