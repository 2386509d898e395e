"""The README's first command for real: the local stack launcher as a subprocess (SeaweedFS,
adapter store, inference node, sample adapters, demo burst), then Ctrl-C, then no child left."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SAMPLES = REPO / "samples" / "adapters"


def processes_with(marker: str) -> list[int]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if f"LORA_STACK_ID={marker}".encode() in environ.split(b"\0"):
            found.append(int(pid))
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_stack_demo_shows_each_adapters_behaviour_and_stops_cleanly(tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    report = tmp_path / "report.json"
    env = {**os.environ, "LORA_STACK_ID": marker}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "lora_client.local_stack", "--serve", "--work-dir", str(tmp_path / "stack"),
         "--report", str(report)], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while not report.exists():
            assert launcher.poll() is None, launcher.stdout.read().decode()
            assert time.monotonic() < deadline, "the demo did not finish"
            time.sleep(0.5)
        time.sleep(0.5)
        assert len(processes_with(marker)) >= 3   # SeaweedFS, the store and the node are up
        launcher.send_signal(signal.SIGINT)       # Ctrl-C
        output = launcher.communicate(timeout=120)[0].decode()
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, output
    assert "[stack] stopped" in output
    time.sleep(0.5)
    assert processes_with(marker) == [], "the stack left processes running"

    results = json.loads(report.read_text())
    names = sorted(p.name for p in SAMPLES.iterdir() if (p / "adapter_config.json").exists())
    assert len(names) >= 1
    over_http = [r for r in results if r["api"] == "http"]
    assert len(over_http) == 1 and over_http[0]["text"] and over_http[0]["shown"], over_http
    twin = [r for r in results if r["api"] == "grpc" and r["adapter"] == over_http[0]["adapter"]
            and r["prompt"] == over_http[0]["prompt"]]
    assert [r["text"] for r in twin] == [over_http[0]["text"]]  # curl's greedy answer is gRPC's
    assert "fetched with curl:\n  $ curl -sS http://127.0.0.1:" in output
    for name in names:
        served = [r for r in results if r["behaviour"] == name and r["adapter"] == name]
        base = [r for r in results if r["behaviour"] == name and r["adapter"] == ""]
        assert served and base
        assert all(r["shown"] for r in served), f"{name} did not show its behaviour: {served}"
        assert not any(r["shown"] for r in base), f"the base model showed {name}'s behaviour: {base}"
