"""The Tuning object: its text forms (inference-node serve's flags, the benchmarks' sweeps)
round-trip, bad choices are refused with the choice named, the node's flags reach
NodeSettings.tuning, and no kernel or engine module reads a choice from the environment."""
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


def test_serve_flags_build_the_nodes_tuning(monkeypatch: pytest.MonkeyPatch) -> None:
    from inference_node.cli import parser, tuning_from_args

    assert tuning_from_args(parser().parse_args(["serve"])) == DEFAULT_TUNING
    args = parser().parse_args(["serve", "--gemm-groups", "o,down", "--norm-split-columns", "0"])
    tuning = tuning_from_args(args)
    assert tuning.gemm_groups == {"o", "down"} and tuning.norm_split_columns == 0
    monkeypatch.setenv("INFERENCE_NODE_SIDE_EXPAND_SEGMENTS", "2")  # each flag is an env var too
    assert tuning_from_args(parser().parse_args(["serve"])).side_expand_segments == 2
    with pytest.raises(SystemExit):
        parser().parse_args(["serve", "--gemm-tma", "sometimes"])


def test_kernels_engine_and_lora_plan_read_no_environment() -> None:
    """Launch choices come from the Tuning passed in; the one environment read left is
    Triton's own interpreter switch (kernels/host.py)."""
    folders = ["kernels", "inference_node/engine", "inference_node/adapters",
               "inference_node/model", "inference_node/lora_step"]
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
