"""bench.soak against a real `inference-node serve` on the CPU: a short run passes (cancelled
and invalid requests end as they should, the node is idle at the end) and says so."""
from __future__ import annotations

import pytest

from bench import soak


@pytest.mark.timeout(300)
def test_a_short_soak_passes(capsys: pytest.CaptureFixture[str]) -> None:
    assert soak.main(["--requests", "80", "--adapters", "6", "--concurrency", "4", "--max-loras", "2",
                      "--warmup-requests", "10", "--cancel-fraction", "0.1", "--invalid-fraction", "0.1"]) == 0
    out = capsys.readouterr().out
    counts = {line.rsplit(None, 1)[0]: int(line.split()[-1]) for line in out.splitlines()
              if line.startswith(("ok (", "cancelled", "INVALID_ARGUMENT"))}
    assert sum(counts.values()) == 80 and counts.get("cancelled", 0) > 0 and counts.get("INVALID_ARGUMENT", 0) > 0, out
    assert "0 running, 0 waiting" in out and out.rstrip().endswith("PASS"), out
