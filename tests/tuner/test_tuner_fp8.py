"""The tuner over FP8 projections (inference_node/tuner/fp8_trials.py): a node serving FP8
weights keys its table by them (weight-only fp8 or W8A8), sweeps the FP8 GEMM's launches per
group and batch (no fold tilings: an FP8 GEMM adds no LoRA delta itself), and its steps hand
the table's launches to the FP8 GEMMs; a table of other weights is refused for the key, and a
malformed FP8 launch refused with what was expected."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from inference_node.config import NodeConfig
from inference_node.llm import LLM
from inference_node.tuner import fp8_trials
from test_tuner_node import FakeTimer
from inference_node.tuner import tune as tune_module
from inference_node.tuner.store import usable
from inference_node.tuner.attention_trials import AttentionMeasured
from inference_node.tuner.tune import key_for, tune_table
from kernels.tuning import DEFAULT_TUNING, GROUPS, parse_choice
from kernels.tuning_table import ModelShape, TuningTable, choice_from_json, table_name

ROOT = Path(__file__).resolve().parents[2]
TINY = ModelShape(hidden=64, intermediate=160, heads=4, kv_heads=2, head_dim=16)
LLAMA_8B = ModelShape(4096, 14336, 32, 8, 128)


@pytest.mark.parametrize("w8a8", [False, True])
def test_the_options_are_distinct_launches_the_default_first(w8a8: bool) -> None:
    """At 8B widths on 132 SMs: the default first, then only choices that launch something
    else (a K split the rule already picks is not timed twice; gate/up's gated launch never
    splits, so its options differ in their tiles alone)."""
    for group in GROUPS:
        N, K = LLAMA_8B.gemms()[group]
        options = fp8_trials.options(LLAMA_8B, group, w8a8, 64, 132)
        assert options[0] == DEFAULT_TUNING.fp8_choices(w8a8)[group]
        launches = [fp8_trials.launch(o, 64, N, K, w8a8, 132, group) for o in options]
        assert len(set(launches)) == len(launches) > 3, group
        if group == "gate_up":
            assert {launch[3] for launch in launches} == {1}
        else:
            assert {launch[3] for launch in launches} >= {1, 2, 4}, group
    # W8A8's rule at 8B widths: q/k/v unsplit, o in two, down in four (kernels/gemm/fp8.py)
    if w8a8:
        rule = {g: fp8_trials.launch(DEFAULT_TUNING.w8a8_tilings[g], 64, *LLAMA_8B.gemms()[g], True, 132, g)[3]
                for g in ("qkv", "o", "down")}
        assert rule == {"qkv": 1, "o": 2, "down": 4}


def test_an_fp8_launch_is_four_numbers_and_checked() -> None:
    assert parse_choice("w8a8_tilings", "qkv=32.128.4.2")["qkv"] == (32, 128, 4, 2)
    assert choice_from_json("fp8_tilings", {"down": [128, 256, 3, 0]})["down"] == (128, 256, 3, 0)
    for bad in ([64, 128, 4], [48, 128, 4, 0], [64, 128, 4, 3], [64, 128, 0, 1], [64, 8, 4, 0]):
        with pytest.raises(ValueError, match=r"block_n, block_k, stages, splits"):
            choice_from_json("w8a8_tilings", {"qkv": bad})
    with pytest.raises(ValueError, match="w8a8_tilings qkv=64.128.4.3"):
        DEFAULT_TUNING.replace(w8a8_tilings={"qkv": (64, 128, 4, 3)})


def test_the_table_is_keyed_by_its_weights() -> None:
    assert table_name("NVIDIA H200", LLAMA_8B, "bfloat16") == "NVIDIA_H200__h4096_i14336_q32_kv8_d128__bfloat16.json"
    assert table_name("NVIDIA H200", LLAMA_8B, "bfloat16", "fp8-w8a8").endswith("__bfloat16__fp8-w8a8.json")
    plain, w8a8 = (key_for(torch.device("cpu"), TINY, torch.float32, q) for q in ("none", "fp8-w8a8"))
    table, results = tune_table(TINY, torch.device("cpu"), torch.float32, budget_s=60, batches=(4,),
                                adapters=(0, 1), max_candidates=2, quantization="fp8-w8a8")
    assert table.quantization == "fp8-w8a8" and table.refusal(w8a8) is None
    assert any(isinstance(r, AttentionMeasured) for r in results)  # attention is the same kernel over FP8
    assert table.refusal(plain) == f"it is for cpu {TINY.key} float32 fp8-w8a8, not cpu {TINY.key} float32"
    assert all(b.adapters == 0 and set(b.choices) <= {"w8a8_tilings"} for b in table.buckets)
    again = TuningTable.from_json(json.loads(table.text()))
    assert again.quantization == "fp8-w8a8" and again.buckets == table.buckets
    with pytest.raises(ValueError, match="quantization 'int4'"):
        TuningTable.from_json({**json.loads(table.text()), "quantization": "int4"})


def test_the_sweep_checks_each_launch_against_the_reference(monkeypatch) -> None:
    """Every option passes its check; a launch that computes something else fails it, never
    timed into the table."""
    import kernels.gemm
    from inference_node.tuner.sweep import Sweep
    from inference_node.tuner.trial import Case, cpu_timer

    sweep = Sweep(TINY, torch.device("cpu"), torch.float32, "w8a8_tilings", cpu_timer, [4],
                  quantization="fp8-w8a8")
    for group in GROUPS:
        case = Case(group, 4)
        options = sweep.options(case)
        trials = fp8_trials.trials(TINY, sweep.device, sweep.dtype, True, sweep.weights(group, 1), case, options,
                                   sweep._inputs(case, TINY.gemms()[group][1]))[0]
        assert len(trials) == len(options) > 1 and all(t.check() == [] for t in trials), group
    real = kernels.gemm.fp8_linear
    monkeypatch.setattr(kernels.gemm, "fp8_linear", lambda *a, **k: real(*a, **k) * 1.1)
    case = Case("down", 4)
    trials = fp8_trials.trials(TINY, sweep.device, sweep.dtype, True, sweep.weights("down", 1), case,
                               sweep.options(case), sweep._inputs(case, TINY.intermediate))[0]
    assert all(t.check() and "rel err" in t.check()[0] for t in trials)


def test_the_tune_command_keys_an_fp8_checkpoint_by_its_weights(tiny_llama_path: Path, tmp_path: Path) -> None:
    """`inference-node tune --quantization fp8-w8a8`: the table of the W8A8 launches, filed
    under the W8A8 key, holding no folds; a batch past the decode GEMM's rows is left out,
    naming what runs it."""
    proc = subprocess.run([sys.executable, "-m", "inference_node.cli", "tune", "--device", "cpu", "--model",
                           str(tiny_llama_path), "--out", str(tmp_path / "out"), "--quantization", "fp8-w8a8",
                           "--batches", "256,4,1"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    key = key_for(torch.device("cpu"), TINY, torch.float32, "fp8-w8a8")
    table = usable(tmp_path / "out" / key.name, key, check_versions=True)
    assert table is not None and {(b.batch, b.adapters) for b in table.buckets} <= {(4, 0), (1, 0)}
    assert "fp8-w8a8" in proc.stdout and "adapters [0]" in proc.stdout
    assert "batches [256]: above the decode GEMM's 64 rows (the FP8 GEMM's prefill tiling runs them)" in proc.stdout


def test_an_fp8_node_tunes_its_fp8_gemms_and_runs_the_tables_launches(tiny_llama_path: Path, tmp_path: Path,
                                                                       monkeypatch, caplog) -> None:
    """A node serving --quantization fp8-w8a8 with no table tunes the W8A8 launches at its
    first start, files them under the W8A8 key, and each FP8 GEMM of a step launches its
    bucket's choice."""
    from kernels.gemm import fp8 as fp8_module

    caplog.set_level(logging.INFO)
    monkeypatch.setenv("LORA_SERVING_CACHE", str(tmp_path / "cache"))
    asked = []

    def node_tuner(device, shape, dtype, tp, quantization="none"):
        asked.append(quantization)

        def tune(budget_s: float) -> TuningTable:
            table, _ = tune_table(shape, device, dtype, budget_s=budget_s, batches=(4, 1), timer=FakeTimer(),
                                  max_candidates=3, quantization=quantization)
            # one choice the defaults never make, so that its use shows
            return TuningTable(table.device, table.shape, table.dtype, {}, (
                type(table.buckets[0])(1, 0, {"w8a8_tilings": {**DEFAULT_TUNING.w8a8_tilings,
                                                               "qkv": (32, 128, 2, 2)}}),),
                               "test", table.versions, 1.0, (), quantization=table.quantization)
        return tune

    monkeypatch.setattr(tune_module, "why_not", lambda device: None)
    monkeypatch.setattr(tune_module, "node_tuner", node_tuner)
    launched = []
    real = fp8_module.launch_tiling
    monkeypatch.setattr(fp8_module, "launch_tiling",
                        lambda rows, n, w8a8, choice=None: launched.append((n, choice)) or real(rows, n, w8a8, choice))
    config = NodeConfig.of(checkpoint=str(tiny_llama_path), device="cpu", num_kv_blocks=64, max_num_seqs=4,
                           cpu_threads=1, max_loras=0, tuning_table="auto", tune_budget=60.0,
                           quantization="fp8-w8a8")
    with LLM(config) as llm:
        path = Path(llm.node.config.kernels.tuning_table)
        assert path.name.endswith("__float32__fp8-w8a8.json") and asked == ["fp8-w8a8"]
        launched.clear()
        assert len(llm.generate([[5, 6, 7]], max_tokens=3, ignore_eos=True)[0].token_ids) == 3
    qkv_width = TINY.gemms()["qkv"][0]
    assert (qkv_width, (32, 128, 2, 2)) in launched
    assert (TINY.hidden, DEFAULT_TUNING.w8a8_tilings["o"]) in launched


@pytest.mark.interpreter
@pytest.mark.timeout(400)
def test_every_fp8_launch_the_sweep_offers_runs_the_kernel_in_the_interpreter() -> None:
    """Every option of every group (K split or not, gate/up gated), weight-only and W8A8, run
    by the FP8 GEMM in Triton's interpreter and matching the float32 reference."""
    code = (
        "import torch\n"
        "import kernels.gemm.fp8_triton_kernel as m\n"
        "calls = []\n"
        "real = m.fp8_gemm_triton\n"
        "m.fp8_gemm_triton = lambda *a, **k: calls.append(k.get('gated')) or real(*a, **k)\n"
        "from inference_node.tuner.tune import tune_table\n"
        "from kernels.tuning_table import ModelShape\n"
        "for q in ('fp8', 'fp8-w8a8'):\n"
        "    table, results = tune_table(ModelShape(64, 160, 4, 2, 16), torch.device('cpu'), torch.float32,\n"
        "                                budget_s=600, batches=(64,), quantization=q,\n"
        "                                groups=('qkv', 'o', 'gate_up', 'down'))\n"
        "    for r in results:\n"
        "        print('RESULT', q, r.group, r.timed, len(r.rejected) + len(r.unfit), *r.rejected)\n"
        "print('KERNEL', len(calls), sum(map(bool, calls)))\n")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=380)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert {(q, g) for q, g, *_ in rows} == {(q, g) for q in ("fp8", "fp8-w8a8") for g in GROUPS}
    for q, group, timed, refused, *why in rows:
        options = fp8_trials.options(TINY, group, q == "fp8-w8a8", 64, 1)
        assert int(timed) == len(options) > 1 and refused == "0", (q, group, why)
    kernel = proc.stdout.split("KERNEL")[1].split()
    assert int(kernel[0]) > 100 and int(kernel[1]) > 0  # the Triton GEMM ran them, gated too


def test_a_launch_drops_the_stages_shared_memory_cannot_hold(monkeypatch) -> None:
    """A table tuned in bfloat16 run by a float32 node asks for a pipeline larger than the
    GPU's shared memory (x's tiles twice as large): the launch runs with fewer stages, and
    later launches of the same kernel start from what fitted, never refused by the GPU."""
    pytest.importorskip("triton")
    from triton.runtime.errors import OutOfResources

    import kernels.gemm.fp8_triton_kernel as module
    from kernels.gemm import quantize_fp8

    tried = []

    class Kernel:
        def __getitem__(self, grid):
            def launch(*args, num_stages: int, **constants):
                tried.append(num_stages)
                if num_stages > 2:
                    raise OutOfResources(300_000, 232_448, "shared memory")
            return launch

    monkeypatch.setattr(module, "_fp8_gemm_kernel", Kernel())
    monkeypatch.setattr(module, "_FITTED_STAGES", {})
    w = quantize_fp8(torch.randn(64, 128))
    x = torch.randn(4, 128)
    for _ in range(2):
        module.fp8_gemm_triton(x, w.weight, w.scale, None, block_n=64, block_k=64, split_k=1, num_stages=4)
    assert tried == [4, 3, 2, 2]

    class Never(Kernel):
        def __getitem__(self, grid):
            def launch(*args, num_stages: int, **constants):
                raise OutOfResources(300_000, 232_448, "shared memory")
            return launch

    monkeypatch.setattr(module, "_fp8_gemm_kernel", Never())
    with pytest.raises(OutOfResources):
        module.fp8_gemm_triton(x, w.weight, w.scale, None, block_n=64, block_k=64, split_k=1, num_stages=4)


def test_a_rank_times_o_and_down_without_the_norm_summing_their_splits() -> None:
    """Under tensor parallelism a rank's o and down outputs are all-reduced before the add +
    norm, which then never sums their K splits: the sweep times them as the rank runs them."""
    assert fp8_trials.leaves_sums("down") and fp8_trials.leaves_sums("o")
    assert not fp8_trials.leaves_sums("down", tp=2) and not fp8_trials.leaves_sums("qkv")
    assert not fp8_trials.leaves_sums("o", DEFAULT_TUNING.replace(split_sums_in_norm=False))
