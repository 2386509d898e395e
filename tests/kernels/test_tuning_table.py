"""Tuning tables (kernels/tuning_table.py, kernels/configs/README.md): the file filed for a
(device, shape, dtype) is the one found, a step takes the choices of the nearest bucket at or
above its rows (of at most its adapters), else the base, bad files are refused naming the file, a written
table reads back the same (its metadata too), the repository's seeds are valid, and the node
runs each step (eager, and through the decode graphs' static buffers) with its bucket's Tuning,
the choice flags given winning over the table."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from kernels.tuning import DEFAULT_TUNING, Tuning
from kernels.tuning_table import (CONFIG_DIR, Bucket, ModelShape, TableKey, TuningTable, TuningTableError,
                                  changed_choices, find_table, load_table, table_name)

SHAPE = ModelShape(hidden=64, intermediate=160, heads=4, kv_heads=2, head_dim=16)  # tiny_llama's
OTHER = ModelShape(hidden=2048, intermediate=8192, heads=32, kv_heads=8, head_dim=64)
QKV = {1: [16, 64, 8], 4: [64, 64, 2], "lora": [32, 64, 3]}  # qkv's tiling per bucket below


def table_json(device: str = "cpu", shape: ModelShape = SHAPE, **extra) -> dict:
    raw = {"format": 2, "device": device, "shape": dataclasses.asdict(shape), "dtype": "float32",
           "produced_by": "test",
           "buckets": [
               {"batch": 1, "choices": {"gemm_tilings": {"qkv": QKV[1]}}},
               {"batch": 4, "choices": {"gemm_tilings": {"qkv": QKV[4]}, "pdl": False}},
               {"batch": 4, "adapters": 1, "choices": {"gemm_tilings": {"qkv": QKV["lora"]}}},
               {"batch": 8, "adapters": 2, "choices": {"silu_row_tile": [128, 4]}},
           ]}
    raw.update(extra)
    return raw


def write(path: Path, raw: dict) -> Path:
    path.write_text(json.dumps(raw))
    return path


def test_the_file_for_the_device_shape_and_dtype_is_the_one_found(tmp_path: Path) -> None:
    h100 = "NVIDIA H100 80GB HBM3"
    assert (table_name(h100, OTHER, "bfloat16")
            == "NVIDIA_H100_80GB_HBM3__h2048_i8192_q32_kv8_d64__bfloat16.json")
    write(tmp_path / table_name(h100, OTHER, "float32"), table_json(h100, OTHER, produced_by="h100 1b"))
    write(tmp_path / table_name(h100, SHAPE, "float32"), table_json(h100, SHAPE, produced_by="h100 tiny"))
    write(tmp_path / table_name("NVIDIA H200", OTHER, "float32"), table_json("NVIDIA H200", OTHER, produced_by="h200 1b"))
    assert find_table(h100, OTHER, "float32", tmp_path) == tmp_path / table_name(h100, OTHER, "float32")
    assert find_table("NVIDIA H200", OTHER, "float32", tmp_path).name.startswith("NVIDIA_H200__")
    assert find_table(h100, OTHER, "bfloat16", tmp_path) is None  # another dtype's
    assert find_table("NVIDIA A100-SXM4-80GB", OTHER, "float32", tmp_path) is None
    assert find_table(h100, ModelShape(4096, 14336, 32, 8, 128), "float32", tmp_path) is None
    assert load_table("off", OTHER) is None
    path = tmp_path / table_name(h100, OTHER, "float32")
    assert load_table(str(path), OTHER).produced_by == "h100 1b"  # by path: any device
    with pytest.raises(TuningTableError, match=r"is for shape h2048_i8192_q32_kv8_d64; this node's "
                                               r"\(shard's\) shape is h64_i160_q4_kv2_d16"):
        load_table(str(path), SHAPE)


def test_a_table_says_why_it_is_not_a_keys() -> None:
    """A table names its device, shape and dtype, and records the torch and Triton it was
    tuned with: a key with any of them other is refused (versions only where checked)."""
    key = TableKey("cpu", SHAPE, "float32", torch="2.13.0", triton="3.9.0")
    table = TuningTable.from_json(table_json(versions={"torch": "2.13.0", "triton": "3.9.0"}, tuning_s=42.5))
    assert table.refusal(key) is None and table.tuning_s == 42.5
    assert table.refusal(dataclasses.replace(key, device="NVIDIA H200")) == (
        f"it is for cpu {SHAPE.key} float32, not NVIDIA H200 {SHAPE.key} float32")
    assert "bfloat16" in table.refusal(dataclasses.replace(key, dtype="bfloat16"))
    assert table.refusal(dataclasses.replace(key, shape=OTHER)).startswith(f"it is for cpu {SHAPE.key}")
    newer = dataclasses.replace(key, triton="3.10.0")
    assert table.refusal(newer) == ("it was tuned with torch 2.13.0, triton 3.9.0; this node runs "
                                    "torch 2.13.0, triton 3.10.0")
    assert table.refusal(newer, check_versions=False) is None
    seed = TuningTable.from_json(table_json())  # no versions recorded
    assert seed.versions == {} and seed.tuning_s is None
    assert "unrecorded versions" in seed.refusal(key) and seed.refusal(key, check_versions=False) is None


def test_the_repositorys_seeds_are_valid_and_filed_under_their_key() -> None:
    seeds = sorted(CONFIG_DIR.glob("*.json"))
    assert len(seeds) >= 5
    for path in seeds:
        table = TuningTable.read(path)
        assert path.name == table_name(table.device, table.shape, table.dtype, table.quantization)
        assert table.dtype == "bfloat16" and table.produced_by
        table.tunings(DEFAULT_TUNING)


def test_a_step_takes_the_nearest_bucket_at_or_above_its_rows_then_the_base(tmp_path: Path) -> None:
    """Rows round up to a bucket (the row tile its tilings were timed at; the largest bucket
    serves every step above it), adapters down (the most a bucket's adapter count allows); a
    step no bucket's adapter count admits runs the base."""
    base = DEFAULT_TUNING.replace(gemm_prefetch_k=256)
    table = TuningTable.read(write(tmp_path / "t.json", table_json()))
    steps = table.tunings(base)

    def qkv(rows: int, adapters: int = 0) -> list[int]:
        return list(steps.for_step(rows, adapters).gemm_tilings["qkv"])

    assert qkv(1) == qkv(1, 0) == QKV[1]
    assert qkv(2) == qkv(3) == qkv(4) == qkv(7) == qkv(64) == QKV[4]  # above the largest: the largest
    assert qkv(2, 1) == qkv(4, 1) == qkv(64, 1) == qkv(3, 5) == QKV["lora"]  # (4, 1): the most adapters at 4 rows
    # 5 rows take the 8-row bucket, whose (8, 2) entry holds only the SiLU tile: the defaults'
    # qkv tiling, not another bucket's
    assert qkv(5, 2) == qkv(8, 2) == qkv(5, 32) == list(DEFAULT_TUNING.gemm_tilings["qkv"])
    assert steps.for_step(8, 2).silu_row_tile == (128, 4) and steps.for_step(8, 1).silu_row_tile == (256, 2)
    assert steps.for_step(4).pdl is False and steps.for_step(4, 1).pdl is True  # entries stand alone
    for rows, adapters in [(1, 0), (4, 0), (4, 1), (9, 3)]:  # the base under every entry
        assert steps.for_step(rows, adapters).gemm_prefetch_k == 256
        assert steps.for_step(rows, adapters).gemm_tilings["o"] == DEFAULT_TUNING.gemm_tilings["o"]
    late = TuningTable.from_json(table_json(buckets=[{"batch": 16, "choices": {"pdl": False}},
                                                     {"batch": 16, "adapters": 4, "choices": {"gemm_prefetch_k": 512}}]))
    assert late.tunings(base).for_step(8).pdl is False  # below the smallest bucket: that bucket
    assert late.tunings(base).for_step(8, 4).gemm_prefetch_k == 512 and late.tunings(base).for_step(8, 4).pdl
    folds_only = TuningTable.from_json(table_json(buckets=[{"batch": 16, "adapters": 4, "choices": {"pdl": False}}]))
    assert folds_only.tunings(base).for_step(8, 2) == base  # no bucket of at most 2 adapters


def test_the_runner_builds_each_buckets_launch_choices_once(tmp_path: Path) -> None:
    """runner/launches.py: a step's LaunchChoices carry its bucket's Tuning, one object per
    Tuning (its ops hold a compiled norm on CUDA: a step must not rebuild them), the base's
    where no bucket applies; a table whose Tuning would change the weights' layout
    (gemm_groups, fixed at load) is refused."""
    from inference_node.runner.launches import StepLaunches

    steps = TuningTable.read(write(tmp_path / "t.json", table_json())).tunings(DEFAULT_TUNING)
    launches = StepLaunches(torch.device("cpu"), steps, DEFAULT_TUNING.gemm_groups)
    for rows, adapters in [(1, 0), (3, 5), (4, 0), (64, 0), (4, 1), (8, 2), (9, 3)]:
        launch = launches.for_step(rows, adapters)
        assert launch.tuning is steps.for_step(rows, adapters)
        assert launch.gemm.tuning is launch.tuning and launch.ops.tuning is launch.tuning
        assert launches.for_step(rows, adapters) is launch
    assert launches.for_step(1) is not launches.for_step(4) and launches.for_step(4, 1) is not launches.for_step(4)
    folds_only = TuningTable.from_json(table_json(buckets=[{"batch": 16, "adapters": 2, "choices": {"pdl": False}}]))
    late = folds_only.tunings(DEFAULT_TUNING)
    assert StepLaunches(torch.device("cpu"), late, DEFAULT_TUNING.gemm_groups).for_step(8, 1).tuning is late.base
    with pytest.raises(ValueError, match="gemm_groups sets the weights' layout"):
        StepLaunches(torch.device("cpu"), steps, frozenset({"o"}))


def test_node_choices_apply_to_every_step_and_flags_given_win(tmp_path: Path) -> None:
    raw = table_json(node={"fold_groups": ["o", "down"], "gemm_prefetch_k": 1024})
    table = TuningTable.read(write(tmp_path / "t.json", raw))
    steps = table.tunings(DEFAULT_TUNING)
    assert steps.base.fold_groups == {"o", "down"} and steps.for_step(4, 1).fold_groups == {"o", "down"}
    assert steps.for_step(2).gemm_prefetch_k == 1024
    flags = DEFAULT_TUNING.replace(gemm_tilings={**DEFAULT_TUNING.gemm_tilings, "qkv": (128, 64, 2)},
                                   gemm_prefetch_k=128)
    kept = table.tunings(flags, fixed={"gemm_tilings", "gemm_prefetch_k"})
    for rows, adapters in [(1, 0), (4, 0), (4, 1)]:
        assert kept.for_step(rows, adapters).gemm_tilings["qkv"] == (128, 64, 2)
        assert kept.for_step(rows, adapters).gemm_prefetch_k == 128
    assert kept.for_step(4).pdl is False  # the choices not given still come from the table


@pytest.mark.parametrize("change,message", [
    (lambda r: r.update(tilings={}), r"unknown keys \['tilings'\]"),
    (lambda r: r.update(format=1), "format 1: this node reads format 2"),
    (lambda r: r.pop("dtype"), "dtype None: expected one of bfloat16, float16, float32"),
    (lambda r: r.update(versions={"cuda": "12.8"}), "versions: expected an object of version strings"),
    (lambda r: r.update(tuning_s=-1), "tuning_s: expected a non-negative number of seconds"),
    (lambda r: r.update(unmeasured=[["lm_head", 8, 0]]), r"unmeasured: expected \[group, batch, adapters\]"),
    (lambda r: r["shape"].pop("head_dim"), "shape: expected positive integers"),
    (lambda r: r["buckets"][0]["choices"].update(gemm_tilingz={}),
     r"buckets\[0\] \(batch 1, adapters 0\): unknown choices \['gemm_tilingz'\]"),
    (lambda r: r["buckets"][1]["choices"].update(fold_groups=["o"]),
     r"buckets\[1\] .*\['fold_groups'\] size buffers built once per node .* under \"node\""),
    (lambda r: r["buckets"][0]["choices"].update(gemm_tilings={"qkv": [24, 64, 2]}),
     r"gemm_tilings.qkv: expected \[block_n, block_k, stages\], block_n and block_k powers of two"),
    (lambda r: r["buckets"][0]["choices"].update(gemm_tilings={"lm_head": [16, 64, 2]}),
     "gemm_tilings: expected an object keyed by groups"),
    (lambda r: r["buckets"][0]["choices"].update(pdl="off"), "pdl: expected true or false"),
    (lambda r: r["buckets"][0]["choices"].update(gemm_prefetch_k=-1), "gemm_prefetch_k: expected a non-negative"),
    (lambda r: r.update(node={"norm_split_groups": ["qkv"]}), "node: norm_split_groups takes o and down"),
    (lambda r: r["buckets"].append({"batch": 4, "choices": {}}),
     "a second entry for batch 4, adapters 0"),
    (lambda r: r["buckets"].append({"batch": 0}), "batch must be a positive"),
    (lambda r: r["buckets"].append({"rows": 2}), r"buckets\[4\]: expected an object with batch"),
])
def test_bad_files_are_refused_naming_the_file(tmp_path: Path, change, message: str) -> None:
    raw = table_json()
    change(raw)
    path = write(tmp_path / "bad.json", raw)
    with pytest.raises(TuningTableError, match=message) as info:
        TuningTable.read(path)
    assert str(path) in str(info.value)


def test_unreadable_files_are_refused_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text("{\"format\": 2,")
    with pytest.raises(TuningTableError, match=f"tuning table {path}: cannot be read"):
        TuningTable.read(path)
    with pytest.raises(TuningTableError, match="cannot be read"):
        TuningTable.read(tmp_path / "missing.json")


def test_a_written_table_reads_back_the_same(tmp_path: Path) -> None:
    tuned = DEFAULT_TUNING.replace(
        gemm_tma_tilings={**DEFAULT_TUNING.gemm_tma_tilings, "down": (32, 512, 3)},
        fold_tilings={**DEFAULT_TUNING.fold_tilings, "o": (32, 128, 2)}, gemm_early_trigger=False,
        silu_row_tile=(512, 4))
    choices = changed_choices(tuned)
    assert choices == {"gemm_tma_tilings": {"down": [32, 512, 3]}, "fold_tilings": {"o": [32, 128, 2]},
                       "gemm_early_trigger": False, "silu_row_tile": [512, 4]}
    table = TuningTable.from_json({"format": 2, "device": "cpu", "shape": dataclasses.asdict(SHAPE),
                                   "dtype": "bfloat16", "versions": {"torch": "2.13.0", "triton": "3.9.0"},
                                   "tuning_s": 97.25, "unmeasured": [["down", 1, 0], ["qkv", 1, 8]],
                                   "node": {"shrink_fold_groups": ["qkv"]},
                                   "buckets": [{"batch": 8, "adapters": 4, "choices": choices}]})
    table.write(tmp_path / "t.json")
    again = TuningTable.read(tmp_path / "t.json")
    assert again.to_json() == table.to_json()
    assert (again.dtype, dict(again.versions), again.tuning_s) == ("bfloat16", {"torch": "2.13.0", "triton": "3.9.0"}, 97.2)
    assert again.unmeasured == (("down", 1, 0), ("qkv", 1, 8))
    assert again.buckets == (Bucket(8, 4, table.buckets[0].choices),)
    got = again.tunings(DEFAULT_TUNING).for_step(8, 4)
    assert got == tuned.replace(shrink_fold_groups=frozenset({"qkv"}))


def test_fold_tilings_are_chosen_per_adapter_bucket() -> None:
    """The tuner's fold sweep files fold_tilings per (batch, adapters): a bucket may
    set them, and a step takes its adapter bucket's (none for a step without adapters)."""
    from kernels.tuning_table import BUCKET_CHOICES

    assert "fold_tilings" in BUCKET_CHOICES
    table = TuningTable.from_json(table_json(buckets=[
        {"batch": 64, "adapters": 0, "choices": {"gemm_tilings": {"qkv": [64, 64, 2]}}},
        {"batch": 64, "adapters": 1, "choices": {"fold_tilings": {"o": [32, 64, 4]}}},
        {"batch": 64, "adapters": 32, "choices": {"gemm_tilings": {"qkv": [64, 64, 2]},
                                                  "fold_tilings": {"qkv": [16, 64, 8], "o": [64, 64, 2]}}}]))
    steps = table.tunings(DEFAULT_TUNING)
    assert steps.for_step(64).fold_tilings == DEFAULT_TUNING.fold_tilings
    assert steps.for_step(64, 8).fold_tilings == {**DEFAULT_TUNING.fold_tilings, "o": (32, 64, 4)}
    assert steps.for_step(64, 8).gemm_tilings == DEFAULT_TUNING.gemm_tilings  # stands alone
    assert steps.for_step(64, 32).fold_tilings == {**DEFAULT_TUNING.fold_tilings, "qkv": (16, 64, 8),
                                                   "o": (64, 64, 2)}
    assert steps.for_step(64, 32).gemm_tilings["qkv"] == (64, 64, 2)
    assert steps.for_step(32, 32) == steps.for_step(64, 32)  # the nearest bucket of as many rows or more


def test_serve_takes_auto_by_default_and_records_the_choices_given(tmp_path: Path, capsys) -> None:
    from inference_node.cli import main, parser
    from inference_node.config import from_args

    kernels = from_args(parser().parse_args(["serve"])).kernels
    assert kernels.tuning_table == "auto" and kernels.tuning_fixed == frozenset()
    kernels = from_args(parser().parse_args(["serve", "--tuning-table", "off", "--tune", "pdl=on",
                                             "--tune", "gemm_tilings=qkv=64.64.2"])).kernels
    assert kernels.tuning_table == "off" and kernels.tuning_fixed == {"pdl", "gemm_tilings"}
    assert kernels.tuning.gemm_tilings["qkv"] == (64, 64, 2)
    bad = write(tmp_path / "bad.json", table_json(format=7))
    assert main(["serve", "--tuning-table", str(bad)]) == 2  # refused before any model loads
    assert f"--tuning-table: tuning table {bad}: format 7" in capsys.readouterr().err


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_node_runs_each_step_with_its_buckets_tuning(device, tiny_llama_path, tmp_path, monkeypatch) -> None:
    """Through the decode graphs' static buffers (eager on CPU: the same launch choices that
    a GPU's capture makes) and eager prefill steps, with and without an adapter: every
    forward's Tuning is its bucket's, and the tokens are those of the node without a table
    (on CUDA the decode GEMM launches the table's tilings). A flag given keeps its value in
    every bucket."""
    from harness import generate_together, make_peft_adapter
    from inference_node.model.llama import LlamaModel

    make_peft_adapter(tiny_llama_path, tmp_path / "adapters" / "qv", 4, 8.0, ["q_proj", "v_proj"], False, seed=1)
    # Pointer-load tilings (gemm_tilings) on Hopper too: TMA off for the whole node. Without
    # the (8 rows, 2 adapters) entry: a decode graph is captured for its bucket of adapters
    # (up to max_loras), so a step of one adapter may replay the 2-adapter graph, and whether
    # the two LoRA requests share an 8-row graph step depends on their timing.
    buckets = [b for b in table_json()["buckets"] if b.get("adapters", 0) < 2]
    path = write(tmp_path / "table.json", table_json(node={"gemm_tma": False}, buckets=buckets))
    seen: list[tuple[int, bool, Tuning]] = []
    real_forward = LlamaModel.forward

    def spy(self, batch, k, v, launch, lora=None):
        seen.append((len(batch.input_ids), lora is not None, launch.tuning))
        return real_forward(self, batch, k, v, launch, lora)

    monkeypatch.setattr(LlamaModel, "forward", spy)

    # Steps made in turn, each phase's requests submitted before its first step, so which
    # rows share a step does not hang on timing: base decode steps of 5 rows, steps of 5 rows
    # with one adapter, then a batch-1 step.
    phases = [[("", [5, 6, 7])] + [("", [11 + i] * (2 + i)) for i in range(4)],
              [("qv", [9, 9, 9, 9])] * 2 + [("", [13, 14]), ("", [15]), ("", [16, 17, 18])],
              [("", [3])]]

    def serve(**settings) -> tuple[list[tuple[int, bool, Tuning]], list[list[int]]]:
        from inference_node.llm import LLM

        seen.clear()
        with LLM(checkpoint=str(tiny_llama_path), device=device, dtype="float32", num_kv_blocks=64,
                 max_num_seqs=8, max_loras=2, max_lora_rank=8, adapter_dir=str(tmp_path / "adapters"),
                 decode_graphs="on", max_graph_batch=8, mixed_graphs="off", **settings) as llm:
            outputs = [tokens for jobs in phases for tokens in generate_together(llm, jobs, 6)]
            assert llm.engine.stats.graph_steps > 0
        return list(seen), outputs

    forwards, tokens = serve(tuning_table=str(path))
    rows_seen = {(rows, lora) for rows, lora, _ in forwards}
    assert (1, False) in rows_seen and any(r >= 4 and not lo for r, lo in rows_seen)
    assert any(r >= 4 and lo for r, lo in rows_seen)
    for rows, lora, tuning in forwards:
        bucket = 1 if rows == 1 else "lora" if lora else 4  # rows round up to a bucket, past 4 the largest
        assert list(tuning.gemm_tilings["qkv"]) == QKV[bucket], (rows, lora)
        assert tuning.pdl is (bucket != 4)
    given = DEFAULT_TUNING.replace(pdl=True, gemm_tilings={**DEFAULT_TUNING.gemm_tilings, "qkv": (128, 64, 2)})
    forwards, fixed_tokens = serve(tuning_table=str(path), tuning=given, tuning_fixed=frozenset({"gemm_tilings"}))
    for rows, lora, tuning in forwards:
        assert tuning.gemm_tilings["qkv"] == (128, 64, 2), (rows, lora)  # the flag, every bucket
        assert tuning.pdl is (rows == 1 or lora)  # the table's (rows round up), where no flag was given
    forwards, plain_tokens = serve(tuning_table="off")
    assert all(tuning == DEFAULT_TUNING for _, _, tuning in forwards)
    assert tokens == plain_tokens == fixed_tokens


def test_tensor_parallel_ranks_read_the_one_table_filed_for_their_shard(
        tiny_llama_path, tmp_path, monkeypatch, caplog, capfd) -> None:
    """Under --tensor-parallel-size 2 the table is keyed by one rank's shard shapes (heads,
    KV heads and MLP width halved: what its kernels multiply), `auto` is resolved once on rank
    0 before rank 1 starts (rank 1, a fresh process, does not see this test's table folder:
    it reads the table only through the resolved path), tensor parallelism's own rule holds over
    every bucket whatever the table's node-wide choices, and a table of the whole model's
    shape is refused before any rank starts."""
    import logging

    import kernels.tuning_table as tuning_table
    from inference_node.config import ConfigError, NodeConfig
    from inference_node.llm import LLM
    from inference_node.model.config import ModelConfig
    from inference_node.node import resolve_tuning_table
    from inference_node.parallel.shard import Shard, tensor_parallel_tuning

    full = ModelConfig.from_checkpoint(tiny_llama_path)
    shard = ModelShape.of(Shard(1, 2).local_config(full))
    assert shard.key == "h64_i80_q2_kv1_d16" and ModelShape.of(full) == SHAPE
    folder = tmp_path / "configs"
    folder.mkdir()
    # o's LoRA left for the add + norm after it: what tensor parallelism must undo (its delta
    # has to be in the partial output before the all-reduce), table or not.
    path = write(folder / table_name("cpu", shard, "float32"),
                 table_json(shape=shard, node={"shrink_fold_groups": ["qkv", "o"]}))
    monkeypatch.setattr(tuning_table, "CONFIG_DIR", folder)
    monkeypatch.setenv("LORA_SERVING_CACHE", str(tmp_path / "cache"))  # no table this host tuned
    config = NodeConfig.of(checkpoint=str(tiny_llama_path), device="cpu", num_kv_blocks=64, cpu_threads=1,
                           tensor_parallel_size=2, max_loras=0, debug_checks=True, tuning_table="auto")
    assert resolve_tuning_table(config, tiny_llama_path).kernels.tuning_table == str(path)
    one_rank = config.replace(tensor_parallel_size=1)
    assert resolve_tuning_table(one_rank, tiny_llama_path).kernels.tuning_table == "off"  # none for the whole shape

    whole = write(tmp_path / "whole.json", table_json())
    with pytest.raises(ConfigError, match=f"is for shape {SHAPE.key}; this node's \\(shard's\\) shape is {shard.key}"):
        LLM(config.replace(tuning_table=str(whole)))

    caplog.set_level(logging.INFO)  # the ranks log at the node's level
    with LLM(config) as llm:
        launches = llm.engine.runner.launches
        assert launches.tunings.table is not None and launches.tunings.table.path == path
        assert list(launches.for_step(4).tuning.gemm_tilings["qkv"]) == QKV[4]
        for rows, adapters in ((1, 0), (4, 0), (4, 1), (8, 2)):  # every bucket, and the base
            tuning = launches.for_step(rows, adapters).tuning
            assert tuning.shrink_fold_groups == {"qkv"} and tuning == tensor_parallel_tuning(tuning)
        assert launches.base.tuning.shrink_fold_groups == {"qkv"}
        answers = llm.generate(([5, 6, 7, 8, 9], [11, 12]), max_tokens=4, ignore_eos=True)
        assert [len(a.token_ids) for a in answers] == [4, 4]
    assert f"[rank 1]: tuning table {path}: 4 buckets" in capfd.readouterr().err


def test_a_mixture_of_experts_is_keyed_by_its_experts_and_its_buckets_set_their_grouped_gemms(tmp_path: Path) -> None:
    """A mixture of experts' shape holds its experts and top-k (its key too: another routing is
    another table) and no dense MLP; a bucket's moe_tilings reach its steps. Tables of dense
    shapes read as before the expert fields existed."""
    moe = ModelShape(2048, 768, 32, 4, 128, experts=128, top_k=8)
    assert moe.key == "h2048_i768_q32_kv4_d128_e128k8" and set(moe.gemms()) == {"qkv", "o"}
    assert table_name("NVIDIA H200", moe, "bfloat16") == "NVIDIA_H200__h2048_i768_q32_kv4_d128_e128k8__bfloat16.json"
    raw = table_json(shape=moe, buckets=[{"batch": 16, "choices": {"moe_tilings": {"down": [32, 128, 4]}}}],
                     unmeasured=[["experts.gate_up", 1, 0]])
    raw["shape"] = moe.to_json()
    table = TuningTable.read(write(tmp_path / "moe.json", raw))
    assert table.shape == moe and table.unmeasured == (("experts.gate_up", 1, 0),)
    steps = table.tunings(DEFAULT_TUNING)
    assert steps.for_step(32).moe_tilings == {"gate_up": DEFAULT_TUNING.moe_tilings["gate_up"], "down": (32, 128, 4)}
    assert steps.for_step(8).moe_tilings == steps.for_step(16).moe_tilings  # below the smallest bucket: it
    dense = table_json()
    dense["shape"] = {k: v for k, v in dense["shape"].items() if k not in ("experts", "top_k")}
    assert TuningTable.read(write(tmp_path / "dense.json", dense)).shape == SHAPE
    assert "experts" not in TuningTable.read(tmp_path / "dense.json").to_json()["shape"]
    raw["shape"]["experts"] = -1
    with pytest.raises(TuningTableError, match="shape: expected positive integers"):
        TuningTable.read(write(tmp_path / "bad.json", raw))
