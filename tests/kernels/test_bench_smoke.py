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
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "bench.kernels_bench", "--quick"], cwd=ROOT,
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
    proc = subprocess.run([sys.executable, "-m", "bench.prefill_profile", "--device", "cpu",
                           "--tiny", "--seqs", "2", "--prompt", "8", "--reps", "1",
                           "--configs", "base,c1,d32"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for config in ("base", "c1", "d32"):
        assert f"{config}: forward ran, host" in proc.stdout, proc.stdout


def test_decode_profile_timeline_counts_the_chains_idle_gaps(capsys: pytest.CaptureFixture) -> None:
    """decode_profile --timeline: a gap in the chain (every kernel but the side stream's) is
    charged to the kernel that ends it, with the side work inside it; a chain kernel that
    starts before the one ahead ends (PDL) leaves no gap, nor does one that ends inside a
    longer one, and side kernels are no chain."""
    from bench import decode_profile

    def k(name: str, start: float, end: float) -> dict:
        return dict(name=name, start=start, end=end)

    replay = [k("_decode_gemm_tma_kernel", 0, 10), k("_lora_shrink_kernel", 8, 14),
              k("_rope_cache_kernel", 15, 17), k("_paged_attention_kernel", 16, 30),
              k("_row_pick_kernel", 20, 22), k("_add_rms_norm_kernel", 31, 33)]
    decode_profile.print_timeline("t", replay + [dict(x, start=x["start"] + 35, end=x["end"] + 35)
                                                 for x in replay], reps=2)
    out = capsys.readouterr().out
    # 5 us before RoPE and 1 before the norm in each replay, 2 between the replays
    assert "chain idle 0.007 ms a replay" in out, out
    gap_lines = out.split("chain idle")[1].split("chain kernels in the graph")[0]
    assert "     5.0 us    1.0       4.0 us  rope_cache" in gap_lines, out
    assert "     1.0 us    1.0       0.0 us  add_rms_norm" in gap_lines, out
    assert "     1.0 us    0.5       0.0 us  GEMM (cuBLAS or the Triton decode GEMM)" in gap_lines, out
    for fam in ("paged_attention", "_row_pick_kernel", "lora_shrink"):
        assert fam not in gap_lines, out
    # The span split by the chain kernel that ends each part: 10 + 7 + 5 + 8 + 3 us in the
    # first replay, 12 (from the norm's end to the second GEMM's) + the same 23 in the second.
    shares = decode_profile.span_shares([x for x in replay + [dict(x, start=x["start"] + 35,
                                                                   end=x["end"] + 35) for x in replay]
                                         if x["name"] != "_lora_shrink_kernel"])
    gemm = "GEMM (cuBLAS or the Triton decode GEMM)"
    assert shares[f"{gemm} (after start)"] == [10.0, 1]
    assert shares[f"{gemm} (after add_rms_norm)"] == [12.0, 1]
    assert shares[f"rope_cache (after {gemm})"] == [14.0, 2]
    assert shares["paged_attention (after _row_pick_kernel)"] == [16.0, 2]
    assert sum(us for us, _ in shares.values()) == 68.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the full profile is run by hand")
def test_decode_profile_runs_each_mode_on_cpu() -> None:
    """bench/decode_profile.py builds the engine's decode graphs (their CPU form) once per mode:
    the node's defaults, LoRA after each matmul, and a Tuning choice given as text."""
    proc = subprocess.run([sys.executable, "-m", "bench.decode_profile", "--device", "cpu", "--tiny",
                           "--batch", "4", "--configs", "base,c2", "--mode", "default", "--mode",
                           "serial", "--mode", "fold_groups=none/side_expand_segments=0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for mode in ("default", "serial", "fold_groups=none/side_expand_segments=0"):
        for config in ("base", "c2"):
            assert f"[{mode}] {config}: eager forward ran" in proc.stdout, proc.stdout


def test_a_tensor_parallel_rank_on_one_device_has_the_rank_s_shapes() -> None:
    """decode_profile --tp N runs one rank's shapes: heads, KV heads and MLP width divided,
    the head size kept, the LM head's block of the vocabulary; sizes that do not divide are
    refused."""
    from bench.common import TINY_LLAMA, random_model, rank_config

    cfg, model = random_model(torch.device("cpu"), torch.float32, None, 64, tiny=True, tp=2)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size) == (
        TINY_LLAMA["num_attention_heads"] // 2, TINY_LLAMA["num_key_value_heads"] // 2, TINY_LLAMA["head_dim"],
        TINY_LLAMA["intermediate_size"] // 2, TINY_LLAMA["vocab_size"] // 2)
    assert cfg.module_shapes()["o_proj"] == (cfg.num_heads * cfg.head_dim, TINY_LLAMA["hidden_size"])
    with pytest.raises(SystemExit, match="--tp 3"):
        rank_config(dict(TINY_LLAMA), 3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the full profile is run by hand")
def test_decode_profile_runs_a_tensor_parallel_rank_on_cpu() -> None:
    proc = subprocess.run([sys.executable, "-m", "bench.decode_profile", "--device", "cpu", "--tiny",
                           "--batch", "4", "--configs", "base,c2", "--tp", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for config in ("base", "c2"):
        assert f"[default] {config}: eager forward ran" in proc.stdout, proc.stdout
