"""`make fleet` for real, on a tiny model: the local stack with --fleet 2 (SeaweedFS, the
store, two nodes, HAProxy) as a subprocess; the fleet view through the proxy's stats page; an
adapter pushed with the printed command and asked for by the openai client at the printed
OpenAI base URL (the proxy's HTTP entry), landing on one node; requests through the proxy
during a rolling restart (SIGHUP); then Ctrl-C and no process left behind."""
from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import grpc
import openai
import pytest

from harness import make_peft_adapter, wait_for
from lora_client import cli
from lora_client.haproxy import MISSING, haproxy_binary
from lora_client.node_client import NodeClient, RetryPolicy

from test_local_stack import REPO, processes_with

pytestmark = [pytest.mark.skipif(haproxy_binary() is None, reason=MISSING),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")]


class Output:
    """The launcher's output, read on a thread so that waiting for a line never blocks."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.text = ""
        self.thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self.thread.start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self.text += line.decode(errors="replace")

    def wait_for(self, needle: str, proc: subprocess.Popen, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while needle not in self.text:
            assert proc.poll() is None, self.text
            assert time.monotonic() < deadline, f"no {needle!r} in:\n{self.text}"
            time.sleep(0.2)


def openai_through_the_proxy(printed: str, client: NodeClient, tmp_path: Path, tiny_llama_path: Path) -> None:
    """An adapter pushed with the printed command, then the openai client at the printed
    OpenAI base URL (the proxy's): the adapter's requests all land on the node its gRPC
    requests go to."""
    base_url = re.search(r"OpenAI API +([^\s,]+)", printed).group(1)
    push = next(line.strip() for line in printed.splitlines() if "adapter-store push " in line)
    words = shlex.split(push)
    env = dict(w.split("=", 1) for w in words if re.match(r"^AWS_[A-Z_]+=", w))
    command = [w for w in words if not re.match(r"^AWS_[A-Z_]+=", w)]
    command[command.index("push") + 1] = str(make_peft_adapter(tiny_llama_path, tmp_path / "tiny", 4, 8.0,
                                                               ["q_proj", "v_proj"], seed=3))
    command[command.index("--name") + 1] = "tiny"
    subprocess.run(command, env={**os.environ, **env}, check=True, capture_output=True, timeout=120)
    with openai.OpenAI(base_url=base_url, api_key="-", max_retries=0, timeout=60) as api:
        wait_for(lambda: "tiny" in {m.id for m in api.models.list().data}, 60, "the pushed adapter in /v1/models")
        nodes = set()
        for i in range(4):
            raw = api.completions.with_raw_response.create(model="tiny", prompt=[11, 2345, 876, 40 + i],
                                                           max_tokens=3, temperature=0)
            assert raw.parse().usage.completion_tokens == 3
            nodes.add(raw.headers["x-lora-node"])
    by_grpc = client.generate(client.request(adapter="tiny", prompt_token_ids=[11, 2345, 876, 40], max_tokens=2),
                              timeout=60).node
    assert nodes == {by_grpc}, (nodes, by_grpc)


def test_fleet_stack_serves_through_the_proxy_restarts_and_stops(tmp_path: Path, tiny_llama_path, capsys) -> None:
    marker = uuid.uuid4().hex
    env = {**os.environ, "LORA_STACK_ID": marker}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "lora_client.local_stack", "--fleet", "2", "--no-demo", "--work-dir",
         str(tmp_path / "stack"), "--", "--model", str(tiny_llama_path), "--device", "cpu", "--num-kv-blocks", "64",
         "--warmup", "off"], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = Output(launcher)
    try:
        out.wait_for("Ctrl-C stops everything", launcher, 300)
        proxy = re.search(r"HAProxy on (\S+),", out.text).group(1)
        stats = re.search(r"fleet --proxy-stats (\S+)", out.text).group(1)
        assert len(re.findall(r"inference node n\d on", out.text)) == 2

        with NodeClient(proxy, retry=RetryPolicy(attempts=10, max_backoff_s=1.0)) as client:
            request = client.request(prompt_token_ids=[11, 2345, 876, 40], max_tokens=8, ignore_eos=True)
            first = client.generate(request, timeout=60)
            assert first.node in ("n1", "n2") and len(first.token_ids) == 8
            assert cli.main(["fleet", "--proxy-stats", stats]) == 0
            view = capsys.readouterr().out
            assert re.search(r"^n1 .* UP ", view, re.M) and re.search(r"^n2 .* UP ", view, re.M), view
            openai_through_the_proxy(out.text, client, tmp_path, tiny_llama_path)

            launcher.send_signal(signal.SIGHUP)  # a rolling restart, while requests keep coming
            nodes, failures = set(), []
            while "rolling restart done" not in out.text:
                assert launcher.poll() is None, out.text
                try:
                    answer = client.generate(request, timeout=60)
                    assert answer.token_ids == first.token_ids
                    nodes.add(answer.node)
                except grpc.RpcError as exc:
                    failures.append(exc)
            assert not failures, failures[:3]
            assert out.text.count("exited with code 0") == 2 and out.text.count("back in the pool") == 2
            assert nodes == {"n1", "n2"}

        assert len(processes_with(marker)) >= 5  # SeaweedFS, the store, two nodes, HAProxy
        launcher.send_signal(signal.SIGINT)      # Ctrl-C
        launcher.wait(120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    out.thread.join(10)
    assert launcher.returncode == 0, out.text
    assert "[stack] stopped" in out.text
    time.sleep(0.5)
    assert processes_with(marker) == [], "the fleet left processes running"
