"""Runs test_triton_kernels.py in Triton's interpreter, in a subprocess.

TRITON_INTERPRET must be set before Triton is imported (and kernels are decorated), which a
shared pytest process cannot guarantee without changing how every other test sees Triton.
A child pytest with the variable set, and with conftest loading cut at this directory (the
engine's fixtures are not needed), keeps the switch local to these kernels.

The second test runs the engine's decode-graph path the same way: the node's CPU graph steps
with the Triton kernels (interpreted) instead of the PyTorch reference, so the seam between
the engine (rows ordered by adapter, the segment table it fills) and the kernels that read it
is checked against PEFT without a GPU. The third runs the node's start-up warm-up and then a
mixed workload the same way, and checks that the workload launches no kernel variant the
warm-up did not (so on a GPU nothing compiles under requests).
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


NEEDS_TRITON = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton not installed")


def run_interpreted(*args: str, timeout: float = 600) -> str:
    """A child pytest with Triton's interpreter and the Triton kernels on; asserts it passed
    and returns its output."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    report = proc.stdout[-8000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, report
    return proc.stdout


@NEEDS_TRITON
def test_triton_kernels_match_reference_in_interpreter() -> None:
    out = run_interpreted(f"--confcutdir={HERE}", str(HERE / "test_triton_kernels.py"))
    assert " passed" in out and "skipped" not in out, out[-8000:]


@NEEDS_TRITON
def test_decode_graph_steps_with_triton_kernels_match_peft_in_interpreter() -> None:
    out = run_interpreted("-k", "cpu", str(ROOT / "tests" / "adapters" / "test_decode_graphs.py"),
                          timeout=900)
    assert "7 passed" in out, out[-8000:]


@NEEDS_TRITON
def test_after_the_start_up_warm_up_serving_compiles_nothing_new_in_interpreter() -> None:
    """The node's warm-up (engine/warmup.py) launches every kernel variant that a mixed
    workload then launches: on a GPU, nothing compiles under the first requests."""
    out = run_interpreted("-k", "interpreted", str(ROOT / "tests" / "node" / "test_warmup.py"), timeout=900)
    assert "1 passed" in out, out[-8000:]
