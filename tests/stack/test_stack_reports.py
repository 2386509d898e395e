"""The local stack explains itself: once up it prints the S3 endpoint, bucket, credentials
and a push command that works as pasted (run here from another directory, then the adapter
served by name, then seen in the node's metrics); when one of its processes dies it names
it, with its exit code and the last lines of its log, and stops the rest."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from lora_client.processes import Child, ChildDied, death_report, wait_healthy
from test_local_stack import REPO, processes_with


def test_death_report_names_the_child_its_exit_and_log_tail(tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    child = Child("worker", [sys.executable, "-c", "import sys\nfor i in range(30): print('line', i)\n"
                             "print('fatal: bucket missing', flush=True); sys.exit(3)"], log)
    with pytest.raises(ChildDied) as died:
        wait_healthy("127.0.0.1:9", 30, child)  # nothing listens there: only the death ends the wait
    report = str(died.value)
    assert report.startswith("worker exited with code 3; last lines of")
    assert "  | fatal: bucket missing" in report and "  | line 29" in report and "line 5\n" not in report
    child.stop()
    assert "signal 9 (SIGKILL)" in death_report("store", -9, None)


def read_until(stream, pattern: str, lines: list[str], timeout: float) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = stream.readline()
        if not line:
            raise AssertionError("the stack exited:\n" + "".join(lines))
        lines.append(line.decode())
        found = re.search(pattern, lines[-1])
        if found:
            return found
    raise AssertionError(f"no {pattern!r} within {timeout}s:\n" + "".join(lines))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_printed_push_works_as_pasted_and_a_dead_store_is_named(tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}  # only what the stack prints
    env["LORA_STACK_ID"] = marker
    launcher = subprocess.Popen([sys.executable, "-m", "lora_client.local_stack", "--serve", "--no-demo",
                                 "--work-dir", str(tmp_path / "stack")], cwd=REPO, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines: list[str] = []
    try:
        read_until(launcher.stdout, r"^\[stack\] up:", lines, 600)
        push = read_until(launcher.stdout, r"^    (AWS_ACCESS_KEY_ID=.* push .*)$", lines, 10).group(1)
        ask = read_until(launcher.stdout, r"^    (.*lora-client .* generate .*)$", lines, 10).group(1)
        curl = read_until(launcher.stdout, r"^    (curl .*)$", lines, 10).group(1)
        metrics = re.search(r"inference node .* metrics (http://\S+)", "".join(lines)).group(1)
        for needed in ("S3              http://127.0.0.1:", "bucket lora-adapters-", "AWS_SECRET_ACCESS_KEY="):
            assert needed in "".join(lines)
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        pasted = subprocess.run(["bash", "-c", push], cwd=elsewhere, env=env,
                                capture_output=True, text=True, timeout=120)
        assert pasted.returncode == 0, pasted.stderr
        assert "pushed my-adapter to s3://lora-adapters-" in pasted.stdout
        answer = subprocess.run(["bash", "-c", ask],
                                cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
        assert answer.returncode == 0, answer.stderr
        over_http = subprocess.run(["bash", "-c", curl], cwd=elsewhere, env=env, capture_output=True, text=True,
                                   timeout=300)
        assert over_http.returncode == 0, over_http.stderr
        reply = json.loads(over_http.stdout)
        assert reply["model"] == "my-adapter" and reply["choices"][0]["message"]["content"], reply
        text = urllib.request.urlopen(metrics, timeout=10).read().decode()
        finished = re.findall(r'lora_node_requests_total\{adapter="my-adapter",status="(?:stop|length)"\} (\S+)', text)
        assert sum(float(v) for v in finished) == 2.0, text  # the gRPC answer and curl's

        rest = threading.Thread(target=lambda: lines.extend(l.decode() for l in launcher.stdout))
        rest.start()
        store = next(pid for pid in processes_with(marker)
                     if any(arg.endswith(b"/adapter-store") or arg == b"adapter-store"
                            for arg in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")))
        os.kill(store, signal.SIGKILL)
        assert launcher.wait(120) == 1
        rest.join(30)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    output = "".join(lines)
    assert "[stack] adapter-store exited with signal 9 (SIGKILL); last lines of" in output, output
    assert "adapter-store.log:\n  | " in output and "[stack] stopping the rest" in output
    assert "[stack] stopped" in output
    time.sleep(0.5)
    assert processes_with(marker) == [], "the stack left processes running"
