"""The kernel benchmark script still runs (on CPU: tiny shapes, reference only)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the full benchmark is run by hand")
def test_kernels_bench_quick_runs_on_cpu() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LORA_KERNELS")}
    proc = subprocess.run([sys.executable, "bench/kernels_bench.py", "--quick"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert "copy bandwidth" in lines[0]
    for kernel in ("lora_shrink", "lora_expand", "paged_attn"):
        assert any(line.startswith(kernel) for line in lines), proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the full benchmark is run by hand")
def test_prefill_profile_runs_on_cpu() -> None:
    """bench/prefill_profile.py builds a LoRA prefill chunk through the engine's own batch and
    applier builders and runs it for each configuration."""
    proc = subprocess.run([sys.executable, "bench/prefill_profile.py", "--device", "cpu",
                           "--layers", "1", "--seqs", "2", "--prompt", "8", "--reps", "1",
                           "--configs", "base,c1,d32"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for config in ("base", "c1", "d32"):
        assert f"{config}: forward ran, host" in proc.stdout, proc.stdout
