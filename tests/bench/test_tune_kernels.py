"""bench/tune_kernels.py: its candidate tilings are the ones the node would launch, the table
it writes holds a bucket's best tiling only where it beats the default (and stops smaller
buckets' entries at the buckets where none does), and its CPU smoke (the PyTorch reference,
numbers meaningless) writes a table the node's loader reads back. The fold sweep
(--fields fold): it times the groups the node folds at each adapter count in the node's mode,
its reference check catches a wrong output or wrong stored shrink rows, and its winners go
into (batch, adapters) buckets over the base choices of their batch, kept or swept."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.tune_kernels import (Measured, candidates, fold_copies, fold_modes, folded_output, launch_bytes,
                                model_shape, print_results, slice_widths, table_for)
from kernels.gemm import DecodeGemm
from kernels.gemm.shapes import SHARED_MEMORY
from kernels.tuning import DEFAULT_TUNING, GROUPS
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


TINY = ModelShape(hidden=64, intermediate=160, heads=4, kv_heads=2, head_dim=16)


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


def test_fold_winners_go_into_adapter_buckets_over_their_batchs_base_choices() -> None:
    shape = model_shape("llama-8b-random")
    base = [Measured("qkv", 32, DEFAULT_TUNING.gemm_tma_tilings["qkv"], 10.0, (16, 256, 4), 9.0),
            Measured("qkv", 64, DEFAULT_TUNING.gemm_tma_tilings["qkv"], 10.0, (64, 128, 4), 9.0)]
    folds = [fold_result("o", 64, 1, (32, 128, 4), 1.2),
             fold_result("qkv", 64, 32, (16, 256, 3), 1.1), fold_result("o", 64, 32, (64, 128, 2), 1.01),
             fold_result("o", 64, 8, DEFAULT_TUNING.fold_tilings["o"], 1.0)]
    table = table_for(base + folds, "gemm_tma_tilings", "NVIDIA H100 80GB HBM3", shape, 0.02, "test")
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
    again = table_for(new_base, "gemm_tma_tilings", table.device, shape, 0.02, "base again", table)
    raw = {(b["batch"], b["adapters"]): b["choices"] for b in again.to_json()["buckets"]}
    assert list(raw) == [(32, 0), (64, 0), (64, 1), (64, 8), (64, 32)]
    assert raw[32, 0] == {"gemm_tma_tilings": {"qkv": [16, 256, 4]}}
    assert raw[64, 32] == {"gemm_tma_tilings": {"qkv": [128, 128, 4]}, "fold_tilings": {"qkv": [16, 256, 3]}}
    assert "base and fold buckets kept from: test" in again.produced_by
    new_fold = [fold_result("o", 32, 16, (16, 256, 4), 1.5), fold_result("qkv", 64, 32, (64, 128, 4), 1.3)]
    again = table_for(new_fold, "gemm_tma_tilings", table.device, shape, 0.02, "fold again", table)
    raw = {(b["batch"], b["adapters"]): b["choices"] for b in again.to_json()["buckets"]}
    assert list(raw) == [(32, 0), (32, 16), (64, 0), (64, 1), (64, 8), (64, 32)]
    assert raw[32, 16] == {"gemm_tma_tilings": {"qkv": [16, 256, 4]}, "fold_tilings": {"o": [16, 256, 4]}}
    assert raw[64, 32]["fold_tilings"] == {"qkv": [64, 128, 4]}  # re-tuned: the new sweep's
    assert raw[64, 1]["fold_tilings"] == {"o": [32, 128, 4]}  # not swept again: kept


def run_smoke(*args: str, interpret: bool = False, timeout: float = 300) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, "-m", "bench.tune_kernels", "--smoke", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_the_cpu_smoke_sweeps_the_fold_and_adds_it_to_the_table_there(tmp_path: Path) -> None:
    shape = model_shape("tiny")
    run_smoke("--batches", "1,16", "--out", str(tmp_path))
    base = load_table("auto", "cpu", shape, tmp_path)
    out = run_smoke("--fields", "fold", "--batches", "1,16", "--adapters", "16,1", "--out", str(tmp_path))
    assert "rejected" not in out, out
    table = load_table("auto", "cpu", shape, tmp_path)
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
    assert "batch 16, 16 adapters: the step does not fold down: not swept" in out
    assert "base buckets kept from" in table.produced_by


def test_the_fold_sweep_runs_the_plan_of_the_tables_node_choices(tmp_path: Path) -> None:
    """A table there whose node choices spread a group's folded shrink over its tile programs
    (the H100 8B table does so for down; here gate/up, with no side-stream expands): the fold
    sweep times it in that mode, its shrink's partial sums checked against the reference, and
    keeps the node choices."""
    import json

    shape = model_shape("tiny")
    run_smoke("--batches", "16", "--out", str(tmp_path))
    path = tmp_path / table_name("cpu", shape)
    raw = json.loads(path.read_text())
    raw["node"] = {"shrink_fold_groups": ["qkv", "o", "gate_up", "down"], "fold_shrink_spread": ["gate_up"],
                   "side_expand_segments": 0, "side_expand_group_segments": {}}
    path.write_text(json.dumps(raw))
    out = run_smoke("--fields", "fold", "--groups", "gate_up,o", "--batches", "16", "--adapters", "1",
                    "--out", str(tmp_path))
    assert "rejected" not in out, out
    # 4 SMs on a CPU (kernels.host.num_sms) over 1 adapter's 2 slices: 2 K ranges.
    assert "gate_up fold batch 16, 1 adapters (shrink spread over 2 K ranges)" in out, out
    assert "o fold batch 16, 1 adapters (shrink only)" in out, out
    assert any(line.split()[:4] == ["gate_up", "16", "1", "spread"] for line in out.splitlines()), out
    table = load_table("auto", "cpu", shape, tmp_path)
    assert table.node["fold_shrink_spread"] == frozenset({"gate_up"})
    assert table.node["shrink_fold_groups"] == frozenset(GROUPS)


def test_a_rank_s_plan_holds_for_every_bucket_of_the_fold_sweep(tmp_path: Path) -> None:
    """Under --tp o folds whole at every adapter count (its delta must be in its partial
    output before the all-reduce), also in the buckets after the first."""
    out = run_smoke("--model", "llama-1b-random", "--tp", "2", "--fields", "fold", "--groups", "o",
                    "--batches", "16", "--adapters", "1,16", "--out", str(tmp_path))
    for adapters in (1, 16):
        assert f"o fold batch 16, {adapters} adapters (expand)" in out, out


@pytest.mark.interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the sweep is run by hand")
def test_the_fold_sweep_runs_the_fold_kernel_in_the_interpreter(tmp_path: Path) -> None:
    """Both of the fold kernel's modes (whole at 1 adapter, shrink only at 16), every
    candidate matching the reference (took 12 s on a shared two-core machine)."""
    out = run_smoke("--fields", "fold", "--groups", "qkv,o", "--batches", "16", "--adapters", "16,1",
                    "--out", str(tmp_path), interpret=True, timeout=240)
    assert "rejected" not in out, out
    table = load_table("auto", "cpu", model_shape("tiny"), tmp_path)
    assert [(b.batch, b.adapters) for b in table.buckets] == [(16, 1), (16, 16)]
    for needle in ("o fold batch 16, 1 adapters (expand): 3 tilings timed",
                   "qkv fold batch 16, 16 adapters (shrink only): 3 tilings timed",
                   "o fold batch 16, 16 adapters (shrink only): 3 tilings timed"):
        assert needle in out, out


@pytest.mark.gpu
def test_the_fold_sweep_on_the_gpu_writes_adapter_buckets(tmp_path: Path) -> None:
    """o at batch 64 with 1 and 32 adapters (whole and shrink only) of Llama-3.2-1B's shapes:
    every candidate checked against the reference."""
    from kernels.tuning_table import device_name

    proc = subprocess.run([sys.executable, "-m", "bench.tune_kernels", "--model", "llama-1b-random",
                           "--fields", "fold", "--batches", "64", "--adapters", "32,1", "--groups", "o",
                           "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = load_table("auto", device_name(torch.device("cuda")), model_shape("llama-1b-random"), tmp_path)
    assert table is not None and [(b.batch, b.adapters) for b in table.buckets] == [(64, 1), (64, 32)]
    assert "rel err" not in proc.stdout, proc.stdout
    print(proc.stdout)


def test_a_bucket_is_checked_at_its_largest_step() -> None:
    """A tiling chosen at a bucket's batch serves steps up to the next bucket: where those
    compile a larger row tile, the sweep also runs it there (shared memory grows with it)."""
    from bench.tune_kernels import bucket_top, same_row_tile

    batches = [64, 32, 16, 8, 1]
    assert [bucket_top(b, batches) for b in batches] == [64, 63, 31, 15, 7]
    assert same_row_tile(1, 7) and same_row_tile(8, 15) and same_row_tile(16, 16)
    assert not same_row_tile(16, 31) and not same_row_tile(32, 63)
    assert bucket_top(4, [1, 4]) == 64  # the last bucket runs up to the decode GEMM's rows


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
