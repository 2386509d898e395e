"""bench/tune_kernels.py: its candidate tilings are the ones the node would launch, the table
it writes holds a bucket's best tiling only where it beats the default (and stops smaller
buckets' entries at the buckets where none does), and its CPU smoke (the PyTorch reference,
numbers meaningless) writes a table the node's loader reads back."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.tune_kernels import Measured, candidates, model_shape, table_for
from kernels.gemm.shapes import SHARED_MEMORY
from kernels.tuning import DEFAULT_TUNING
from kernels.tuning_table import ModelShape, TuningTable, load_table, table_name

ROOT = Path(__file__).resolve().parents[2]


def test_candidates_are_what_the_node_would_launch() -> None:
    w = torch.empty(2048, 2048, dtype=torch.bfloat16, device="meta").t()  # o of Llama-3.2-1B
    options = candidates(w, "o", "gemm_tma_tilings")
    assert options[0] == DEFAULT_TUNING.gemm_tma_tilings["o"]
    assert len(options) == len(set(options)) > 10
    for block_n, block_k, stages in options:
        assert 2048 % block_n == 0 and 2048 % block_k == 0
        assert stages == 2 or (64 + block_n) * block_k * 2 * stages <= SHARED_MEMORY
    assert (128, 512, 2) in options
    down = torch.empty(64, 160, dtype=torch.float32, device="meta").t()  # K 160: no tile divides it
    assert candidates(down, "down", "gemm_tilings") == []


def test_shapes_are_the_bench_models_and_a_tp_rank_keys_its_shard_as_the_node_does(tiny_llama_path) -> None:
    """The sweep's shape of a model split over N ranks is the table key a node with
    --tensor-parallel-size N looks up on every rank (its shard's shapes)."""
    from inference_node.model.config import ModelConfig
    from inference_node.parallel.shard import Shard

    assert model_shape("llama-1b-random").key == "h2048_i8192_q32_kv8_d64"
    assert model_shape("llama-8b-random").key == "h4096_i14336_q32_kv8_d128"
    assert model_shape("llama-70b-random", 4).key == "h8192_i7168_q16_kv2_d128"
    full = ModelConfig.from_checkpoint(tiny_llama_path)
    assert model_shape(str(tiny_llama_path)) == ModelShape.of(full) == model_shape("tiny")
    for rank in range(2):  # every rank's shard, as node.load_rank builds it
        assert model_shape(str(tiny_llama_path), 2) == ModelShape.of(Shard(rank, 2).local_config(full))
    assert model_shape("tiny", 2).key == "h64_i80_q2_kv1_d16"
    with pytest.raises(SystemExit, match="--tp 16: .*8 key/value heads"):
        model_shape("llama-8b-random", 16)
    with pytest.raises(SystemExit, match="--model .*no-such-model"):
        model_shape(str(Path("no-such-model")))


def test_the_table_holds_only_real_gains_and_stops_smaller_buckets() -> None:
    default_qkv, default_o = DEFAULT_TUNING.gemm_tma_tilings["qkv"], DEFAULT_TUNING.gemm_tma_tilings["o"]
    results = [
        Measured("qkv", 8, default_qkv, 10.0, (64, 128, 4), 9.0),   # 10% faster: taken
        Measured("o", 8, default_o, 10.0, (32, 128, 4), 9.9),       # 1%: noise, not taken
        Measured("qkv", 32, default_qkv, 10.0, default_qkv, 10.0),  # the default is best
        Measured("o", 32, default_o, 10.0, (32, 256, 3), 9.95),
    ]
    table = table_for(results, "gemm_tma_tilings", "NVIDIA H100 80GB HBM3", model_shape("llama-1b-random"),
                      0.02, "test")
    assert [(b.batch, b.adapters) for b in table.buckets] == [(8, 0), (32, 0)]
    assert table.to_json()["buckets"][0]["choices"] == {"gemm_tma_tilings": {"qkv": [64, 128, 4]}}
    assert table.to_json()["buckets"][1]["choices"] == {}
    steps = table.tunings(DEFAULT_TUNING)
    assert steps.for_step(16).gemm_tma_tilings["qkv"] == (64, 128, 4)
    assert steps.for_step(64).gemm_tma_tilings == DEFAULT_TUNING.gemm_tma_tilings  # not batch 8's
    assert steps.for_step(4) == DEFAULT_TUNING


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the sweep is run by hand")
def test_the_cpu_smoke_writes_a_table_the_node_reads(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "bench.tune_kernels", "--out", str(tmp_path)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("CPU SMOKE")
    shape = model_shape("tiny")
    path = tmp_path / table_name("cpu", shape)
    assert f"wrote {path}" in proc.stdout
    table = load_table("auto", "cpu", shape, tmp_path)
    assert table == TuningTable.read(path) and table.device == "cpu" and table.shape == shape
    assert [b.batch for b in table.buckets] == [1, 4]  # every batch measured has its bucket
    for bucket in table.buckets:
        assert set(bucket.choices) <= {"gemm_tilings"}
    for group in ("qkv", "o", "gate_up"):  # down's K (160) takes no tiling: cuBLAS, not swept
        assert any(line.startswith(f"{group:8}     1") for line in proc.stdout.splitlines()), proc.stdout
    assert "down: no tiling divides its [160, 64] weight" in proc.stdout


@pytest.mark.gpu
def test_the_sweep_on_the_gpu_writes_a_table_for_this_gpu(tmp_path: Path) -> None:
    """One group at one batch of Llama-3.2-1B's shapes (a minute at most): every candidate
    checked against the reference, the table filed under this GPU's name."""
    from kernels.tuning_table import device_name

    proc = subprocess.run([sys.executable, "-m", "bench.tune_kernels", "--model", "llama-1b-random", "--batches", "8",
                           "--groups", "o", "--out", str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    name = device_name(torch.device("cuda"))
    table = load_table("auto", name, model_shape("llama-1b-random"), tmp_path)
    assert table is not None and [b.batch for b in table.buckets] == [8]
    assert "rel err" not in proc.stdout, proc.stdout  # no candidate disagreed with the reference
    print(proc.stdout)
