"""inference_node/tuner/profile.py: the timeline charges each idle gap of a decode step's chain
of kernels to the kernel that ends it, and (on the CPU, no timings) the profile builds the
engine's decode graphs once per mode over the checkpoint's shapes, or one tensor-parallel
rank's."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from inference_node.tuner import profile

ROOT = Path(__file__).resolve().parents[2]


def test_the_timeline_counts_the_chains_idle_gaps(capsys: pytest.CaptureFixture) -> None:
    """A gap in the chain (every kernel but the side stream's) is charged to the kernel that
    ends it, with the side work inside it; a chain kernel that starts before the one ahead
    ends (PDL) leaves no gap, nor does one that ends inside a longer one, and side kernels are
    no chain."""
    def k(name: str, start: float, end: float) -> dict:
        return dict(name=name, start=start, end=end)

    replay = [k("_decode_gemm_tma_kernel", 0, 10), k("_lora_shrink_kernel", 8, 14),
              k("_rope_cache_kernel", 15, 17), k("_paged_attention_kernel", 16, 30),
              k("_row_pick_kernel", 20, 22), k("_add_rms_norm_kernel", 31, 33)]
    profile.print_timeline("t", replay + [dict(x, start=x["start"] + 35, end=x["end"] + 35)
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
    shares = profile.span_shares([x for x in replay + [dict(x, start=x["start"] + 35, end=x["end"] + 35)
                                                       for x in replay]
                                  if x["name"] != "_lora_shrink_kernel"])
    gemm = "GEMM (cuBLAS or the Triton decode GEMM)"
    assert shares[f"{gemm} (after start)"] == [10.0, 1]
    assert shares[f"{gemm} (after add_rms_norm)"] == [12.0, 1]
    assert shares[f"rope_cache (after {gemm})"] == [14.0, 2]
    assert shares["paged_attention (after _row_pick_kernel)"] == [16.0, 2]
    assert sum(us for us, _ in shares.values()) == 68.0


def test_a_tensor_parallel_rank_on_one_device_has_the_rank_s_shapes(tiny_llama_path: Path) -> None:
    """--tp N runs one rank's shapes: heads, KV heads and MLP width divided, the head size
    kept, the LM head's block of the vocabulary; sizes that do not divide are refused."""
    full = json.loads((tiny_llama_path / "config.json").read_text())
    cfg, model = profile.random_model(tiny_llama_path, torch.device("cpu"), torch.float32, None, 64, tp=2)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, cfg.vocab_size) == (
        full["num_attention_heads"] // 2, full["num_key_value_heads"] // 2, full["intermediate_size"] // 2,
        full["vocab_size"] // 2)
    assert cfg.module_shapes()["o_proj"] == (cfg.num_heads * cfg.head_dim, full["hidden_size"])
    with pytest.raises(SystemExit, match="--tp 3"):
        profile.rank_config(full, 3)


def run_profile(model: Path, *args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "inference_node.tuner.profile", "--device", "cpu",
                           "--model", str(model), "--batch", "4", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the profile is run by hand")
def test_the_profile_runs_each_mode_on_cpu(tiny_llama_path: Path) -> None:
    """The engine's decode graphs (their CPU form) once per mode: the node's defaults, LoRA
    after each matmul, and a Tuning choice given as text."""
    out = run_profile(tiny_llama_path, "--configs", "base,c2", "--mode", "default", "--mode", "serial",
                      "--mode", "fold_groups=none/side_expand_segments=0")
    assert "tuning table: none: default launch choices" in out
    for mode in ("default", "serial", "fold_groups=none/side_expand_segments=0"):
        for config in ("base", "c2"):
            assert f"[{mode}] {config}: eager forward ran" in out, out


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the profile is run by hand")
def test_the_profile_says_which_modes_change_nothing_the_model_runs(tiny_llama_path: Path) -> None:
    """FP8 matmuls fold no LoRA (Tuning.without_folds), so fold choices leave their steps as
    the defaults': the tool says so rather than print a column that looks like a measurement
    of another plan. A choice FP8 steps do take is not flagged."""
    out = run_profile(tiny_llama_path, "--configs", "c2", "--quantization", "fp8-w8a8", "--mode", "default",
                      "--mode", "fold_groups=none/shrink_fold_groups=none", "--mode", "side_expand_segments=0")
    assert "[fold_groups=none/shrink_fold_groups=none] note: the same launches as [default]" in out, out
    assert "[side_expand_segments=0] note:" not in out, out
    plain = run_profile(tiny_llama_path, "--configs", "c2", "--mode", "default", "--mode", "fold_groups=none")
    assert "note: the same launches" not in plain, plain


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the profile is run by hand")
def test_the_profile_runs_a_tensor_parallel_rank_on_cpu(tiny_llama_path: Path) -> None:
    out = run_profile(tiny_llama_path, "--configs", "base,c2", "--tp", "2")
    for config in ("base", "c2"):
        assert f"[default] {config}: eager forward ran" in out, out


def test_the_profile_applies_lora_as_the_node_does_past_the_decode_gemms_rows(tiny_llama_path: Path) -> None:
    """Up to the decode GEMM's rows LoRA runs beside the matmuls (folds, side-stream expands);
    past them (a batch of 256) after them, as the node's decode graphs do: the tool once built
    the beside plan at every batch, whose fold launches overflow shared memory at 256 rows."""
    from inference_node.model.config import ModelConfig
    from inference_node.runner.lora.eager import StepLoraApplier
    from inference_node.runner.lora.overlap import OverlappedLoraApplier
    from kernels.gemm import MAX_ROWS
    from kernels.lora.meta import LoraBatchMeta
    from kernels.tuning import DEFAULT_TUNING

    cfg = ModelConfig.from_checkpoint(tiny_llama_path)
    buffers, plan = profile.config_slots(cfg, ["c2"], torch.float32, torch.device("cpu"))
    for batch, kind in ((MAX_ROWS, OverlappedLoraApplier), (256, StepLoraApplier)):
        meta = LoraBatchMeta.build([plan["c2"][i % 2] for i in range(batch)], "cpu")
        applier = profile.applier_factory("default", buffers, batch, DEFAULT_TUNING)(meta, None)
        assert isinstance(applier, kind), (batch, type(applier))
    serial = profile.applier_factory("serial", buffers, MAX_ROWS, DEFAULT_TUNING)(meta, None)
    assert isinstance(serial, StepLoraApplier)


def test_a_mode_s_tiling_groups_lie_over_each_bucket_s_own() -> None:
    """`--mode gemm_tma_tilings=down=64.128.4/gemm_split_k=down=2` over a table whose bucket
    tiles q/k/v and gate/up its own way: that bucket keeps them and takes the mode's down;
    other choices the mode names are fixed for every bucket; without a table, the defaults'."""
    from inference_node.tuner.profile import mode_steps
    from kernels.tuning import DEFAULT_TUNING
    from kernels.tuning_table import ModelShape, TuningTable

    table = TuningTable.from_json({
        "format": 2, "device": "cpu", "shape": {"hidden": 64, "intermediate": 160, "heads": 4, "kv_heads": 2,
                                                "head_dim": 16}, "dtype": "float32",
        "buckets": [{"batch": 64, "adapters": 0, "choices": {
            "gemm_tma_tilings": {"qkv": [64, 128, 6], "gate_up": [128, 128, 4]}, "gemm_split_k": {"o": 2}}}]})
    given = {"gemm_tma_tilings": "down=64.128.4", "gemm_split_k": "down=2"}
    tuning = mode_steps(table, given).for_step(64)
    assert tuning.gemm_tma_tilings == {**DEFAULT_TUNING.gemm_tma_tilings, "qkv": (64, 128, 6),
                                       "gate_up": (128, 128, 4), "down": (64, 128, 4)}
    assert tuning.gemm_split_k == {"down": 2}  # not a tiling table: the mode's, whole
    assert mode_steps(table, {}).for_step(64).gemm_tma_tilings["down"] == DEFAULT_TUNING.gemm_tma_tilings["down"]
    alone = mode_steps(None, given).for_step(64)
    assert alone.gemm_tma_tilings == {**DEFAULT_TUNING.gemm_tma_tilings, "down": (64, 128, 4)}
