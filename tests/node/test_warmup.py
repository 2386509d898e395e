"""The start-up warm-up (inference_node/runner/warmup.py): its synthetic eager steps reach
every kernel tiling an eager step can take under the engine's limits, touch no request's
state, and (run with Triton, interpreted here or compiled on a GPU) leave nothing for the
first requests to compile."""
from __future__ import annotations

import copy
import os
import random
import sys
import time
from pathlib import Path

import pytest
import torch

from harness import InProcessNode, generate_all, make_peft_adapter, make_tiny_llama, peft_greedy
from inference_node.config import NodeConfig
from inference_node.runner.warmup import plan
from kernels.lora.meta import LoraBatchMeta
from kernels.lora.triton_kernel import choose_tiling

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
from kernel_cases import record_specialisations  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
ADAPTERS = {"qv-r4": (4, 8.0, ["q_proj", "v_proj"]),
            "all-r8": (8, 16.0, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
            "mlp-r16": (16, 16.0, ["gate_proj", "up_proj", "down_proj"])}


def lora_tilings(steps) -> set[tuple[int, int]]:
    tilings = set()
    for step in steps:
        if step.token_slots is not None:
            t = choose_tiling(LoraBatchMeta.build(list(step.token_slots), "cpu"), 16)
            tilings.add((t.block_m, t.shrink_warps))
    return tilings


def test_the_plan_reaches_every_lora_and_attention_tiling_of_a_large_engine() -> None:
    steps = plan(max_num_seqs=64, max_tokens=2048, max_model_len=4096, max_loras=32)
    # decode-shaped (16-row tiles, 2 warps), then prefill's 16-, 32- and 64-row tiles
    assert lora_tilings(steps) == {(16, 2), (16, 4), (32, 4), (64, 4)}
    assert {max(s.q_lens) <= 16 for s in steps} == {True, False}  # both attention query tiles
    assert any(max(s.seq_lens) > 512 and max(s.q_lens) == 1 for s in steps)  # split keys
    assert {s.token_slots is None for s in steps} == {True, False}  # with and without LoRA


@pytest.mark.parametrize("seqs,tokens,model_len,loras", [(4, 64, 128, 2), (8, 300, 40, 4), (1, 16, 16, 0)])
def test_the_plan_stays_within_the_engines_limits(seqs: int, tokens: int, model_len: int, loras: int) -> None:
    steps = plan(seqs, tokens, model_len, loras)
    assert steps
    for s in steps:
        assert len(s.q_lens) <= seqs and sum(s.q_lens) <= tokens
        assert all(0 < q <= n <= model_len for q, n in zip(s.q_lens, s.seq_lens))
        if s.token_slots is not None:
            assert loras > 0 and len(s.token_slots) == sum(s.q_lens)
            assert all(0 <= slot < loras for slot in s.token_slots)


def run_mixed_workload(node: InProcessNode, root: Path, tiny_llama_path: Path, seed: int) -> None:
    """Prompts of 3-120 tokens on three adapters and the base model, all at once: eager
    prefill steps of several shapes, then decode; outputs equal PEFT's."""
    rng = random.Random(seed)
    jobs = [(name, [rng.randrange(100, 40000) for _ in range(rng.randrange(3, 120))], rng.randrange(2, 6))
            for name in ["", *ADAPTERS] for _ in range(3)]
    rng.shuffle(jobs)

    got = generate_all(node, jobs, timeout=600)
    folders = {"": None, **{n: root / n for n in ADAPTERS}}
    assert got == [peft_greedy(tiny_llama_path, folders[n], [p], m)[0] for n, p, m in jobs]
    node.check_idle()


def start_node(tiny_llama_path: Path, root: Path, warmup: str, mixed_graphs: str = "off") -> InProcessNode:
    for seed, (name, (rank, alpha, targets)) in enumerate(ADAPTERS.items()):
        make_peft_adapter(tiny_llama_path, root / name, rank, alpha, targets, seed=seed, scale=3.0)
    return InProcessNode(NodeConfig.of(checkpoint=str(tiny_llama_path), device="cpu", dtype="float32",
                                       num_kv_blocks=160, max_num_seqs=12, max_num_batched_tokens=300,
                                       max_loras=4, max_lora_rank=16, adapter_dir=str(root),
                                       decode_graphs="off", mixed_graphs=mixed_graphs, warmup=warmup,
                                       debug_checks=True),
                         start_timeout=900)  # the warm-up's forwards, in Triton's interpreter


def test_a_warmed_up_node_serves_the_same_tokens_and_ends_idle(tiny_llama_path, tmp_path) -> None:
    node = start_node(tiny_llama_path, tmp_path / "adapters", "on")
    try:
        # decode, prompts of 16, 200 and 299 tokens, a long context; with and without LoRA
        assert node.engine.runner.warmup_forwards == 10
        assert node.engine.stats.steps == 0  # the warm-up is no engine step and holds no block
        node.check_idle()
        run_mixed_workload(node, tmp_path / "adapters", tiny_llama_path, seed=1)
    finally:
        node.stop()


@pytest.mark.skipif(not INTERPRET, reason="run by test_triton_interpreter.py with TRITON_INTERPRET=1")
@pytest.mark.parametrize("mixed_graphs", ["off", "on"], ids=["eager", "piecewise"])
def test_after_the_warm_up_serving_launches_no_new_kernel_variant_interpreted(tokenizer_dir, tmp_path,
                                                                             monkeypatch, mixed_graphs) -> None:
    """Every Triton launch of the workload (kernel, constexpr tiling, run-time specialisation)
    was already launched by the warm-up, so on a GPU nothing would compile under requests.
    One layer: launches repeat per layer, and the interpreter is slow. With piecewise graphs
    for prompt steps, their pieces were launched at start (a GPU's capture), and the attention
    between them, over static buffers, takes the variants the warm-up launched."""
    tiny_llama_path = make_tiny_llama(tmp_path / "one-layer", tokenizer_dir, num_hidden_layers=1)
    from kernels.attention import triton_kernel as paged_attention_triton
    from kernels.embedding import triton_kernel as embedding_triton
    from kernels.lora import triton_kernel as lora_triton
    from kernels.rope import triton_kernel as rope_cache_triton
    from kernels.sampling import triton_kernel as argmax_triton

    keys: dict = {}
    record_specialisations(monkeypatch, lora_triton, {
        "_lora_shrink_kernel": lora_triton._SHRINK_DYNAMIC,
        "_lora_expand_kernel": lora_triton._EXPAND_DYNAMIC}, keys)
    record_specialisations(monkeypatch, paged_attention_triton, {
        "_paged_attention_kernel": paged_attention_triton._ATTENTION_DYNAMIC,
        "_merge_splits_kernel": paged_attention_triton._MERGE_DYNAMIC}, keys)
    record_specialisations(monkeypatch, rope_cache_triton, {"_rope_cache_kernel": []}, keys)
    record_specialisations(monkeypatch, embedding_triton, {"_embed_kernel": embedding_triton._DYNAMIC}, keys)
    record_specialisations(monkeypatch, argmax_triton, {"_chunk_max_kernel": argmax_triton._DYNAMIC,
                                                        "_row_pick_kernel": ["n_chunks"]}, keys)
    node = start_node(tiny_llama_path, tmp_path / "adapters", "on", mixed_graphs)
    try:
        warmed = copy.deepcopy(keys)
        assert {"_lora_shrink_kernel", "_lora_expand_kernel", "_paged_attention_kernel", "_embed_kernel",
                "_chunk_max_kernel", "_row_pick_kernel"} <= set(warmed)
        run_mixed_workload(node, tmp_path / "adapters", tiny_llama_path, seed=2)
        if mixed_graphs == "on":
            assert node.engine.stats.piecewise_graph_steps > 0 and node.engine.stats.eager_prefill_steps == 0
    finally:
        node.stop()
    for name, by_tiling in keys.items():
        for tiling, runtime in by_tiling.items():
            assert tiling in warmed.get(name, {}), (name, "tiling first launched under requests", dict(tiling))
            assert runtime <= warmed[name][tiling], (name, dict(tiling), runtime - warmed[name][tiling])


def test_without_the_warm_up_on_cpu_nothing_runs_before_serving(tiny_llama_path, tmp_path, monkeypatch) -> None:
    from inference_node.runner import runner as runner_module

    calls = []
    monkeypatch.setattr(runner_module, "warm_up", lambda *args: calls.append(args) or 0)
    node = start_node(tiny_llama_path, tmp_path / "adapters", "auto")  # auto: CUDA only
    try:
        assert calls == [] and node.engine.runner.warmup_forwards == 0
        assert node.engine.runner.model.device == torch.device("cpu")
    finally:
        node.stop()


def test_a_core_that_fails_while_it_starts_fails_the_in_process_start_at_once(tiny_llama_path,
                                                                             monkeypatch) -> None:
    """The test harness, like the launcher: a warm-up or capture that raises on the core's
    thread ends the start in seconds with that error (a GPU test whose kernels failed to
    compile waited the whole 600 s start timeout, silent)."""
    from inference_node.engine.engine import Engine

    def broken(self) -> None:
        raise RuntimeError("a kernel the warm-up compiles did not fit")

    monkeypatch.setattr(Engine, "prepare", broken)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="engine core stopped while starting.*did not fit"):
        InProcessNode(NodeConfig.of(checkpoint=str(tiny_llama_path), device="cpu", num_kv_blocks=32),
                      start_timeout=60)
    assert time.monotonic() - started < 20
