"""`lora-client` explains itself: global options in any position, store commands named as
lora-client's, one-line errors with the fix (no traceback) for missing S3 credentials, an
unreachable S3 or node, help text on every flag, a short default answer, and README's push
line in the form the local stack prints."""
from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from harness import InProcessNode
from inference_node.config import NodeConfig
from lora_client.cli import DEFAULT_MAX_TOKENS, globals_first, main, parser
from lora_client.local_stack import LocalStack
from lora_client.processes import free_port

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "samples" / "adapters" / "pirate"
NO_AWS = {"AWS_CONFIG_FILE": "/nonexistent", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
          "AWS_EC2_METADATA_DISABLED": "true"}


@pytest.fixture(scope="module")
def node(tiny_llama_path):
    n = InProcessNode(NodeConfig.of(checkpoint=str(tiny_llama_path), device="cpu", num_kv_blocks=64, max_loras=0))
    yield n
    n.stop()


def one_line(err: str) -> str:
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


def test_global_options_go_before_or_after_the_command(node, capsys) -> None:
    for argv in (["--node", node.address, "ls"], ["ls", "--node", node.address],
                 ["ls", f"--node={node.address}", "--timeout", "20"]):
        assert main(argv) == 0, argv
        assert "GPU slots" in capsys.readouterr().out
    assert main(["generate", "--raw", "--max-tokens", "2", "Hi", "--node", node.address]) == 0
    assert capsys.readouterr().out.strip()
    front, rest = globals_first(["generate", "--top-k", "3", "x", "--token", "t", "--", "--node"], parser())
    assert front == ["--token", "t"] and rest == ["generate", "--top-k", "3", "x", "--", "--node"]


def test_store_commands_accept_global_options_and_name_lora_client(capsys) -> None:
    assert main(["--node", "127.0.0.1:1", "store-ls"]) == 2  # was: AttributeError 'func'
    line = one_line(capsys.readouterr().err)
    assert line.startswith("lora-client store-ls: give --store HOST:PORT")
    with pytest.raises(SystemExit):
        main(["store-ls", "--help"])
    assert "usage: lora-client store-ls" in capsys.readouterr().out


def test_push_without_credentials_is_one_line_with_the_fix(monkeypatch, capsys) -> None:
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in NO_AWS.items():
        monkeypatch.setenv(key, value)
    code = main(["push", str(SAMPLE), "--name", "x", "--no-progress", "--s3-endpoint",
                 f"http://127.0.0.1:{free_port()}", "--bucket", "b", "--region", "us-east-1"])
    assert code == 1
    line = one_line(capsys.readouterr().err)
    assert line.startswith("lora-client push: no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")


def test_push_to_an_unreachable_s3_is_one_line(monkeypatch, capsys) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    endpoint = f"http://127.0.0.1:{free_port()}"
    code = main(["push", str(SAMPLE), "--name", "x", "--no-progress", "--s3-endpoint", endpoint,
                 "--bucket", "b", "--region", "us-east-1"])
    assert code == 1
    assert one_line(capsys.readouterr().err) == (f"lora-client push: cannot reach S3 at {endpoint}: is it running? "
                                                 "check --s3-endpoint")


def test_an_unreachable_node_is_one_line_with_the_fix(capsys) -> None:
    target = f"127.0.0.1:{free_port()}"
    assert main(["ls", "--node", target, "--timeout", "10"]) == 1
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"lora-client ls: cannot reach the node at {target}")
    assert "--node HOST:PORT" in line


def test_the_console_script_prints_no_traceback_either() -> None:
    script = Path(sys.executable).parent / "lora-client"
    done = subprocess.run([str(script), "generate", "hi", "--node", f"127.0.0.1:{free_port()}"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and one_line(done.stderr).startswith("lora-client generate: cannot reach")


def test_every_flag_has_help_text() -> None:
    root = parser()
    parsers = [root] + [p for a in root._actions if isinstance(a, argparse._SubParsersAction)
                        for p in a.choices.values()]
    for p in parsers:
        for action in p._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            text = re.sub(r"\s*\[env [A-Z_]+\].*", "", action.help or "")
            assert text.strip(), f"{p.prog} {action.option_strings or action.dest} has no help"


def test_generate_has_a_short_default_and_says_when_it_cuts(node, capsys) -> None:
    args = parser().parse_args(["generate", "hi"])
    assert args.max_tokens == DEFAULT_MAX_TOKENS == 128
    assert main(["--node", node.address, "generate", "--raw", "--max-tokens", "3", "Hello"]) == 0
    err = capsys.readouterr().err
    assert one_line(err) == "[cut at 3 tokens: --max-tokens N for a longer answer]"


def test_readme_push_line_has_the_form_the_stack_prints(tmp_path) -> None:
    stack = LocalStack(tmp_path, 1, 2, 1, [])
    stack.seaweed = SimpleNamespace(env=lambda: {"AWS_ACCESS_KEY_ID": "lora-dev", "AWS_SECRET_ACCESS_KEY": "SECRET",
                                                 "AWS_DEFAULT_REGION": "us-east-1"},
                                    endpoint_url="http://127.0.0.1:S3PORT")
    stack.bucket = "BUCKET"
    printed = next(line.strip() for line in stack.summary(SAMPLE).splitlines() if "adapter-store push" in line)
    readme = (REPO / "README.md").read_text()
    documented = next(line for line in readme.splitlines() if line.startswith("AWS_ACCESS_KEY_ID=") and " push " in line)

    def shape(line: str) -> list[str]:  # the command's words, programs and paths reduced to their names
        words = shlex.split(line)
        return [w if w.startswith(("-", "AWS_")) or w in ("push",) else Path(w).name if "/" in w and "://" not in w
                else w for w in words]

    ours, theirs = shape(printed), shape(documented)
    assert [w for w in ours if w.startswith(("--", "AWS_"))] == [w for w in theirs if w.startswith(("--", "AWS_"))]
    assert ours[ours.index("push") - 1] == "adapter-store" and theirs[theirs.index("push") - 1] == "lora-client"
