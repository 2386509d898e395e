"""The FP8-vs-bf16 GEMM table (inference_node/tuner/fp8_gemm.py) as a CPU smoke: a row per
projection and batch, and a launch whose output is not the reference's stops it."""
from __future__ import annotations

import pytest
import torch

from inference_node.tuner import fp8_gemm
from kernels.tuning_table import ModelShape


def test_cpu_smoke_prints_a_row_per_projection_and_batch(capsys: pytest.CaptureFixture[str]) -> None:
    assert fp8_gemm.main(["--device", "cpu", "--hidden", "64", "--rows", "1,3", "--block", "16,32"]) == 0
    lines = capsys.readouterr().out.splitlines()
    table = [line.split() for line in lines if line.split() and line.split()[0] in ("qkv", "o", "gate_up", "down")]
    shape = ModelShape(hidden=64, intermediate=192, heads=4, kv_heads=2, head_dim=16).gemms()
    assert sorted((r[0], int(r[1]), int(r[2]), int(r[3])) for r in table) == sorted(
        (g, rows, n, k) for g, (n, k) in shape.items() for rows in (1, 3))
    assert any("16x32 block scales" in line for line in lines)


def test_a_wrong_fp8_output_stops_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fp8_gemm, "fp8_matmul", lambda x, w, s, block: torch.zeros(x.shape[0], w.shape[0], dtype=x.dtype))
    shape = ModelShape(hidden=64, intermediate=192, heads=4, kv_heads=2, head_dim=16)
    with pytest.raises(AssertionError, match="qkv: max error"):
        fp8_gemm.measure(shape, [2], None, torch.device("cpu"), fp8_gemm.wall_timer, copies=1)


def test_block_flag_takes_two_integers() -> None:
    assert fp8_gemm.parse_block("128,128") == (128, 128) and fp8_gemm.parse_block(None) is None
    with pytest.raises(SystemExit, match="--block"):
        fp8_gemm.parse_block("128")


def test_w8a8_on_the_cpu_needs_the_interpreter(capsys: pytest.CaptureFixture[str]) -> None:
    """W8A8's columns time the Triton kernels themselves: on the CPU without Triton's
    interpreter the tool says how to run them (a usage error), not a driver traceback."""
    from kernels.host import interpreting

    if interpreting():
        pytest.skip("the interpreter runs them (tests/kernels/test_fp8_gemm.py)")
    with pytest.raises(SystemExit) as exited:
        fp8_gemm.main(["--device", "cpu", "--hidden", "64", "--w8a8"])
    assert exited.value.code == 2 and "TRITON_INTERPRET=1" in capsys.readouterr().err
