"""`lora-client` explains itself: global options in any position, store commands named as
lora-client's, one-line errors with the fix (no traceback) for missing S3 credentials, an
unreachable S3 or node, a TLS mismatch, out-of-range arguments and a reader that stops
reading; help text on every flag, a short default answer, counts that say what they count,
and README's push line in the form the local stack prints."""
from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from harness import InProcessNode
from inference_node.config import NodeConfig
from lora.v1 import inference_pb2 as pb
from lora_client.cli import DEFAULT_MAX_TOKENS, failure, globals_first, ls_footer, main, parser
from lora_client.fleet import NodeView, format_fleet
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
        assert "serve in one step (--max-loras)" in capsys.readouterr().out
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


SCRIPT = Path(sys.executable).parent / "lora-client"


@pytest.mark.parametrize("argv, flag", [
    (["generate", "hi", "--max-tokens", "99999999999"], "--max-tokens"),
    (["generate", "hi", "--max-tokens", "-1"], "--max-tokens"),
    (["generate", "hi", "--top-k", "3000000000"], "--top-k"),
    (["generate", "hi", "--seed", str(2**64)], "--seed"),
    (["generate", "hi", "--seed", str(10**30)], "--seed"),
    (["generate", "hi", "--temperature", "1e9"], "--temperature"),
    (["generate", "hi", "--temperature", "nan"], "--temperature"),
    (["generate", "hi", "--top-p", "1.5"], "--top-p"),
    (["--retries", "-3", "ls"], "--retries"),
    (["--timeout", "0", "ls"], "--timeout"),
    (["fleet", "--proxy-stats", "notaurl"], "--proxy-stats"),
    (["push", str(SAMPLE), "--name", "x", "--s3-endpoint", "notaurl", "--bucket", "b"], "--s3-endpoint"),
    (["store-ls", "--s3-endpoint", "notaurl", "--bucket", "b"], "--s3-endpoint"),
])
def test_out_of_range_arguments_are_refused_before_any_call(argv, flag, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--node", f"127.0.0.1:{free_port()}", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"argument {flag}:" in err.splitlines()[-1]


def test_an_environment_value_out_of_range_is_refused_like_a_flag(monkeypatch, capsys) -> None:
    monkeypatch.setenv("LORA_CLIENT_RETRIES", "-3")
    with pytest.raises(SystemExit) as exit_:
        main(["ls"])
    assert exit_.value.code == 2 and "LORA_CLIENT_RETRIES='-3'" in capsys.readouterr().err


def _closed_pipe() -> int:
    """The write end of a pipe whose reader has gone (as `| head -1` once head has exited)."""
    read, write = os.pipe()
    os.close(read)
    return write


@pytest.mark.parametrize("argv", [["ls"], ["fleet", "--nodes", "NODE"], ["stats"]])
def test_a_reader_that_stops_reading_is_no_traceback(node, argv) -> None:
    out = _closed_pipe()
    try:
        done = subprocess.run([str(SCRIPT), "--node", node.address,
                               *[node.address if a == "NODE" else a for a in argv]],
                              stdout=out, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(out)
    assert done.stderr == "" and done.returncode == 141


def test_tls_against_a_plaintext_node_is_one_line(node) -> None:
    done = subprocess.run([str(SCRIPT), "--tls", "--node", node.address, "--timeout", "20", "ls"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    line = one_line(done.stderr)  # no line of gRPC's own log
    assert line.startswith(f"lora-client ls: the TLS handshake with the node at {node.address} failed")
    assert "drop --tls" in line


class Refused(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def test_a_status_the_node_answered_is_not_blamed_on_reaching_the_node() -> None:
    args = parser().parse_args(["--node", "127.0.0.1:50051", "generate", "hi"])
    store_down = ("adapter 'x' is on no tier of this node and the adapter store at 127.0.0.1:9 cannot be "
                  "reached (failed to connect to all addresses; last error: Connection refused)")
    line = failure(args, Refused(grpc.StatusCode.UNAVAILABLE, store_down))
    assert line == f"lora-client generate: UNAVAILABLE: {store_down}"
    unreachable = failure(args, Refused(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; "
                                        "last error: UNKNOWN: ipv4:127.0.0.1:50051: Connection refused"))
    assert unreachable.startswith("lora-client generate: cannot reach the node at 127.0.0.1:50051")


def _adapters(tiers: list[int]) -> list[pb.AdapterStatus]:
    return [pb.AdapterStatus(name=f"a{i}", tier=tier) for i, tier in enumerate(tiers)]


def test_counts_say_what_they_count() -> None:
    """GPU memory may hold more adapters than --max-loras, the most one step serves: never
    shown as "5/4 slots"."""
    gpu, host = pb.ADAPTER_TIER_GPU, pb.ADAPTER_TIER_HOST
    reply = pb.ListAdaptersResponse(adapters=_adapters([gpu] * 5 + [host] * 2), max_loras=4, max_cpu_loras=8)
    assert ls_footer(reply) == ("5 on the GPU, of which at most 4 serve in one step (--max-loras); "
                                "2 only in host memory, which keeps up to 8")
    table = format_fleet([NodeView("n1", "127.0.0.1:1", "UP", list(reply.adapters), max_loras=4)])
    header, row = table.splitlines()[:2]
    assert header.split()[3:6] == ["ON", "GPU", "PER"]
    assert row.split()[3:6] == ["5", "4", "7"]
    assert "5/4" not in table
