"""The real `inference-node serve` process: environment-variable flags, health, SIGTERM."""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from lora_client.node_client import NodeClient
from lora_client.processes import free_port, wait_healthy


def test_serve_from_env_answers_and_exits_cleanly_on_sigterm(tiny_llama_path: Path, tmp_path: Path) -> None:
    port = free_port()
    env_cmd = [sys.executable, "-m", "inference_node.cli", "serve"]
    import os
    env = {**os.environ, "INFERENCE_NODE_PORT": str(port), "INFERENCE_NODE_MODEL": str(tiny_llama_path),
           "INFERENCE_NODE_DEVICE": "cpu", "INFERENCE_NODE_NUM_KV_BLOCKS": "32"}
    log = open(tmp_path / "node.log", "wb")
    proc = subprocess.Popen(env_cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(f"127.0.0.1:{port}", 120)
        with NodeClient(f"127.0.0.1:{port}") as client:
            out = client.generate(client.request(prompt_token_ids=[5, 6, 7], max_tokens=4, ignore_eos=True))
            assert len(out.token_ids) == 4
            assert client.stats().kv_blocks_total == 32
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    text = (tmp_path / "node.log").read_text()
    assert "KV cache: 32 blocks" in text and "inference node stopped" in text


def test_a_setting_the_core_cannot_run_with_ends_the_node_with_status_2(tmp_path: Path) -> None:
    """The launcher never loads the model: the engine core checks the checkpoint (and tensor
    parallelism, the tuning table, the disk tier) before any weight, and its status 2 is the
    node's, as for a bad flag."""
    proc = subprocess.run([sys.executable, "-m", "inference_node.cli", "serve", "--port", str(free_port()),
                           "--model", str(tmp_path / "missing"), "--device", "cpu"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert f"model path {tmp_path / 'missing'} is not a directory" in proc.stderr
    bad_flag = subprocess.run([sys.executable, "-m", "inference_node.cli", "serve", "--tune", "pdl=maybe"],
                              capture_output=True, text=True, timeout=60)
    assert bad_flag.returncode == 2 and "pdl='maybe': expected on or off" in bad_flag.stderr
