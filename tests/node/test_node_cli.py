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
