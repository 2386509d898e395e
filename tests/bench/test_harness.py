"""bench/harness.py: the named models a node can serve (a tokenizer beside every checkpoint),
tables that print what was not measured as '-', the workload's determinism, nodes built with
adapters pinned (or refused naming the adapter), and CompileWatch counting what JIT-compiles
inside a region."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from bench import harness
from bench.harness import Col, CompileWatch, Table

CPU = torch.device("cpu")


def test_named_models_carry_a_tokenizer_and_load_as_named(tmp_path: Path) -> None:
    tiny = harness.bench_model("tiny", tmp_path, torch.float32, CPU)
    assert tiny.load_format == "safetensors" and (tiny.checkpoint / "model.safetensors").exists()
    big = harness.bench_model("llama-8b-random", tmp_path, torch.bfloat16, CPU)
    assert big.load_format == "dummy" and not (big.checkpoint / "model.safetensors").exists()
    for model, name in ((tiny, "tiny"), (big, "llama-8b-random")):
        assert (model.checkpoint / "tokenizer.json").exists()
        assert json.loads((model.checkpoint / "config.json").read_text()) == harness.RANDOM_MODELS[name].config
        assert harness.model_config(name).hidden_size == harness.RANDOM_MODELS[name].config["hidden_size"]
    assert harness.bench_model("embedded", tmp_path, torch.float32, CPU).checkpoint == harness.embedded_checkpoint()


def test_table_columns_scale_align_and_dash_what_was_not_measured() -> None:
    table = Table(Col("row", 4), Col("TTFT", 7, ".1f", "ms", 1e3), Col("x", 6, ".2f", suffix="x"), Col("n", 3, "d"))
    titles, units, rule = table.head()
    assert titles == "row     TTFT      x   n" and units.split() == ["ms"] and set(rule) == {"-"}
    assert table.row("a", 0.01234, 1.5, 7) == "a       12.3  1.50x   7"
    assert table.row("b", math.nan, None, 0) == "b          -      -   0"
    assert len(table.row("a", 0.01234, 1.5, 7)) == len(titles)


def test_percentiles_and_the_workload() -> None:
    assert harness.pct([3.0, 1.0, 2.0], 50) == 2.0 and harness.pct([0.0, 10.0], 99) == pytest.approx(9.9)
    assert math.isnan(harness.pct([], 50))
    a = harness.make_specs(20, (4, 8), (2, 3), 5000, None, seed=1)
    assert a == harness.make_specs(20, (4, 8), (2, 3), 5000, None, seed=1)
    assert all(4 <= len(s.prompt) <= 8 and 1000 <= min(s.prompt) and s.arrival == 0 for s in a)
    poisson = harness.make_specs(20, (4, 8), (2, 3), 5000, 100.0, seed=1)
    arrivals = [s.arrival for s in poisson]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0
    picks = [harness.zipf_index(u / 1000, 10, 1.0) for u in range(1000)]
    assert picks.count(0) > picks.count(1) > picks.count(9) > 0  # Zipf: the first most popular


def test_a_node_is_built_with_its_adapters_pinned_or_names_the_one_that_failed(tmp_path: Path) -> None:
    model = harness.bench_model("tiny", tmp_path, torch.float32, CPU)
    cfg = harness.model_config("tiny")
    harness.write_adapters(tmp_path / "adapters", cfg, ["one", "two"], [4, 8], harness.QV, CPU, torch.float32)
    config = harness.node_config(model, CPU, torch.float32, adapter_dir=str(tmp_path / "adapters"), max_loras=2,
                                 num_kv_blocks=32, cpu_threads=1)
    llm = harness.build_llm(config, ["one", "two"])
    try:
        entries = {e.name: e for e in llm.node.adapters.entries()}
        assert entries["one"].resident and entries["one"].pinned and entries["two"].pinned
        with pytest.raises(RuntimeError, match="1 adapters did not load: missing"):
            llm.pin_adapters(["missing"])
    finally:
        llm.close()
    base = harness.build_llm(config.replace(max_loras=0))
    try:
        with pytest.raises(ValueError, match="LoRA disabled"):
            base.pin_adapters(["one"])
    finally:
        base.close()


def test_a_new_torch_compile_graph_is_counted_once() -> None:
    watch = CompileWatch().install()
    fn = torch.compile(lambda x: x * 2 + 1, backend="eager")
    mark = watch.mark()
    fn(torch.ones(3))
    assert watch.since(mark) == ["torch.compile graph"]
    again = watch.mark()
    fn(torch.ones(3))  # same shapes: the graph is reused
    assert watch.since(again) == []


def test_triton_compiles_reported_by_its_hook_are_listed_by_name() -> None:
    from triton import knobs

    previous = knobs.runtime.jit_post_compile_hook
    seen: list[str] = []
    knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append(kw["repr"])
    try:
        watch = CompileWatch().install()
        mark = watch.mark()
        knobs.runtime.jit_post_compile_hook(repr="_lora_shrink_kernel[num_warps=2](ROWS: i32)")
        assert watch.since(mark) == ["_lora_shrink_kernel[num_warps=2](ROWS: i32)"]
        assert seen == ["_lora_shrink_kernel[num_warps=2](ROWS: i32)"]  # the earlier hook still runs
        assert watch.install() is watch and watch.since(watch.mark()) == []
    finally:
        knobs.runtime.jit_post_compile_hook = previous
