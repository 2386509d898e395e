"""`lora-client` against a real node: streaming generate, load/ls/unload, clear errors."""
from __future__ import annotations

import pytest

from harness import InProcessNode, make_peft_adapter
from inference_node.config import NodeConfig
from lora_client.cli import main


@pytest.fixture(scope="module")
def node(tmp_path_factory, tiny_llama_path):
    root = tmp_path_factory.mktemp("cli-adapters")
    make_peft_adapter(tiny_llama_path, root / "style", 4, 8.0, ["q_proj", "v_proj"], seed=1, scale=3.0)
    n = InProcessNode(NodeConfig.of(checkpoint=str(tiny_llama_path), device="cpu", num_kv_blocks=64, max_loras=2,
                                    adapter_dir=str(root)))
    yield n
    n.stop()


def test_generate_streams_text(node, capsys) -> None:
    assert main(["--node", node.address, "generate", "--raw", "--max-tokens", "6", "-v", "Hello"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() and "completion tokens" in err


def test_load_ls_unload(node, capsys) -> None:
    assert main(["--node", node.address, "load", "style", "--pin"]) == 0
    assert capsys.readouterr().out.split()[::2] == ["style", "gpu"]
    assert main(["--node", node.address, "ls"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("style"))
    assert " gpu " in row and " yes " in row
    assert main(["--node", node.address, "unload", "style"]) == 0
    assert "unloaded" in capsys.readouterr().out


def test_errors_are_reported_with_their_status(node, capsys) -> None:
    assert main(["--node", node.address, "generate", "--adapter", "missing", "hi"]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err


def test_store_commands_forward_to_the_store_cli(capsys) -> None:
    with pytest.raises(SystemExit) as done:
        main(["push", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "usage: lora-client push" in out and "--s3-endpoint" in out
