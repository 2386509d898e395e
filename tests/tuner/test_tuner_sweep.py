"""inference_node/tuner/sweep.py and `inference-node tune`: the candidate tilings are the ones
the node would launch, the table holds a bucket's best tiling only where it beats the default
(and a bucket where none does holds the defaults, not another bucket's), the fold is swept in the
mode the node runs each group (a rank's under tensor parallelism), its reference check catches
a wrong output, its winners go into (batch, adapters) buckets over their batch's base choices,
and the CPU smoke (the PyTorch reference or Triton's interpreter, numbers meaningless) writes a
table the node's lookup reads back, keeping what a table there already held."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from inference_node.tuner.cli import model_shape
from inference_node.tuner.store import usable
from inference_node.tuner.sweep import (EXPERT_GROUPS, Measured, bucket_top, buckets_for, candidates, cases, fold_copies,
                                        fold_modes, folded_output, launch_bytes, print_results,
                                        same_row_tile, slice_widths, split_candidates)
from inference_node.tuner.tune import key_for
from kernels.gemm import DecodeGemm
from kernels.gemm.shapes import SHARED_MEMORY
from kernels.tuning import DEFAULT_TUNING, GROUPS
from kernels.tuning_table import ModelShape, TuningTable

ROOT = Path(__file__).resolve().parents[2]
TINY = ModelShape(hidden=64, intermediate=160, heads=4, kv_heads=2, head_dim=16)
LLAMA_8B = ModelShape(4096, 14336, 32, 8, 128)


def config_dir(tmp_path: Path, name: str, **overrides) -> Path:
    """A checkpoint folder holding only config.json (the tuner reads nothing else)."""
    from bench.shapes import LLAMA_3_1_8B, LLAMA_3_1_70B, LLAMA_3_2_1B, TINY_LLAMA

    config = {"tiny": TINY_LLAMA, "1b": LLAMA_3_2_1B, "8b": LLAMA_3_1_8B, "70b": LLAMA_3_1_70B}[name]
    folder = tmp_path / name
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**config, **overrides}))
    return folder


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


def test_k_split_candidates_widen_the_tile_and_keep_the_programs() -> None:
    """o and down (an add + norm after them sums the splits) get wider tiles cut into as many
    K splits as keep the default's program count, each split a whole number of K steps; the
    groups whose output feeds RoPE or the SiLU get none."""
    from kernels.gemm.shapes import tiling

    for N, K, group in ((2048, 8192, "down"), (2048, 2048, "o"), (4096, 14336, "down")):
        w = torch.empty(N, K, dtype=torch.bfloat16, device="meta").t()
        default = tiling(w, group, DEFAULT_TUNING.gemm_tma_tilings)
        options = split_candidates(w, group, "gemm_tma_tilings")
        assert options and len(options) == len(set(options))
        for block_n, block_k, stages, splits in options:
            assert 2 <= splits <= 4 and N // block_n * splits == N // default[0]
            assert K % (block_k * splits) == 0
            assert (block_n, block_k, stages) == tiling(w, group, {group: (block_n, block_k, stages)})
    for N, K, group in ((3072, 2048, "qkv"), (16384, 2048, "gate_up")):
        assert split_candidates(torch.empty(N, K, device="meta").t(), group, "gemm_tma_tilings") == []


def test_a_k_split_winner_becomes_the_buckets_tiling_and_splits() -> None:
    """A K-split launch that wins goes into the bucket as its tiling and its gemm_split_k entry,
    the node reads it back from the table's JSON, and the batch's adapter steps take the
    group's fastest unsplit launch (the split was timed on the GEMM alone, not beside a LoRA
    step's side stream)."""
    default_down = DEFAULT_TUNING.gemm_tma_tilings["down"]
    results = [Measured("down", 64, default_down, 14.0, (32, 128, 6, 2), 12.0, plain=(32, 256, 4), plain_us=13.0),
               Measured("o", 64, (16, 256, 4), 6.0, (16, 256, 4), 6.0),
               Measured("o", 64, (16, 128, 4), 9.0, (64, 128, 4), 8.0, adapters=32, expand=False)]
    buckets, _ = buckets_for(results, "gemm_tma_tilings", 0.02)
    raw = TuningTable("NVIDIA H200", LLAMA_8B, "bfloat16", {}, tuple(buckets)).to_json()
    assert raw["buckets"][0]["choices"] == {"gemm_tma_tilings": {"down": [32, 128, 6]},
                                            "gemm_split_k": {"down": 2}}
    steps = TuningTable.from_json(json.loads(json.dumps(raw))).tunings(DEFAULT_TUNING)
    base, lora = steps.for_step(64), steps.for_step(64, 32)
    assert base.gemm_tma_tilings["down"] == (32, 128, 6) and base.gemm_split_k == {"down": 2}
    assert lora.gemm_tma_tilings["down"] == (32, 256, 4) and lora.gemm_split_k.get("down", 1) == 1
    assert lora.fold_tilings["o"] == (64, 128, 4)
    assert steps.for_step(8) == base  # the only bucket: smaller steps take it too


def test_small_lora_steps_take_their_batchs_k_splits() -> None:
    """Up to LORA_SPLIT_ROWS rows a LoRA step launches o and down as its batch's base step
    does, K splits included; a kept base bucket's splits count the same way, and a larger
    batch's adapter bucket still takes the unsplit launches."""
    from inference_node.tuner.sweep import LORA_SPLIT_ROWS

    rows = LORA_SPLIT_ROWS
    results = [Measured("down", rows, (16, 128, 8), 48.0, (64, 128, 6, 4), 32.0, plain=(32, 256, 4), plain_us=45.0),
               Measured("o", rows, (16, 128, 4), 9.0, (64, 128, 4), 8.0, adapters=8),
               Measured("down", 64, (16, 128, 8), 14.0, (32, 128, 6, 2), 12.0, plain=(32, 256, 4), plain_us=13.0),
               Measured("o", 64, (16, 128, 4), 9.0, (64, 128, 4), 8.0, adapters=32, expand=False)]
    buckets, _ = buckets_for(results, "gemm_tma_tilings", 0.02)
    steps = TuningTable("NVIDIA H200", LLAMA_8B, "bfloat16", {}, tuple(buckets)).tunings(DEFAULT_TUNING)
    small = steps.for_step(rows, 8)
    assert small.gemm_tma_tilings["down"] == (64, 128, 6) and small.gemm_split_k["down"] == 4
    assert small.fold_tilings["o"] == (64, 128, 4)
    large = steps.for_step(64, 32)
    assert large.gemm_tma_tilings["down"] == (32, 256, 4) and large.gemm_split_k.get("down", 1) == 1

    # Only the fold measured now: the base bucket comes from the table it extends.
    existing = TuningTable("NVIDIA H200", LLAMA_8B, "bfloat16", {}, tuple(buckets))
    again, kept = buckets_for([Measured("o", rows, (16, 128, 4), 9.0, (32, 128, 4), 7.0, adapters=8)],
                              "gemm_tma_tilings", 0.02, existing)
    assert "base" in kept
    redone = TuningTable("NVIDIA H200", LLAMA_8B, "bfloat16", {}, tuple(again)).tunings(DEFAULT_TUNING)
    assert redone.for_step(rows, 8).gemm_split_k["down"] == 4
    assert redone.for_step(rows, 8).fold_tilings["o"] == (32, 128, 4)


def test_the_shape_is_a_tp_ranks_shard_as_the_node_keys_it(tiny_llama_path, tmp_path) -> None:
    """The sweep's shape of a model split over N ranks is the table key a node with
    --tensor-parallel-size N looks up on every rank (its shard's shapes)."""
    from inference_node.model.config import ModelConfig
    from inference_node.parallel.shard import Shard

    assert model_shape(str(config_dir(tmp_path, "1b")), 1).key == "h2048_i8192_q32_kv8_d64"
    assert model_shape(str(config_dir(tmp_path, "8b")), 1) == LLAMA_8B
    assert model_shape(str(config_dir(tmp_path, "70b")), 4).key == "h8192_i7168_q16_kv2_d128"
    full = ModelConfig.from_checkpoint(tiny_llama_path)
    assert model_shape(str(tiny_llama_path), 1) == ModelShape.of(full) == TINY
    for rank in range(2):  # every rank's shard, as node.load_rank builds it
        assert model_shape(str(tiny_llama_path), 2) == ModelShape.of(Shard(rank, 2).local_config(full))
    with pytest.raises(SystemExit, match="--tensor-parallel-size 16: .*8 key/value heads"):
        model_shape(str(config_dir(tmp_path, "8b")), 16)
    with pytest.raises(SystemExit, match="--model .*no-such-model"):
        model_shape(str(tmp_path / "no-such-model"), 1)


def test_the_cases_go_most_used_first_each_fold_in_the_nodes_mode() -> None:
    """Every batch's base GEMM before any fold: a budget cut short leaves folds unmeasured,
    never a batch's base GEMM."""
    todo, notes = cases(TINY, [64, 8, 1], [0, 32, 1], list(GROUPS), DEFAULT_TUNING, torch.device("cpu"))
    assert [c.key for c in todo] == [
        ("qkv", 64, 0), ("o", 64, 0), ("gate_up", 64, 0), ("down", 64, 0),
        ("qkv", 8, 0), ("o", 8, 0), ("gate_up", 8, 0), ("down", 8, 0),
        ("qkv", 1, 0), ("o", 1, 0), ("gate_up", 1, 0), ("down", 1, 0),
        ("qkv", 64, 32), ("o", 64, 32), ("gate_up", 64, 32), ("o", 64, 1),
        ("o", 8, 1), ("o", 1, 1)]  # no 32 adapters in 8 rows
    assert [c.expand for c in todo if c.adapters] == [False, False, False, True, True, True]
    assert "batch 64, 32 adapters: the step does not fold down: not swept" in notes
    folds_only, _ = cases(TINY, [64, 8], [32, 1], list(GROUPS), DEFAULT_TUNING, torch.device("cpu"))
    assert [c.key for c in folds_only] == [
        ("qkv", 64, 32), ("o", 64, 32), ("gate_up", 64, 32), ("o", 64, 1), ("o", 8, 1)]


def test_the_table_holds_only_real_gains_and_a_bucket_without_any_the_defaults() -> None:
    default_qkv, default_o = DEFAULT_TUNING.gemm_tma_tilings["qkv"], DEFAULT_TUNING.gemm_tma_tilings["o"]
    results = [
        Measured("qkv", 8, default_qkv, 10.0, (64, 128, 4), 9.0),   # 10% faster: taken
        Measured("o", 8, default_o, 10.0, (32, 128, 4), 9.9),       # 1%: noise, not taken
        Measured("qkv", 32, default_qkv, 10.0, default_qkv, 10.0),  # the default is best
        Measured("o", 32, default_o, 10.0, (32, 256, 3), 9.95),
    ]
    buckets, kept = buckets_for(results, "gemm_tma_tilings", 0.02)
    table = TuningTable("NVIDIA H100 80GB HBM3", LLAMA_8B, "bfloat16", {}, tuple(buckets))
    assert [(b.batch, b.adapters) for b in table.buckets] == [(8, 0), (32, 0)] and kept == []
    assert table.to_json()["buckets"][0]["choices"] == {"gemm_tma_tilings": {"qkv": [64, 128, 4]}}
    assert table.to_json()["buckets"][1]["choices"] == {}
    steps = table.tunings(DEFAULT_TUNING)
    assert steps.for_step(4).gemm_tma_tilings["qkv"] == steps.for_step(8).gemm_tma_tilings["qkv"] == (64, 128, 4)
    assert steps.for_step(16) == steps.for_step(64) == DEFAULT_TUNING  # batch 32's: not batch 8's


def test_the_fold_is_swept_in_the_mode_the_node_runs_each_group() -> None:
    """The defaults: o folds whole in steps of up to 8 adapters; in steps of more q/k/v,
    gate/up and o only shrink; down never folds. Another tuning's fold sets are followed."""
    assert fold_modes(list(GROUPS), 1) == fold_modes(list(GROUPS), 8) == {"o": True}
    assert fold_modes(list(GROUPS), 16) == fold_modes(list(GROUPS), 32) == {
        "qkv": False, "o": False, "gate_up": False}
    assert fold_modes(["down", "o"], 32) == {"o": False}
    other = DEFAULT_TUNING.replace(fold_groups=frozenset({"o", "down"}), shrink_fold_groups=frozenset())
    assert fold_modes(list(GROUPS), 32, other) == {"o": True, "down": True}


def test_a_tensor_parallel_sweep_folds_as_a_rank_does() -> None:
    """Under tensor parallelism o's delta must be in its partial output before the all-reduce:
    o folds whole in steps of many adapters too (a shrink-only fold's tiling would be applied
    to a whole one), while q/k/v and gate/up still only shrink in their matmul."""
    from inference_node.parallel.shard import tensor_parallel_tuning

    rank = tensor_parallel_tuning(DEFAULT_TUNING)
    assert fold_modes(list(GROUPS), 8, rank) == {"o": True}
    assert fold_modes(list(GROUPS), 32, rank) == {"qkv": False, "o": True, "gate_up": False}
    assert fold_modes(list(GROUPS), 32) == {"qkv": False, "o": False, "gate_up": False}


def test_fold_candidates_keep_every_tile_inside_one_slice() -> None:
    """gate/up of the tiny model: two slices of 160 columns; a 64- or 128-column tile would
    straddle them (the node runs the reference there), so only 16, 32 and the default."""
    w = torch.empty(320, 64, dtype=torch.float32, device="meta").t()
    assert slice_widths(TINY, "gate_up") == [160, 160]
    plain = candidates(w, "gate_up", "fold_tilings")
    folded = candidates(w, "gate_up", "fold_tilings", slice_offsets=(0, 160))
    assert folded[0] == plain[0]  # the default first, as the node runs it
    assert {t[0] for t in plain[1:]} == {16, 32, 64} and {t[0] for t in folded[1:]} == {16, 32}
    q = torch.empty(4096, 6144, dtype=torch.bfloat16, device="meta").t()  # q/k/v of Llama-3.1-8B
    assert len(candidates(q, "qkv", "fold_tilings", slice_offsets=(0, 4096, 5120))) > 10


@pytest.mark.parametrize("expand", [True, False])
def test_the_fold_reference_check_sees_a_wrong_delta(expand: bool) -> None:
    """The node's fold (here its reference) matches x @ W + the delta, grouped rows of 4
    adapters; a wrong B (expand=True) or wrong stored shrink rows (expand=False) do not."""
    gen = torch.Generator().manual_seed(1)
    N, K = TINY.gemms()["qkv"]
    w = (torch.randn(N, K, generator=gen) * K ** -0.5).t()
    (lora,) = fold_copies(K, slice_widths(TINY, "qkv"), 8, 4, 16, expand, 1, torch.device("cpu"),
                          torch.float32, gen)
    assert lora.token_slots.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert lora.segment_table[:, :3].tolist() == [[s, 2 * s, 2] for s in range(4)]
    x = torch.randn(8, K, generator=gen)
    ref = x @ w + lora.delta(x)
    delta = (ref - x @ w).norm() / ref.norm()
    assert delta > 0.3  # the delta weighs in the check
    y = DecodeGemm(torch.device("cpu"))(x, w, group="qkv", lora=lora)
    assert ((folded_output(y, lora) - ref).norm() / ref.norm()) < 1e-5
    if expand:
        lora.b_all[1].zero_()
        y = DecodeGemm(torch.device("cpu"))(x, w, group="qkv", lora=lora)
    else:
        lora.xa[2:4] = 0  # adapter 1's rows as if no shrink had stored them
    assert ((folded_output(y, lora) - ref).norm() / ref.norm()) > 0.05


def fold_result(group: str, batch: int, adapters: int, best: tuple, gain: float) -> Measured:
    default = DEFAULT_TUNING.fold_tilings[group]
    return Measured(group, batch, default, 10.0, best, 10.0 / gain, (), adapters, adapters < 16)


def table_of(results: list[Measured], existing: TuningTable | None = None) -> TuningTable:
    buckets, kept = buckets_for(results, "gemm_tma_tilings", 0.02, existing)
    return TuningTable("NVIDIA H100 80GB HBM3", LLAMA_8B, "bfloat16", {}, tuple(buckets), ",".join(kept))


def test_fold_winners_go_into_adapter_buckets_over_their_batchs_base_choices() -> None:
    base = [Measured("qkv", 32, DEFAULT_TUNING.gemm_tma_tilings["qkv"], 10.0, (16, 256, 4), 9.0),
            Measured("qkv", 64, DEFAULT_TUNING.gemm_tma_tilings["qkv"], 10.0, (64, 128, 4), 9.0)]
    folds = [fold_result("o", 64, 1, (32, 128, 4), 1.2),
             fold_result("qkv", 64, 32, (16, 256, 3), 1.1), fold_result("o", 64, 32, (64, 128, 2), 1.01),
             fold_result("o", 64, 8, DEFAULT_TUNING.fold_tilings["o"], 1.0)]
    table = table_of(base + folds)
    assert [(b.batch, b.adapters) for b in table.buckets] == [(32, 0), (64, 0), (64, 1), (64, 8), (64, 32)]
    raw = {(b["batch"], b["adapters"]): b["choices"] for b in table.to_json()["buckets"]}
    assert raw[64, 32] == {"gemm_tma_tilings": {"qkv": [64, 128, 4]}, "fold_tilings": {"qkv": [16, 256, 3]}}
    assert raw[64, 8] == {"gemm_tma_tilings": {"qkv": [64, 128, 4]}}  # no gain: stops (64, 1)'s
    steps = TuningTable.from_json(table.to_json()).tunings(DEFAULT_TUNING)
    assert steps.for_step(64, 32).fold_tilings["qkv"] == (16, 256, 3)
    assert steps.for_step(64, 32).fold_tilings["o"] == DEFAULT_TUNING.fold_tilings["o"]  # 1%: noise
    assert steps.for_step(64, 2).fold_tilings["o"] == (32, 128, 4)
    assert steps.for_step(64, 16).fold_tilings == DEFAULT_TUNING.fold_tilings
    for adapters in (0, 1, 8, 32):  # the base GEMM of a step with adapters: its batch's tiling
        assert steps.for_step(64, adapters).gemm_tma_tilings["qkv"] == (64, 128, 4)
    assert steps.for_step(64, 0).fold_tilings == DEFAULT_TUNING.fold_tilings

    # A later sweep keeps every bucket of the table there that it did not measure.
    new_base = [Measured("qkv", 64, DEFAULT_TUNING.gemm_tma_tilings["qkv"], 10.0, (128, 128, 4), 8.0)]
    again = table_of(new_base, table)
    raw = {(b["batch"], b["adapters"]): b["choices"] for b in again.to_json()["buckets"]}
    assert list(raw) == [(32, 0), (64, 0), (64, 1), (64, 8), (64, 32)]
    assert raw[32, 0] == {"gemm_tma_tilings": {"qkv": [16, 256, 4]}}
    assert raw[64, 32] == {"gemm_tma_tilings": {"qkv": [128, 128, 4]}, "fold_tilings": {"qkv": [16, 256, 3]}}
    assert again.produced_by == "base,fold"  # the kinds kept
    new_fold = [fold_result("o", 32, 16, (16, 256, 4), 1.5), fold_result("qkv", 64, 32, (64, 128, 4), 1.3)]
    again = table_of(new_fold, table)
    raw = {(b["batch"], b["adapters"]): b["choices"] for b in again.to_json()["buckets"]}
    assert list(raw) == [(32, 0), (32, 16), (64, 0), (64, 1), (64, 8), (64, 32)]
    assert raw[32, 16] == {"gemm_tma_tilings": {"qkv": [16, 256, 4]}, "fold_tilings": {"o": [16, 256, 4]}}
    assert raw[64, 32]["fold_tilings"] == {"qkv": [64, 128, 4]}  # re-tuned: the new sweep's
    assert raw[64, 1]["fold_tilings"] == {"o": [32, 128, 4]}  # not swept again: kept


def tune(tmp_path: Path, model: Path, *args: str, interpret: bool = False, timeout: float = 300) -> str:
    """`inference-node tune --device cpu` (the smoke) into tmp_path/out; its stdout."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, "-m", "inference_node.cli", "tune", "--device", "cpu",
                           "--model", str(model), "--out", str(tmp_path / "out"), *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def read_back(tmp_path: Path, shape: ModelShape = TINY) -> TuningTable:
    key = key_for(torch.device("cpu"), shape, torch.float32)
    table = usable(tmp_path / "out" / key.name, key, check_versions=True)
    assert table is not None
    return table


def test_the_cpu_smoke_writes_a_table_the_node_reads(tiny_llama_path: Path, tmp_path: Path) -> None:
    out = tune(tmp_path, tiny_llama_path, "--batches", "4,1", "--adapters", "0")
    assert out.startswith("CPU SMOKE")
    table = read_back(tmp_path)
    assert f"wrote {table.path}" in out
    assert (table.device, table.shape, table.dtype) == ("cpu", TINY, "float32")
    assert table.tuning_s is not None and table.tuning_s >= 0 and table.unmeasured == ()
    assert table.produced_by.startswith("inference-node tune --device cpu")
    assert [b.batch for b in table.buckets] == [1, 4]  # every batch measured has its bucket
    for bucket in table.buckets:
        assert set(bucket.choices) <= {"gemm_tilings"}
    for group in ("qkv", "o", "gate_up"):  # down's K (160) takes no tiling: cuBLAS, not swept
        assert any(line.split()[:2] == [group, "1"] for line in out.splitlines()), out


def test_the_cpu_smoke_sweeps_the_fold_and_adds_it_to_the_table_there(tiny_llama_path, tmp_path) -> None:
    tune(tmp_path, tiny_llama_path, "--batches", "1,16", "--adapters", "0")
    base = read_back(tmp_path)
    out = tune(tmp_path, tiny_llama_path, "--batches", "1,16", "--adapters", "16,1")
    assert "rejected" not in out, out
    table = read_back(tmp_path)
    assert [(b.batch, b.adapters) for b in table.buckets] == [(1, 0), (1, 1), (16, 0), (16, 1), (16, 16)]
    assert [b for b in table.buckets if b.adapters == 0] == list(base.buckets)  # kept
    for bucket in table.buckets:
        assert set(bucket.choices) <= {"gemm_tilings", "fold_tilings"}
        if bucket.adapters:  # its batch's base choices under it
            assert bucket.choices.get("gemm_tilings") == base.tunings(DEFAULT_TUNING).for_step(
                bucket.batch).gemm_tilings or "gemm_tilings" not in bucket.choices
    lines = out.splitlines()
    for group, batch, adapters, mode in [("o", 1, 1, "whole"), ("o", 16, 1, "whole"), ("qkv", 16, 16, "shrink"),
                                         ("o", 16, 16, "shrink"), ("gate_up", 16, 16, "shrink")]:
        assert any(line.split()[:4] == [group, str(batch), str(adapters), mode] for line in lines), out
    assert "base buckets kept from" in table.produced_by
    assert table.tuning_s >= base.tuning_s  # the two runs' time


def test_the_fold_sweep_runs_the_plan_of_the_tables_node_choices(tiny_llama_path, tmp_path) -> None:
    """A table there whose node choices spread a group's folded shrink over its tile programs
    (the H100 8B table does so for down; here gate/up, with no side-stream expands): the fold
    sweep times it in that mode, its shrink's partial sums checked against the reference, and
    keeps the node choices."""
    tune(tmp_path, tiny_llama_path, "--batches", "16", "--adapters", "0")
    path = read_back(tmp_path).path
    raw = json.loads(path.read_text())
    raw["node"] = {"shrink_fold_groups": ["qkv", "o", "gate_up", "down"], "fold_shrink_spread": ["gate_up"],
                   "side_expand_segments": 0, "side_expand_group_segments": {}}
    path.write_text(json.dumps(raw))
    out = tune(tmp_path, tiny_llama_path, "--groups", "gate_up,o", "--batches", "16", "--adapters", "1")
    assert "rejected" not in out, out
    # 4 SMs on a CPU (kernels.host.num_sms) over 1 adapter's 2 slices: 2 K ranges.
    assert any(line.split()[:4] == ["gate_up", "16", "1", "spread"] for line in out.splitlines()), out
    assert any(line.split()[:4] == ["o", "16", "1", "shrink"] for line in out.splitlines()), out
    table = read_back(tmp_path)
    assert table.node["fold_shrink_spread"] == frozenset({"gate_up"})
    assert table.node["shrink_fold_groups"] == frozenset(GROUPS)


def test_a_rank_s_plan_holds_for_every_bucket_of_the_fold_sweep(tmp_path: Path) -> None:
    """Under --tensor-parallel-size o folds whole at every adapter count (its delta must be in
    its partial output before the all-reduce), also in the buckets after the first."""
    out = tune(tmp_path, config_dir(tmp_path, "1b"), "--tp", "2", "--groups", "o", "--batches", "16",
               "--adapters", "1,16")
    for adapters in (1, 16):
        assert any(line.split()[:4] == ["o", "16", str(adapters), "whole"] for line in out.splitlines()), out
    assert read_back(tmp_path, ModelShape(2048, 4096, 16, 4, 64)).buckets


@pytest.mark.interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the GPU tests sweep")
def test_the_fold_sweep_runs_the_fold_kernel_in_the_interpreter(tiny_llama_path, tmp_path) -> None:
    """Both of the fold kernel's modes (whole at 1 adapter, shrink only at 16), every
    candidate matching the reference."""
    out = tune(tmp_path, tiny_llama_path, "--groups", "qkv,o", "--batches", "16", "--adapters", "16,1",
               interpret=True, timeout=300)
    assert "rejected" not in out, out
    table = read_back(tmp_path)
    assert [(b.batch, b.adapters) for b in table.buckets] == [(16, 1), (16, 16)]
    rows = [line.split()[:4] for line in out.splitlines()]
    for row in (["o", "16", "1", "whole"], ["qkv", "16", "16", "shrink"], ["o", "16", "16", "shrink"]):
        assert row in rows, out


def test_a_bucket_is_checked_at_its_largest_step() -> None:
    """A tiling chosen at a bucket's batch serves steps down to the next smaller bucket, and the
    largest bucket's every step above it too: where those compile a larger row tile, the
    sweep also runs it there (shared memory grows with it)."""
    batches = [64, 32, 16, 8, 1]
    assert [bucket_top(b, batches) for b in batches] == [64, 32, 16, 8, 1]
    assert bucket_top(16, [16, 8]) == 64
    assert same_row_tile(1, 7) and same_row_tile(8, 15) and same_row_tile(16, 16)
    assert not same_row_tile(16, 31) and not same_row_tile(32, 63)
    assert bucket_top(4, [1, 4]) == 64  # the last bucket runs up to the decode GEMM's rows


def test_the_sweep_times_inputs_stored_as_the_nodes_whole_row_tiles() -> None:
    """The node's ops allocate a decode GEMM's input over its whole row tile (empty_rows), so
    its TMA descriptor never zero-fills rows past the batch: the sweep's x is stored alike."""
    from inference_node.tuner.sweep import Sweep
    from inference_node.tuner.trial import Case, cpu_timer
    from kernels.gemm.shapes import row_tile, tma_rows

    sweep = Sweep(TINY, torch.device("cpu"), torch.bfloat16, "gemm_tma_tilings", cpu_timer, [64, 32, 8, 1])
    for batch in (1, 8, 32):
        (x,) = sweep._inputs(Case("qkv", batch), TINY.hidden)
        assert x.shape == (batch, TINY.hidden) and tma_rows(x, row_tile(batch)) == row_tile(batch)


def test_each_best_launch_is_printed_against_its_floor(capsys: pytest.CaptureFixture[str]) -> None:
    """A launch's floor is its bytes (weight, x and y; a fold adds its adapters' A per slice and,
    where it expands, B) at the copy bandwidth; the row prints best us over that floor."""
    assert launch_bytes(N=64, K=32, batch=2, esize=2) == (64 * 32 + 2 * (32 + 64)) * 2
    shrink = launch_bytes(N=64, K=32, batch=2, esize=2, adapters=4, rank=16, slices=2, expand=False)
    whole = launch_bytes(N=64, K=32, batch=2, esize=2, adapters=4, rank=16, slices=2, expand=True)
    assert shrink - launch_bytes(N=64, K=32, batch=2, esize=2) == 4 * 16 * 2 * 32 * 2
    assert whole - shrink == 4 * 16 * 64 * 2
    nbytes = 3_000_000  # 1 us at 3 TB/s
    print_results([Measured("qkv", 64, (32, 128, 4), 2.0, (16, 128, 4), 1.5, nbytes=nbytes)],
                  smoke=False, bandwidth=3e12)
    row = capsys.readouterr().out.strip().splitlines()[-1].split()
    assert row[-2:] == ["1.00", "1.50"], row
    print_results([Measured("qkv", 64, (32, 128, 4), 2.0, (16, 128, 4), 1.5, nbytes=nbytes)], smoke=True)
    assert capsys.readouterr().out.strip().splitlines()[-1].split()[-2:] == ["-", "-"]


def test_tune_refuses_what_it_cannot_do(tmp_path: Path, capsys) -> None:
    from inference_node.cli import main

    if not torch.cuda.is_available():
        assert main(["tune", "--device", "cuda", "--model", str(config_dir(tmp_path, "tiny"))]) == 1
        assert "no CUDA device is available (--device cpu runs a smoke" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--batches '8,x'"):
        main(["tune", "--device", "cpu", "--model", str(config_dir(tmp_path, "tiny")), "--batches", "8,x"])
    with pytest.raises(SystemExit, match="--groups 'lm_head'"):
        main(["tune", "--device", "cpu", "--model", str(config_dir(tmp_path, "tiny")), "--groups", "lm_head"])


def tiny_moe(tmp_path: Path) -> tuple[Path, ModelShape]:
    """A Qwen3-MoE config.json of tiny widths (4 experts of 32 columns, 2 a token)."""
    from bench.shapes import QWEN3_30B_A3B

    folder = tmp_path / "moe"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({
        **QWEN3_30B_A3B, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
        "num_experts": 4, "num_experts_per_tok": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "num_hidden_layers": 2, "vocab_size": 1000}))
    return folder, ModelShape(64, 32, 4, 2, 16, experts=4, top_k=2)


def test_a_mixture_of_experts_sweeps_its_grouped_gemms_and_no_dense_mlp(tmp_path: Path) -> None:
    """Its experts' gate/up and down grouped GEMMs are cases of each batch, beside q/k/v and o
    (it has no dense gate/up or down), and their pairs' LoRA launches cases of each adapter
    count; the winners go into the batch's bucket as moe_tilings."""
    model, shape = tiny_moe(tmp_path)
    assert model_shape(str(model), 1) == shape and model_shape(str(model), 2) == ModelShape(64, 16, 2, 1, 16, 4, 2)
    todo, _ = cases(shape, [8], [0, 1], list(GROUPS + EXPERT_GROUPS), DEFAULT_TUNING, torch.device("cpu"))
    assert [c.key for c in todo] == [("qkv", 8, 0), ("o", 8, 0), ("experts.gate_up", 8, 0),
                                     ("experts.down", 8, 0), ("o", 8, 1), ("experts.gate_up", 8, 1),
                                     ("experts.down", 8, 1)]
    assert todo[-1].describe() == "experts.down LoRA launches batch 8, 1 adapters"
    out = tune(tmp_path, model, "--batches", "4,1", "--adapters", "0")
    rows = [line.split()[:2] for line in out.splitlines()]
    for group in ("qkv", "o", "experts.gate_up", "experts.down"):
        assert [group, "1"] in rows and [group, "4"] in rows, out
    assert not any(row[0] in ("gate_up", "down") for row in rows if row), out
    assert "rejected" not in out, out
    table = read_back(tmp_path, shape)
    assert table.shape == shape and [b.batch for b in table.buckets] == [1, 4]
    assert all(set(b.choices) <= {"gemm_tilings", "moe_tilings"} for b in table.buckets)


def test_the_experts_winners_become_the_buckets_moe_tilings() -> None:
    gate_up, down = DEFAULT_TUNING.moe_tilings["gate_up"], DEFAULT_TUNING.moe_tilings["down"]
    results = [Measured("experts.gate_up", 16, gate_up, 10.0, (128, 128, 3), 8.0),
               Measured("experts.down", 16, down, 10.0, (32, 128, 4), 9.99),  # noise: not taken
               Measured("experts.down", 64, down, 10.0, (64, 64, 4), 7.0)]
    buckets, _ = buckets_for(results, "gemm_tma_tilings", 0.02)
    steps = TuningTable("cpu", TINY, "float32", {}, tuple(buckets)).tunings(DEFAULT_TUNING)
    assert steps.for_step(16).moe_tilings == {"gate_up": (128, 128, 3), "down": down}
    assert steps.for_step(64).moe_tilings == {"gate_up": gate_up, "down": (64, 64, 4)}
    assert steps.for_step(8) == steps.for_step(16)  # below the smallest bucket: it


def test_the_experts_lora_winners_become_the_fold_buckets_moe_lora_launches() -> None:
    """A pair LoRA launch that wins at (batch, adapters) goes into that bucket's
    moe_lora_launches (beside a dense group's fold tiling), never into fold_tilings."""
    default = DEFAULT_TUNING.moe_lora_launches
    results = [Measured("experts.gate_up", 16, default["gate_up"], 10.0, (0, 128, 4), 8.0, adapters=8),
               Measured("experts.down", 16, default["down"], 10.0, (1, 128, 2), 7.0, adapters=8),
               Measured("o", 16, DEFAULT_TUNING.fold_tilings["o"], 10.0, (32, 128, 4), 8.0, adapters=8)]
    buckets, _ = buckets_for(results, "gemm_tma_tilings", 0.02)
    step = TuningTable("cpu", TINY, "float32", {}, tuple(buckets)).tunings(DEFAULT_TUNING).for_step(16, 8)
    assert step.moe_lora_launches == {"gate_up": (0, 128, 4), "down": (1, 128, 2)}
    assert step.fold_tilings == {**DEFAULT_TUNING.fold_tilings, "o": (32, 128, 4)}


def test_the_cpu_smoke_sweeps_a_mixture_of_experts_lora_launches(tmp_path: Path) -> None:
    """`tune --adapters 0,2` on a mixture of experts measures each expert group's pair LoRA
    launches (through the reference on the CPU), every option checked first."""
    model, shape = tiny_moe(tmp_path)
    out = tune(tmp_path, model, "--batches", "4", "--adapters", "0,2")
    rows = [line.split()[:4] for line in out.splitlines()]
    for group in ("experts.gate_up", "experts.down"):
        assert [group, "4", "2", "launch"] in rows, out
    assert "rejected" not in out, out
    table = read_back(tmp_path, shape)
    assert all(set(b.choices) <= {"gemm_tilings", "moe_tilings", "fold_tilings", "moe_lora_launches"}
               for b in table.buckets)


@pytest.mark.interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the GPU tests sweep")
def test_the_experts_sweep_runs_the_grouped_gemms_in_the_interpreter(tmp_path: Path) -> None:
    """Every candidate tiling of both grouped GEMMs matches the reference through the node's
    dispatch, and every pair LoRA launch the pair reference (Triton's interpreter)."""
    model, shape = tiny_moe(tmp_path)
    out = tune(tmp_path, model, "--groups", "experts.gate_up,experts.down", "--batches", "4", "--adapters", "0,2",
               interpret=True, timeout=300)
    assert "rejected" not in out, out
    rows = [line.split()[:3] for line in out.splitlines()]
    assert ["experts.gate_up", "4", "0"] in rows and ["experts.down", "4", "0"] in rows, out
    # and each group's pair LoRA launches (one launch or two, tiles, warps) against the reference
    assert ["experts.gate_up", "4", "2"] in rows and ["experts.down", "4", "2"] in rows, out
