"""The Tuning object: its text forms (inference-node serve's flags, the benchmarks' sweeps)
round-trip, bad choices are refused with the choice named, the node's --tune reaches
NodeConfig's kernels group, and no kernel or engine module reads a choice from the environment."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from kernels.tuning import (DEFAULT_TUNING, GROUPS, Tuning, format_choice, parse_choice,
                            tuning_from_text)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(Tuning)])
def test_every_default_reads_back_from_its_text(name: str) -> None:
    value = getattr(DEFAULT_TUNING, name)
    assert parse_choice(name, format_choice(name, value)) == value


def test_text_replaces_only_the_named_choices() -> None:
    tuning = tuning_from_text({"pdl": "off", "fold_groups": "o,qkv",
                               "fold_tilings": "gate_up=32.128.4", "side_expand_group_segments": "none",
                               "silu_row_tile": "512.2", "shrink_fold_groups": "all"})
    assert tuning.pdl is False and tuning.fold_groups == {"o", "qkv"}
    assert tuning.fold_tilings["gate_up"] == (32, 128, 4)
    assert tuning.fold_tilings["o"] == DEFAULT_TUNING.fold_tilings["o"]  # the others kept
    assert dict(tuning.side_expand_group_segments) == {}
    assert tuning.silu_row_tile == (512, 2) and tuning.shrink_fold_groups == set(GROUPS)
    assert tuning.gemm_tilings == DEFAULT_TUNING.gemm_tilings


@pytest.mark.parametrize("choices,message", [
    ({"pdl": "maybe"}, "pdl='maybe': expected on or off"),
    ({"fold_groups": "o,lm_head"}, r"fold_groups names \['lm_head'\]"),
    ({"norm_split_groups": "qkv"}, "norm_split_groups takes o and down"),
    ({"fold_tilings": "gate_up"}, "expected GROUP=BLOCK_N.BLOCK_K.STAGES"),
    ({"side_expand_group_segments": "attn=4"}, r"side_expand_group_segments names \['attn'\]"),
    ({"fold_groupz": "o"}, r"no tuning choice \['fold_groupz'\]"),
    ({"attention_decode_key_tile": "3000"}, "attention_decode_key_tile 3000: expected a power of two"),
])
def test_bad_choices_are_refused_naming_the_choice(choices: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tuning_from_text(choices)


def test_tune_builds_the_nodes_tuning_and_names_the_choices_it_keeps(monkeypatch, capsys) -> None:
    """--tune KEY=VALUE (repeatable, also INFERENCE_NODE_TUNE, space-separated) sets choices
    of the node's Tuning and marks them kept over a tuning table; a bad key or value is
    refused by the parser, naming it, and choices that cannot go together by the config."""
    from inference_node.cli import parser
    from inference_node.config import ConfigError, from_args

    def kernels(*argv: str):
        return from_args(parser().parse_args(["serve", *argv])).kernels

    assert kernels().tuning == DEFAULT_TUNING and kernels().tuning_fixed == frozenset()
    given = kernels("--tune", "gemm_groups=o,down", "--tune", "norm-split-columns=0")
    assert given.tuning.gemm_groups == {"o", "down"} and given.tuning.norm_split_columns == 0
    assert given.tuning_fixed == {"gemm_groups", "norm_split_columns"}
    monkeypatch.setenv("INFERENCE_NODE_TUNE", "side_expand_segments=2 pdl=off")
    from_env = kernels("--tune", "pdl=on")  # the command line's after the environment's
    assert from_env.tuning.side_expand_segments == 2 and from_env.tuning.pdl is True
    monkeypatch.delenv("INFERENCE_NODE_TUNE")
    for bad, message in (("gemm_tma=sometimes", "gemm_tma='sometimes': expected on or off"),
                         ("gemm_tmaa=on", "expected KEY=VALUE with KEY one of pdl, "),
                         ("pdl", "expected KEY=VALUE")):
        with pytest.raises(SystemExit):
            parser().parse_args(["serve", "--tune", bad])
        assert message in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--tune: norm_split_groups takes o and down"):
        kernels("--tune", "norm_split_groups=qkv")


def test_kernels_engine_and_runner_read_no_environment() -> None:
    """Launch choices come from the Tuning passed in; the one environment read left is
    Triton's own interpreter switch (kernels/host.py)."""
    folders = ["kernels", "inference_node/engine", "inference_node/adapters",
               "inference_node/model", "inference_node/runner"]
    reads = []
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if re.search(r"os\.environ|getenv", line):
                    reads.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    allowed = ("TRITON_INTERPRET", "LORA_SERVING_CACHE", "XDG_CACHE_HOME")  # cache dir, not tuning
    assert [r for r in reads if not any(a in r for a in allowed)] == []


def test_tuning_survives_pickling_for_the_nodes_spawned_processes() -> None:
    import pickle

    from kernels.tuning import Tuning

    tuning = Tuning().replace(fold_groups=frozenset({"qkv"}), side_expand_group_segments={"down": 16})
    again = pickle.loads(pickle.dumps(tuning))
    assert again == tuning and again.side_expand_group_segments["down"] == 16


def test_decode_attention_key_tiles_follow_the_head_width() -> None:
    """64 keys of 1B's 64-wide heads (unchanged), 32 of 8B's and 70B's 128-wide ones; prefill
    and the interpreter keep their own tiles, and the choice moves them."""
    from kernels.attention.triton_kernel import key_block

    assert key_block(64, 1, True, DEFAULT_TUNING) == 64
    assert key_block(128, 1, True, DEFAULT_TUNING) == 32
    assert key_block(128, 256, True, DEFAULT_TUNING) == 64
    assert key_block(128, 1, False, DEFAULT_TUNING) == 32
    assert key_block(128, 1, True, tuning_from_text({"attention_decode_key_tile": "8192"})) == 64


def test_a_tiling_too_large_for_float32_halves_its_k_tiles_until_two_stages_fit() -> None:
    """Tables are tuned in bfloat16; a float32 model with the same shapes (the GPU parity
    tests) takes twice the shared memory a stage: its K tiles shrink until two stages fit,
    instead of a launch the compiler refuses."""
    from kernels.gemm.shapes import SHARED_MEMORY, tiling

    table = {"gate_up": (64, 512, 2)}  # the 8B H100 table's, for steps of 1-31 rows
    bf16 = torch.empty(4096, 28672, dtype=torch.bfloat16, device="meta")
    assert tiling(bf16, "gate_up", table, rows=16) == (64, 512, 2)  # as tuned
    for rows, block_k in [(16, 256), (64, 128)]:
        block_n, got_k, stages = tiling(bf16.float(), "gate_up", table, rows=rows)
        assert (block_n, got_k) == (64, block_k) and stages >= 2
        assert 2 * (max(16, rows) + block_n) * got_k * 4 <= SHARED_MEMORY
    assert tiling(bf16.float(), "gate_up", {"gate_up": (1024, 64, 2)}) is None  # no K tile fits


def test_a_rope_launch_takes_only_qkv_weights_its_tiles_divide() -> None:
    """q/k/v's GEMM with RoPE in its epilogue (RopeOut): half the tiling's columns from each
    half of a head (as many weight bytes a program as the plain launch), at least the tensor
    cores' 16 and at most half a head; a weight of other widths, a tile that does not divide
    half a head, or caches of another dtype keep the plain launch and the RoPE kernel."""
    from kernels.gemm.rope_out import RopeOut
    from kernels.gemm.shapes import rope_block_n

    assert [rope_block_n(n, 128) for n in (16, 32, 64, 128, 256)] == [16, 16, 32, 64, 64]
    assert rope_block_n(64, 64) == 32 and rope_block_n(256, 64) == 32
    # Phi-3's heads of 96: half a head is 48, which no power-of-two tile above 16 divides.
    assert [rope_block_n(n, 96) for n in (32, 128, 256)] == [16, 16, 16]
    assert rope_block_n(128, 256) == 64 and rope_block_n(256, 256) == 128
    heads, kv_heads, head_dim, rows = 32, 8, 128, 5

    def out(cache_dtype: torch.dtype = torch.bfloat16) -> RopeOut:
        caches = [torch.empty(4, 16, kv_heads, head_dim, dtype=cache_dtype) for _ in range(2)]
        table = torch.empty(64, head_dim)
        return RopeOut(torch.empty(rows, heads, head_dim, dtype=torch.bfloat16), *caches, table,
                       table, torch.zeros(rows, dtype=torch.long), torch.zeros(rows, dtype=torch.long),
                       heads, kv_heads, head_dim)

    x = torch.empty(rows, 4096, dtype=torch.bfloat16)
    qkv = torch.empty(6144, 4096, dtype=torch.bfloat16).t()
    assert out().fits(x, qkv, 32) and out().fits(x, qkv, 64)
    assert not out().fits(x, qkv, 128)  # wider than half a head
    assert not out().fits(x, qkv, 48)  # does not divide it
    assert not out().fits(x, torch.empty(4096, 4096, dtype=torch.bfloat16).t(), 32)  # o's weight
    assert not out(torch.float32).fits(x, qkv, 32)


def test_a_gemms_input_from_a_padded_allocation_spans_whole_row_tiles() -> None:
    """The ops feeding a decode GEMM allocate a whole row tile (empty_rows), and the GEMM's TMA
    descriptor spans it (tma_rows): never past the storage, else the rows x has."""
    from kernels.gemm.shapes import MAX_ROWS, empty_rows, tma_rows

    x = empty_rows(40, 256, dtype=torch.bfloat16, device=torch.device("cpu"))
    assert x.shape == (40, 256) and x.is_contiguous() and x.untyped_storage().nbytes() == 64 * 256 * 2
    assert tma_rows(x, 64) == 64 and tma_rows(x, 32) == 64 and tma_rows(x[:, :128], 64) == 64
    assert tma_rows(x[8:], 64) == 32  # 64 rows from row 8 would pass the storage's end
    assert tma_rows(torch.empty(40, 256), 64) == 40  # a storage of its own rows only
    assert tma_rows(empty_rows(16, 8, dtype=torch.float32, device=torch.device("cpu")), 16) == 16
    big = empty_rows(MAX_ROWS + 36, 8, dtype=torch.float32, device=torch.device("cpu"))
    assert big.untyped_storage().nbytes() == (MAX_ROWS + 36) * 8 * 4  # prefill: cuBLAS's, not padded


def test_decode_attention_launches_follow_the_steps_rows() -> None:
    """Tuning.attention_decode_launches: a step takes the entry of the fewest rows at or above
    its own, else of the most; none (the rule's launch) without entries; the text and JSON
    forms read back; a tile under 256, odd warps or rows that are not a count are refused."""
    from kernels.tuning_table import choice_from_json, choice_to_json

    tuning = tuning_from_text({"attention_decode_launches": "8=0.0.0,256=2048.2.3,64=8192.2.1"})
    assert [tuning.attention_decode_launch(rows) for rows in (1, 8, 9, 64, 65, 256, 512)] == [
        (0, 0, 0), (0, 0, 0), (8192, 2, 1), (8192, 2, 1), (2048, 2, 3), (2048, 2, 3), (2048, 2, 3)]
    assert DEFAULT_TUNING.attention_decode_launch(64) is None
    text = format_choice("attention_decode_launches", tuning.attention_decode_launches)
    assert parse_choice("attention_decode_launches", text) == tuning.attention_decode_launches
    as_json = choice_to_json("attention_decode_launches", tuning.attention_decode_launches)
    assert choice_from_json("attention_decode_launches", as_json) == tuning.attention_decode_launches
    for bad in ("64=128.2.3", "64=4096.3.3", "x=4096.2.3", "64=4096.2.9"):
        with pytest.raises(ValueError, match="attention_decode_launches"):
            tuning_from_text({"attention_decode_launches": bad})
    with pytest.raises(ValueError, match="attention_decode_launches"):
        choice_from_json("attention_decode_launches", {"64": [4096, 2]})


def test_a_decode_attention_launch_takes_its_rows_entry(monkeypatch) -> None:
    """paged_attention_triton launches a decode step with its rows' entry (key tile, warps,
    stages), the rule's where the entry says 0 or there is none; prefill keeps its own."""
    import kernels.attention.triton_kernel as attention

    launched = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append(
                (kwargs["BLOCK_N"], kwargs["num_warps"], kwargs.get("num_stages")))

    monkeypatch.setattr(attention, "_paged_attention_kernel", Recorder())
    real = attention.key_block  # as on a GPU: the CPU's own tile is the interpreter's
    monkeypatch.setattr(attention, "key_block", lambda block_d, q_len, on_gpu, tuning, tile=None:
                        real(block_d, q_len, True, tuning, tile))
    heads, kv_heads, dim, page = 8, 2, 128, 16

    def launch(rows: int, query_len: int, tuning: Tuning):
        q = torch.zeros(rows * query_len, heads, dim, dtype=torch.bfloat16)
        cache = torch.zeros(rows * 4, page, kv_heads, dim, dtype=torch.bfloat16)
        tables = torch.arange(rows * 4, dtype=torch.int32).view(rows, 4)
        starts = torch.arange(rows + 1, dtype=torch.int32) * query_len
        lens = torch.full((rows,), 60, dtype=torch.int32)
        attention.paged_attention_triton_impl(q, cache, cache, tables, starts, lens, 0.1, query_len, 60,
                                              tuning=tuning, num_splits=1)
        return launched.pop()

    tuned = tuning_from_text({"attention_decode_launches": "8=0.0.0,256=2048.2.3"})
    assert launch(64, 1, tuned) == (16, 2, 3)           # 64 rows: the 256-row entry
    assert launch(8, 1, tuned) == (32, 4, None)         # the rule's: 32 keys of 128, 4 warps
    assert launch(64, 1, DEFAULT_TUNING) == (32, 4, None)
    assert launch(4, 32, tuned)[0] == 64                # prefill: its own tile
