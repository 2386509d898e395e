"""The tuner on a GPU: `inference-node tune` writes a table for this GPU with every candidate
checked against the reference; a node with an empty cache tunes at its first start within
its budget and takes the cached table at its second; and greedy decoding matches PEFT token
for token for every launch choice the tuner may pick (each candidate tiling of every group,
plain and with LoRA folded in, in the mode the node's plan runs it), on a reduced-layer model
of Llama-3.1-8B's widths.

One call runs them all: `pytest -q -m gpu tests/tuner/test_tuner_gpu.py`. The parity sweeps,
one test per LoRA plan of two node starts at 8B widths, are most of it: on an H200 35 s and 57 s
with Triton's cache warm, over five minutes together with it cold (every tiling compiles); the
FP8 one (five node starts) ran past 9 minutes with a cold cache.
"""
from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]


def config_dir(tmp_path: Path, config: dict) -> Path:
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def tune(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "inference_node.cli", "tune", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_tune_writes_a_table_for_this_gpu(tmp_path: Path) -> None:
    """One group at one batch, plain and folded, of Llama-3.2-1B's shapes (a minute at most):
    every candidate checked against the reference, the table filed under this GPU's key."""
    from bench.shapes import LLAMA_3_2_1B
    from inference_node.tuner.store import usable
    from inference_node.tuner.tune import key_for
    from kernels.tuning_table import ModelShape

    model = config_dir(tmp_path, LLAMA_3_2_1B)
    proc = tune("--model", str(model), "--batches", "64,8", "--adapters", "0,32,1", "--groups", "o",
                "--budget-s", "300", "--out", str(tmp_path / "out"))
    key = key_for(torch.device("cuda"), ModelShape(2048, 8192, 32, 8, 64), torch.bfloat16)
    table = usable(tmp_path / "out" / key.name, key, check_versions=True)
    assert table is not None and table.device == torch.cuda.get_device_name()
    assert [(b.batch, b.adapters) for b in table.buckets] == [(8, 0), (8, 1), (64, 0), (64, 1), (64, 32)]
    assert table.unmeasured == () and 0 < table.tuning_s < 300
    assert "rejected" not in proc.stdout, proc.stdout  # no candidate disagreed with the reference
    assert "copy bandwidth" in proc.stdout and "floor us" in proc.stdout
    print(proc.stdout)


def test_tune_sweeps_a_mixture_of_experts_grouped_gemms_and_their_lora(tmp_path: Path) -> None:
    """Qwen3-30B-A3B's experts at one batch, plain and with 8 adapters' LoRA on every expert:
    every grouped GEMM tiling and every pair LoRA launch checked against its reference and
    timed, the winners filed as moe_tilings and moe_lora_launches."""
    from bench.shapes import QWEN3_30B_A3B
    from inference_node.tuner.store import usable
    from inference_node.tuner.tune import key_for
    from kernels.tuning_table import ModelShape

    model = config_dir(tmp_path, QWEN3_30B_A3B)
    proc = tune("--model", str(model), "--batches", "64", "--adapters", "0,8", "--groups",
                "experts.gate_up,experts.down", "--budget-s", "300", "--out", str(tmp_path / "out"))
    key = key_for(torch.device("cuda"), ModelShape(2048, 768, 32, 4, 128, 128, 8), torch.bfloat16)
    table = usable(tmp_path / "out" / key.name, key, check_versions=True)
    assert table is not None and table.unmeasured == ()
    assert "rejected" not in proc.stdout, proc.stdout
    rows = [line.split()[:4] for line in proc.stdout.splitlines()]
    for group in ("experts.gate_up", "experts.down"):
        assert [group, "64", "0", "-"] in rows and [group, "64", "8", "launch"] in rows, proc.stdout
    assert all(set(b.choices) <= {"moe_tilings", "moe_lora_launches"} for b in table.buckets)
    print(proc.stdout)


@pytest.mark.tunes
def test_a_node_tunes_at_its_first_start_and_takes_the_cache_at_its_second(
        tiny_llama_path: Path, tmp_path: Path, monkeypatch, caplog) -> None:
    from inference_node.llm import LLM

    caplog.set_level(logging.INFO)
    monkeypatch.setenv("LORA_SERVING_CACHE", str(tmp_path / "cache"))
    config = dict(checkpoint=str(tiny_llama_path), device="cuda", dtype="float32", num_kv_blocks=64,
                  max_num_seqs=8, max_loras=2, tune_budget=45.0)
    with LLM(**config) as llm:
        path = Path(llm.node.config.kernels.tuning_table)
        table = llm.engine.runner.launches.tunings.table
        assert table is not None and table.path == path and path.parent == tmp_path / "cache" / "tuning"
        assert table.device == torch.cuda.get_device_name() and table.dtype == "float32"
        assert table.tuning_s <= 45 + 30  # the budget, and the last candidate it let start
        assert len(llm.generate([[5, 6, 7]], max_tokens=4, ignore_eos=True)[0].token_ids) == 4
    assert "tuning kernels for" in caplog.text and "candidates," in caplog.text  # progress lines
    assert f"tuning table: {path} (tuned now in" in caplog.text
    caplog.clear()
    with LLM(**config) as llm:
        assert llm.node.config.kernels.tuning_table == str(path)
    assert f"tuning table: {path} (cache)" in caplog.text
    assert "tuning its kernels now" not in caplog.text


def test_the_lora_tiling_sweep_runs(tmp_path: Path) -> None:
    from bench.shapes import LLAMA_3_2_1B

    proc = subprocess.run([sys.executable, "-m", "inference_node.tuner.lora_sweep", "--model",
                           str(config_dir(tmp_path, LLAMA_3_2_1B)), "--groups", "o", "--adapters", "8",
                           "--no-sweep"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "o          8 adapters shrink: default" in proc.stdout and "expand: default" in proc.stdout


# -- greedy parity for every choice the tuner may pick -------------------------------------------------

BUCKETS = (1, 8, 32, 64)  # decode batch buckets of one round: row tiles of 16, 32 and 64 rows
# The LoRA step plans a round runs under: the defaults (o folds whole in a step of one adapter,
# the other groups expand on the side stream), and one where every group folds only its
# shrink, down's spread over its tile programs (the H100 8B seed's plan, and the defaults' in
# steps of more than 8 adapters).
PLANS = {"whole": {},
         "shrink": {"shrink_fold_groups": ["qkv", "o", "gate_up", "down"], "fold_shrink_spread": ["down"],
                    "side_expand_segments": 0, "side_expand_group_segments": {}}}


def choice_space(shape, field: str, plan: dict) -> dict[tuple[str, str], list[tuple[int, int, int]]]:
    """(Tuning field, group) -> every tiling the tuner may pick for it on this float32 node
    (its candidates: a bfloat16 table's tilings are fitted to these at launch), for the base
    GEMM and for the folds the plan runs in a step of one adapter."""
    from inference_node.tuner.sweep import candidates, fold_modes, slice_offsets, split_candidates
    from kernels.tuning import DEFAULT_TUNING, GROUPS
    from kernels.tuning_table import choice_from_json

    tuning = DEFAULT_TUNING.replace(**{name: choice_from_json(name, value) for name, value in plan.items()})
    space: dict[tuple[str, str], list] = {}
    for group in GROUPS:
        N, K = shape.gemms()[group]
        w = torch.empty(N, K, dtype=torch.float32, device="meta").t()
        space[(field, group)] = candidates(w, group, field) + split_candidates(w, group, field)
        if group in fold_modes([group], 1, tuning):
            space[("fold_tilings", group)] = candidates(w, group, "fold_tilings",
                                                        slice_offsets=slice_offsets(shape, group))
    return {k: v for k, v in space.items() if v}


def round_table(shape, field: str, plan: dict, space: dict, first: int) -> dict:
    """A table whose buckets (b, 0) and (b, 1) of BUCKETS give every group the candidates
    first, first + 1, ... of its lists (wrapping), for the base GEMM and for the fold."""
    def pick(name: str, group: str, i: int) -> list[int]:
        options = space[(name, group)]
        return list(options[(first + i) % len(options)])

    import dataclasses

    buckets = []
    for i, batch in enumerate(BUCKETS):
        picks = {group: pick(field, group, i) for (name, group) in space if name == field}
        base = {field: {g: t[:3] for g, t in picks.items()}}  # a K-split pick: its splits apart
        splits = {g: t[3] for g, t in picks.items() if len(t) > 3}
        if splits:
            base["gemm_split_k"] = splits
        fold = {group: pick("fold_tilings", group, i) for (name, group) in space if name == "fold_tilings"}
        buckets.append({"batch": batch, "adapters": 0, "choices": base})
        buckets.append({"batch": batch, "adapters": 1, "choices": {**base, "fold_tilings": fold}})
    return {"format": 2, "device": torch.cuda.get_device_name(), "shape": dataclasses.asdict(shape),
            "dtype": "float32", "produced_by": f"tests/tuner parity round from candidate {first}",
            "node": plan, "buckets": buckets}


def check_calls(llm, calls, prompts: list[list[int]], expected: dict[str, list[list[int]]], max_new: int,
                what: str, buckets: list) -> None:
    """Each call (rows, the prompts' adapters) generated together, every prompt's tokens equal
    to PEFT's for its adapter."""
    from harness import generate_together

    for rows, adapters in calls:
        got = generate_together(llm, list(zip(adapters, prompts[:rows])), max_new)
        for i, (tokens, adapter) in enumerate(zip(got, adapters)):
            assert tokens == expected[adapter][i], (
                f"{what}, {rows} rows, prompt {i} ({adapter or 'base'}): {tokens} != PEFT's "
                f"{expected[adapter][i]}; table {buckets}")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("plan_name", list(PLANS))
def test_greedy_matches_peft_for_every_choice_the_tuner_may_pick(llama_8b_widths_path: Path, tmp_path: Path,
                                                                 plan_name: str) -> None:
    """Rounds of node starts, each over a table that gives each decode batch bucket (1, 8, 32,
    64 rows; without and with an adapter) the next candidates of every group, until every
    candidate of every group has run, plain (the base GEMM, in the launch the node fuses it
    into: RoPE for q/k/v, SiLU for gate/up) and folded (whole, or shrink only), under the
    plan. Steps of 1, 8, 32 and 64 rows, base, adapter and mixed, each prompt's tokens equal
    to PEFT's."""
    from harness import make_peft_adapter, peft_greedy
    from inference_node.llm import LLM
    from inference_node.model.config import ModelConfig
    from inference_node.tuner.tune import base_field
    from kernels.tuning_table import ModelShape, TuningTable

    shape = ModelShape.of(ModelConfig.from_checkpoint(llama_8b_widths_path))
    field = base_field(torch.device("cuda"))
    adapter_dir = tmp_path / "adapters"
    make_peft_adapter(llama_8b_widths_path, adapter_dir / "all", 16, 16.0,
                      ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], seed=3)
    distinct = [[100 + 37 * i + j for j in range(3 + i % 5)] for i in range(16)]
    prompts = [distinct[i % 16] for i in range(max(BUCKETS))]  # PEFT runs the 16 distinct ones
    max_new = 6
    refs = {"": peft_greedy(llama_8b_widths_path, None, distinct, max_new),
            "all": peft_greedy(llama_8b_widths_path, adapter_dir / "all", distinct, max_new)}
    assert sum(a != b for a, b in zip(refs[""], refs["all"])) >= 8, "the adapter barely changes the model"
    expected = {name: [tokens[i % 16] for i in range(len(prompts))] for name, tokens in refs.items()}
    # (rows, adapters of the prompts): every bucket without and with the adapter, and mixed.
    top = max(BUCKETS)
    calls = [(n, [""] * n) for n in BUCKETS] + [(n, ["all"] * n) for n in BUCKETS] + [(top, ["", "all"] * (top // 2))]
    covered: dict[tuple[str, str], set] = {}
    starts = 0
    plan = PLANS[plan_name]
    space = choice_space(shape, field, plan)
    rounds = math.ceil(max(len(v) for v in space.values()) / len(BUCKETS))
    for r in range(rounds):
        print(f"plan {plan_name}: round {r + 1} of {rounds}", flush=True)
        raw = round_table(shape, field, plan, space, r * len(BUCKETS))
        path = tmp_path / f"{plan_name}-{r}.json"
        path.write_text(json.dumps(raw))
        table = TuningTable.read(path)
        with LLM(checkpoint=str(llama_8b_widths_path), device="cuda", dtype="float32", num_kv_blocks=256,
                 max_num_seqs=top, max_loras=1, max_lora_rank=16, adapter_dir=str(adapter_dir),
                 max_num_batched_tokens=512, tuning_table=str(path), debug_checks=True,
                 mixed_graphs="off") as llm:  # decode graphs (where folds run) and eager prefill
            starts += 1
            check_calls(llm, calls, prompts, expected, max_new, f"plan {plan_name}, round {r}", raw["buckets"])
        for bucket in table.buckets:
            for name in (field, "fold_tilings"):
                for group, tiling in bucket.choices.get(name, {}).items():
                    split = bucket.choices.get("gemm_split_k", {}).get(group, 1) if name == field else 1
                    covered.setdefault((name, group), set()).add(tuple(tiling) + ((split,) if split > 1 else ()))
    for key, options in space.items():
        assert set(options) <= covered.get(key, set()), (plan_name, key)
    print(f"{starts} node starts; choices covered: " + ", ".join(
        f"{name}.{group}: {len(tilings)}" for (name, group), tilings in sorted(covered.items())))


# -- FP8 projections: the W8A8 table, and greedy parity for every weight-only launch -------------------

def test_tune_writes_a_w8a8_table_for_this_gpu(tmp_path: Path) -> None:
    """`inference-node tune --quantization fp8-w8a8` at Llama-3.2-1B's widths: every launch of
    every group checked against the W8A8 reference, the table filed under the W8A8 key."""
    from bench.shapes import LLAMA_3_2_1B
    from inference_node.tuner.store import usable
    from inference_node.tuner.tune import key_for
    from kernels.tuning_table import ModelShape

    model = config_dir(tmp_path, LLAMA_3_2_1B)
    proc = tune("--model", str(model), "--quantization", "fp8-w8a8", "--batches", "64,8", "--budget-s", "300",
                "--out", str(tmp_path / "out"))
    key = key_for(torch.device("cuda"), ModelShape(2048, 8192, 32, 8, 64), torch.bfloat16, "fp8-w8a8")
    table = usable(tmp_path / "out" / key.name, key, check_versions=True)
    assert table is not None and table.quantization == "fp8-w8a8" and table.unmeasured == ()
    assert all(b.adapters == 0 and set(b.choices) <= {"w8a8_tilings"} for b in table.buckets)
    assert "rejected" not in proc.stdout, proc.stdout
    print(proc.stdout)


@pytest.mark.timeout(1200)
def test_greedy_matches_peft_for_every_weight_only_fp8_launch(llama_8b_widths_path: Path, tmp_path: Path) -> None:
    """Rounds of --quantization fp8 node starts, each over a table giving the decode buckets
    (1, 8, 32, 64 rows) the next launches of every group's FP8 GEMM the sweep offers (those
    whose float32 pipeline fits), base, adapter and mixed steps, each prompt's tokens equal to
    PEFT's over the same FP8 values dequantized to float32 (the launches of a bfloat16 table,
    their stages cut to what shared memory holds with float32 x: kernels.gemm.fp8.fitted_stages).
    (W8A8's math is not PEFT's: its launches are checked against its own reference in the
    sweep, test above.)"""
    import dataclasses

    from fp8_checkpoints import write_quantized_twin
    from harness import make_peft_adapter, peft_greedy
    from inference_node.llm import LLM
    from inference_node.model.config import ModelConfig
    from inference_node.tuner import fp8_trials
    from kernels.host import num_sms
    from kernels.tuning import GROUPS
    from kernels.tuning_table import ModelShape, TuningTable

    shape = ModelShape.of(ModelConfig.from_checkpoint(llama_8b_widths_path))
    sms = num_sms(torch.device("cuda"))
    space = {g: fp8_trials.options(shape, g, False, 64, sms) for g in GROUPS}
    twin = write_quantized_twin(llama_8b_widths_path, tmp_path / "twin")
    adapter_dir = tmp_path / "adapters"
    make_peft_adapter(llama_8b_widths_path, adapter_dir / "all", 16, 16.0,
                      ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], seed=3)
    distinct = [[100 + 37 * i + j for j in range(3 + i % 5)] for i in range(16)]
    prompts = [distinct[i % 16] for i in range(max(BUCKETS))]
    max_new = 6
    refs = {"": peft_greedy(twin, None, distinct, max_new), "all": peft_greedy(twin, adapter_dir / "all", distinct, max_new)}
    expected = {name: [tokens[i % 16] for i in range(len(prompts))] for name, tokens in refs.items()}
    top = max(BUCKETS)
    calls = [(n, [""] * n) for n in BUCKETS] + [(n, ["all"] * n) for n in BUCKETS] + [(top, ["", "all"] * (top // 2))]
    covered: dict[str, set] = {}
    rounds = math.ceil(max(len(v) for v in space.values()) / len(BUCKETS))
    for r in range(rounds):
        print(f"FP8 launches: round {r + 1} of {rounds}", flush=True)
        buckets = [{"batch": batch, "adapters": 0, "choices": {"fp8_tilings": {
            g: list(options[(r * len(BUCKETS) + i) % len(options)]) for g, options in space.items()}}}
            for i, batch in enumerate(BUCKETS)]
        raw = {"format": 2, "device": torch.cuda.get_device_name(), "shape": dataclasses.asdict(shape),
               "dtype": "float32", "quantization": "fp8", "produced_by": f"tests/tuner FP8 parity round {r}",
               "node": {}, "buckets": buckets}
        path = tmp_path / f"fp8-{r}.json"
        path.write_text(json.dumps(raw))
        table = TuningTable.read(path)
        with LLM(checkpoint=str(llama_8b_widths_path), device="cuda", dtype="float32", quantization="fp8",
                 num_kv_blocks=256, max_num_seqs=top, max_loras=1, max_lora_rank=16, adapter_dir=str(adapter_dir),
                 max_num_batched_tokens=512, tuning_table=str(path), debug_checks=True, mixed_graphs="off") as llm:
            check_calls(llm, calls, prompts, expected, max_new, f"FP8 round {r}", raw["buckets"])
        for bucket in table.buckets:
            for group, choice in bucket.choices["fp8_tilings"].items():
                covered.setdefault(group, set()).add(tuple(choice))
    for group, options in space.items():
        assert set(options) <= covered.get(group, set()) and len(options) > 3, group
    print("FP8 launches covered: " + ", ".join(f"{g}: {len(c)}" for g, c in sorted(covered.items())))
