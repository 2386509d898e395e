"""The node's first start with `--tuning-table auto` (inference_node/node.py over the tuner):
on a CPU it never tunes and runs the defaults; where tuning can run (here the CPU made to
pass for a tunable device, the sweep timed by a fake timer) the first start tunes within
--tune-budget, logs which table it uses and stores it in the cache directory, and the second
start uses that table without tuning; a sweep that fails leaves the node on the defaults,
started. The front end never imports the tuner (tests/node/test_frontend_imports.py)."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest

from inference_node.config import NodeConfig
from inference_node.llm import LLM
from inference_node.tuner import tune as tune_module
from inference_node.tuner.sweep import TuningError
from kernels.tuning import DEFAULT_TUNING
from kernels.tuning_table import TuningTable


class FakeTimer:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, calls_for, copies) -> float:
        self.calls += 1
        calls_for(copies[0])()
        return 10.0 + self.calls % 5


@pytest.fixture
def node_config(tiny_llama_path: Path, tmp_path: Path, monkeypatch) -> NodeConfig:
    monkeypatch.setenv("LORA_SERVING_CACHE", str(tmp_path / "cache"))  # this test's host cache
    return NodeConfig.of(checkpoint=str(tiny_llama_path), device="cpu", num_kv_blocks=64, max_num_seqs=4,
                         cpu_threads=1, max_loras=0, tuning_table="auto", tune_budget=60.0)


def test_a_cpu_node_never_tunes(node_config: NodeConfig, caplog) -> None:
    caplog.set_level(logging.INFO)
    with LLM(node_config) as llm:
        assert llm.node.config.kernels.tuning_table == "off"
        assert llm.engine.runner.launches.tunings.table is None
        assert llm.generate([[5, 6, 7]], max_tokens=2, ignore_eos=True)[0].token_ids
    assert "default launch choices (cpu: launch choices are tuned on CUDA devices only)" in caplog.text
    assert "tuning table: none: default launch choices" in caplog.text


def test_the_first_start_tunes_and_the_second_uses_the_cached_table(node_config: NodeConfig, tmp_path: Path,
                                                                    monkeypatch, caplog) -> None:
    caplog.set_level(logging.INFO)
    timer = FakeTimer()
    budgets = []

    def node_tuner(device, shape, dtype, tp, quantization="none"):
        def tune(budget_s: float) -> TuningTable:
            budgets.append(budget_s)
            return tune_module.tune_table(shape, device, dtype, budget_s=budget_s, batches=(4, 1), adapters=(0,),
                                          timer=timer, max_candidates=3, produced_by="test")[0]
        return tune

    monkeypatch.setattr(tune_module, "why_not", lambda device: None)  # as if the CPU could be tuned
    monkeypatch.setattr(tune_module, "node_tuner", node_tuner)
    with LLM(node_config) as llm:
        path = Path(llm.node.config.kernels.tuning_table)
        assert path.parent == tmp_path / "cache" / "tuning" and path.is_file()
        table = llm.engine.runner.launches.tunings.table
        assert table is not None and table.path == path and table.dtype == "float32"
        assert llm.engine.runner.launches.for_step(4).tuning == table.tunings(DEFAULT_TUNING).for_step(4)
        assert len(llm.generate([[5, 6, 7]], max_tokens=2, ignore_eos=True)[0].token_ids) == 2
    assert budgets == [60.0] and timer.calls > 0
    assert "tuning its kernels now, within 60 s" in caplog.text
    assert f"tuning table: {path} (tuned now in" in caplog.text
    caplog.clear()
    timed = timer.calls
    with LLM(node_config) as llm:
        assert llm.node.config.kernels.tuning_table == str(path)
    assert budgets == [60.0] and timer.calls == timed  # no tuning at the second start
    assert f"tuning table: {path} (cache)" in caplog.text


def test_a_failed_tuning_leaves_the_node_started_on_the_defaults(node_config: NodeConfig, tmp_path: Path,
                                                                 monkeypatch, caplog) -> None:
    def node_tuner(device, shape, dtype, tp, quantization="none"):
        def tune(budget_s: float) -> TuningTable:
            raise TuningError("o batch 4: the default tiling (16, 64, 4) failed")
        return tune

    monkeypatch.setattr(tune_module, "why_not", lambda device: None)
    monkeypatch.setattr(tune_module, "node_tuner", node_tuner)
    with LLM(node_config) as llm:
        assert llm.node.config.kernels.tuning_table == "off"
        assert llm.generate([[5, 6, 7]], max_tokens=2, ignore_eos=True)[0].token_ids
    assert "failed (TuningError: o batch 4" in caplog.text
    assert not list((tmp_path / "cache" / "tuning").glob("*.json"))


def test_tuning_cache_dir_names_where_the_tables_go(node_config: NodeConfig, tmp_path: Path, monkeypatch) -> None:
    """--tuning-cache-dir: a writable folder of its own (a container's cache directory is the
    image's, read-only)."""
    def node_tuner(device, shape, dtype, tp, quantization="none"):
        return lambda budget_s: tune_module.tune_table(shape, device, dtype, budget_s=budget_s, batches=(4,),
                                                       adapters=(0,), timer=FakeTimer(), max_candidates=2)[0]

    monkeypatch.setattr(tune_module, "why_not", lambda device: None)
    monkeypatch.setattr(tune_module, "node_tuner", node_tuner)
    with LLM(node_config.replace(tuning_cache_dir=str(tmp_path / "mine"))) as llm:
        path = Path(llm.node.config.kernels.tuning_table)
    assert path.parent == tmp_path / "mine" and path.is_file()
    assert not (tmp_path / "cache" / "tuning").exists()
