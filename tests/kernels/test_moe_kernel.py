"""The fused MoE kernel (kernels/moe/triton_kernel.py) against its PyTorch reference, in
Triton's interpreter on the CPU (the slow tier: a child pytest with TRITON_INTERPRET=1, as
test_triton_interpreter.py runs the others); the fixed-size expert sort in plain PyTorch."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.host import interpreting
from kernels.tuning import DEFAULT_TUNING
from kernels.moe import PairLora, experts_reference, pair_lora_hook, pair_lora_reference, route

ROOT = Path(__file__).resolve().parents[2]
HAS_TRITON = importlib.util.find_spec("triton") is not None


@pytest.mark.skipif(not HAS_TRITON, reason="Triton not installed")
def test_align_sorts_pairs_into_one_expert_blocks() -> None:
    from kernels.moe.triton_kernel import align_by_expert

    picks = torch.tensor([[3, 0], [0, 2], [3, 1], [0, 3], [2, 0]])
    sorted_ids, block_expert = align_by_expert(picks, num_experts=5, block_m=4)
    flat = picks.flatten()
    assert sorted_ids.numel() == 28 and block_expert.numel() == 7  # 10 pairs + 5 experts' padding, in blocks
    seen = []
    for b, expert in enumerate(block_expert.tolist()):
        ids = [i for i in sorted_ids[4 * b:4 * b + 4].tolist() if i < flat.numel()]
        if expert < 0:
            assert not ids
            continue
        assert ids and all(flat[i] == expert for i in ids) and ids == sorted(ids)
        seen += ids
    assert sorted(seen) == list(range(flat.numel()))
    assert block_expert.tolist()[:5] == [0, 1, 2, 3, -1]  # expert 0's four pairs fill one block; 4 has none


@pytest.mark.interpreter
@pytest.mark.skipif(not HAS_TRITON, reason="Triton not installed")
def test_fused_experts_in_the_interpreter() -> None:
    if interpreting():
        pytest.skip("the child's own run (test_fused_experts_match_the_reference)")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__,
                            "-k", "match_the_reference or tool_runs or pair_lora"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert child.returncode == 0 and " passed" in child.stdout, child.stdout[-4000:] + child.stderr[-2000:]


# Tuning.moe_tilings (block_n, block_k, stages) of gate/up and down: the defaults, and tiles
# narrower and wider than the test's widths (48 hidden, 40 intermediate: masked either way).
TILINGS = [None, {"gate_up": (16, 64, 2), "down": (128, 16, 4)}, {"gate_up": (128, 16, 4), "down": (32, 128, 3)}]


@pytest.mark.parametrize("tilings", TILINGS, ids=["default", "narrow-up", "wide-up"])
@pytest.mark.parametrize("tokens, experts, top_k", [(5, 4, 2), (37, 8, 3)])
def test_fused_experts_match_the_reference(tokens: int, experts: int, top_k: int, tilings) -> None:
    """float32 (the interpreter rounds casts to bfloat16 otherwise than a GPU)."""
    if not interpreting():
        pytest.skip("runs in Triton's interpreter (test_fused_experts_in_the_interpreter starts it)")
    _check_fused_experts(tokens, experts, top_k, torch.float32, "cpu", tilings)


@pytest.mark.skipif(not HAS_TRITON, reason="Triton not installed")
def test_tilings_are_fitted_to_k_and_shared_memory() -> None:
    from kernels.gemm.shapes import SHARED_MEMORY
    from kernels.moe.triton_kernel import BLOCK_M, fitted

    for group, tiling in DEFAULT_TUNING.moe_tilings.items():  # the defaults fit 30B-A3B's widths as they are
        assert fitted(tiling, 2048 if group == "gate_up" else 768, 2, gated=group == "gate_up") == tiling
    assert fitted((32, 256, 4), 40, 4, gated=False) == (32, 64, 4)  # no K tile past K's power of two
    block_n, block_k, stages = fitted((128, 128, 8), 2048, 2, gated=True)
    assert (block_n, block_k) == (128, 128) and stages >= 1
    assert stages * (BLOCK_M + 2 * block_n) * block_k * 2 <= SHARED_MEMORY < (stages + 1) * (BLOCK_M + 2 * block_n) * block_k * 2


def test_moe_tilings_are_a_tuning_choice() -> None:
    from kernels.tuning import DEFAULT_TUNING, tuning_from_text
    from kernels.tuning_table import choice_from_json

    tuning = tuning_from_text({"moe_tilings": "gate_up=128.64.4"})
    assert tuning.moe_tilings == {"gate_up": (128, 64, 4), "down": DEFAULT_TUNING.moe_tilings["down"]}
    assert choice_from_json("moe_tilings", {"down": [32, 128, 3]})["down"] == (32, 128, 3)
    with pytest.raises(ValueError):
        choice_from_json("moe_tilings", {"down": [48, 128, 3]})  # block_n not a power of two


def test_tiling_tool_runs(capsys) -> None:
    """inference_node.tuner.moe_experts end to end on tiny widths (its CPU smoke): every tiling
    the node's sweep would try, checked against the reference and timed, the best printed as a
    --tune flag the node takes."""
    if not interpreting():
        pytest.skip("runs in Triton's interpreter (test_fused_experts_in_the_interpreter starts it)")
    from inference_node.tuner import expert_trials
    from inference_node.tuner.moe_experts import main
    from kernels.tuning import tuning_from_text
    from kernels.tuning_table import ModelShape

    results = main(["--device", "cpu", "--hidden", "64", "--inter", "32", "--experts", "4", "--top-k", "2",
                    "--rows", "3"])
    shape = ModelShape(64, 32, 1, 1, 1, 4, 2)
    times = results[0]["times"]
    assert {g: set(t) for g, t in times.items()} == {
        g: set(expert_trials.options(shape, f"experts.{g}", torch.float32)) for g in ("gate_up", "down")}
    assert results[0]["best_us"] <= results[0]["default_us"] and results[0]["bytes"] > 0
    flag = capsys.readouterr().out.strip().splitlines()[-1]
    name, value = flag.removeprefix("--tune ").split("=", 1)
    assert name == "moe_tilings" and dict(tuning_from_text({name: value}).moe_tilings) == results[0]["best"]


def test_expert_lora_tool_on_the_cpu_asks_for_the_interpreter(capsys) -> None:
    """moe_experts --lora times the Triton kernels themselves: on the CPU without the
    interpreter it says how to run it (usage error 2), not a Triton driver traceback."""
    if interpreting():
        pytest.skip("outside Triton's interpreter only")
    from inference_node.tuner.moe_experts import main

    with pytest.raises(SystemExit) as stopped:
        main(["--device", "cpu", "--hidden", "64", "--inter", "32", "--experts", "4", "--top-k", "2", "--rows", "3",
              "--lora", "2"])
    assert stopped.value.code == 2 and "TRITON_INTERPRET=1" in capsys.readouterr().err


def test_expert_lora_tool_runs(capsys) -> None:
    """moe_experts --lora: every pair LoRA launch checked against the reference and timed, the
    fastest per group printed as a --tune flag the node takes."""
    if not interpreting():
        pytest.skip("runs in Triton's interpreter (test_fused_experts_in_the_interpreter starts it)")
    from inference_node.tuner.moe_experts import main
    from kernels.tuning import tuning_from_text

    results = main(["--device", "cpu", "--hidden", "64", "--inter", "32", "--experts", "4", "--top-k", "2",
                    "--rows", "3", "--lora", "2"])
    from inference_node.tuner.expert_trials import lora_options

    launches = results[0]["launches"]
    assert {g: set(t) for g, t in launches.items()} == {g: set(lora_options(f"experts.{g}")) for g in launches}
    assert set(launches) == {"gate_up", "down"} and results[0]["lora_bytes"] > 0
    flag = capsys.readouterr().out.strip().splitlines()[-1]
    assert flag.startswith("--tune moe_lora_launches=")
    name, value = flag.removeprefix("--tune ").split("=", 1)
    assert tuning_from_text({name: value}).moe_lora_launches == results[0]["best_launches"]


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64, 300])
def test_fused_experts_on_the_gpu_match_the_reference(tokens: int) -> None:
    """bfloat16 on CUDA, and the routing captured in a CUDA graph (no host sync)."""
    _check_fused_experts(tokens, 16, 4, torch.bfloat16, "cuda")


def _check_fused_experts(tokens: int, experts: int, top_k: int, dtype: torch.dtype, device: str,
                         tilings=None) -> None:
    from kernels.moe.triton_kernel import fused_experts_triton

    gen = torch.Generator().manual_seed(tokens)
    hidden, inter = 48, 40  # not multiples of the tiles: the masks are exercised
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    router = torch.randn(experts, hidden, generator=gen).to(dtype)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.2).to(dtype)
    down = (torch.randn(experts, hidden, inter, generator=gen) * 0.2).to(dtype)
    x, router, gate_up, down = (t.to(device) for t in (x, router, gate_up, down))
    weights, picks = route(x, router, top_k, renormalise=True, weights_in_model_dtype=dtype != torch.float32)
    ours = fused_experts_triton(x, weights, picks, gate_up, down, tilings)
    if device == "cuda":
        graph = torch.cuda.CUDAGraph()
        fused_experts_triton(x, weights, picks, gate_up, down)  # compiled before the capture
        with torch.cuda.graph(graph):
            replayed = fused_experts_triton(x, weights, picks, gate_up, down)
        graph.replay()
        torch.testing.assert_close(replayed, ours, rtol=0, atol=0)
    theirs = experts_reference(x, weights, picks, gate_up, down)
    if dtype == torch.float32:
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
        return
    # bfloat16: the reference sums a token's picks in bfloat16 (index_add), the kernel in
    # float32: each is held to the float32 experts over the same bfloat16 weights.
    truth = experts_reference(x.float(), weights.float(), picks, gate_up.float(), down.float())
    scale = max(1.0, truth.abs().max().item())
    for result in (ours, theirs):
        torch.testing.assert_close(result.float(), truth, rtol=2e-2, atol=2e-2 * scale)


# -- each pair's expert LoRA (the fused experts with LoRA) ---------------------------------------------

def _arena_lora(experts: int, rows: int, inp: int, out: int, tokens: int, gen: torch.Generator,
                dtype: torch.dtype) -> PairLora:
    """Arenas of `rows` rank rows holding three adapter slots of ranks 3, rows - 3 (at the
    end) and 1, and a free slot (rank 0); tokens cycling over no adapter and the four."""
    a = (torch.randn(experts, rows, inp, generator=gen) * 0.3).to(dtype)
    b = (torch.randn(experts, rows, out, generator=gen) * 0.3).to(dtype)
    first = torch.tensor([0, 3, rows - 1, 0], dtype=torch.int32)
    rank = torch.tensor([3, rows - 3, 1, 0], dtype=torch.int32)
    scaling = torch.tensor([0.5, 1.5, 2.5, 9.0], dtype=torch.float32)
    token_slots = torch.tensor([t % 5 - 1 for t in range(tokens)], dtype=torch.int32)
    return PairLora(a, b, token_slots, first, rank, scaling)


def _expert_delta(gate_up: PairLora, down: PairLora):
    """The per-expert hook of experts_reference, row by row from each token's slot: the oracle."""
    def add(parameter: str, expert: int, token_idx: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> None:
        lora = gate_up if parameter == "gate_up_proj" else down
        for i, t in enumerate(token_idx.tolist()):
            slot = int(lora.token_slots[t])
            if slot < 0 or not int(lora.rank[slot]):
                continue
            rank, first = int(lora.rank[slot]), int(lora.first[slot])
            a, b = lora.a[expert, first:first + rank].float(), lora.b[expert, first:first + rank].float()
            y[i] += ((x[i].float() @ a.t()) @ b * lora.scaling[slot]).to(y.dtype)
    return add


def _lora_case(tokens: int, experts: int, top_k: int, hidden: int, inter: int, seed: int) -> dict:
    """Random experts and routing with arena LoRA on gate/up and down, and the oracle's output."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    router = torch.randn(experts, hidden, generator=gen)
    case = dict(x=x, gate_up=torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.2,
                down=torch.randn(experts, hidden, inter, generator=gen) * 0.2,
                gu_lora=_arena_lora(experts, 8, hidden, 2 * inter, tokens, gen, torch.float32),
                down_lora=_arena_lora(experts, 5, inter, hidden, tokens, gen, torch.float32), gen=gen)
    case["weights"], case["picks"] = route(x, router, top_k, renormalise=True, weights_in_model_dtype=False)
    experts_of = (case["weights"], case["picks"], case["gate_up"], case["down"])
    case["truth"] = experts_reference(x, *experts_of, _expert_delta(case["gu_lora"], case["down_lora"]))
    assert (case["truth"] - experts_reference(x, *experts_of)).abs().max() > 0.1  # the LoRA moves the output
    return case


def test_pair_lora_hook_is_the_per_expert_oracle() -> None:
    """The CPU path of expert LoRA (pair_lora_hook through experts_reference) and the pairs'
    reference, against the row-by-row oracle."""
    tokens, experts, top_k, inter = 11, 4, 2, 20
    c = _lora_case(tokens, experts, top_k, 24, inter, seed=1)
    x, picks, gu_lora = c["x"], c["picks"], c["gu_lora"]
    torch.testing.assert_close(experts_reference(x, c["weights"], picks, c["gate_up"], c["down"],
                                                 pair_lora_hook(gu_lora, c["down_lora"])), c["truth"], rtol=1e-5,
                               atol=1e-5)
    y, y_oracle = torch.zeros(tokens * top_k, 2 * inter), torch.zeros(tokens * top_k, 2 * inter)
    pair_lora_reference(x, picks, gu_lora, y, x_per_pair=False)
    pairs = torch.arange(tokens * top_k)
    for e in range(experts):
        rows = pairs[picks.flatten() == e]
        part = torch.zeros(len(rows), 2 * inter)
        _expert_delta(gu_lora, c["down_lora"])("gate_up_proj", e, rows // top_k, x[rows // top_k], part)
        y_oracle[rows] = part
    torch.testing.assert_close(y, y_oracle, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens, experts, top_k", [(5, 4, 2), (9, 8, 3)])
def test_pair_lora_matches_the_per_expert_reference(tokens: int, experts: int, top_k: int) -> None:
    """The fused experts with each pair's LoRA (Triton, interpreted) and pair_lora_reference,
    against experts_reference with the per-expert hook: float32, tokens on adapters of several
    ranks at several arena rows and on none."""
    if not interpreting():
        pytest.skip("runs in Triton's interpreter (test_fused_experts_in_the_interpreter starts it)")
    from kernels.moe.triton_kernel import fused_experts_lora_triton, pair_lora_triton

    inter = 40
    c = _lora_case(tokens, experts, top_k, 48, inter, seed=tokens)
    x, weights, picks, gate_up, down = c["x"], c["weights"], c["picks"], c["gate_up"], c["down"]
    gu_lora, down_lora, gen = c["gu_lora"], c["down_lora"], c["gen"]
    ours = fused_experts_lora_triton(x, weights, picks, gate_up, down, None, gu_lora, down_lora)
    torch.testing.assert_close(ours, c["truth"], rtol=1e-5, atol=1e-4)
    no_gate_up = PairLora(gu_lora.a, gu_lora.b, gu_lora.token_slots, gu_lora.first, torch.zeros_like(gu_lora.rank),
                          gu_lora.scaling)
    only_down = fused_experts_lora_triton(x, weights, picks, gate_up, down, None, None, down_lora)
    torch.testing.assert_close(only_down, experts_reference(x, weights, picks, gate_up, down,
                                                            _expert_delta(no_gate_up, down_lora)), rtol=1e-5, atol=1e-4)
    no_down = PairLora(down_lora.a, down_lora.b, down_lora.token_slots, down_lora.first,
                       torch.zeros_like(down_lora.rank), down_lora.scaling)
    only_gate_up = fused_experts_lora_triton(x, weights, picks, gate_up, down, None, gu_lora, None)
    torch.testing.assert_close(only_gate_up, experts_reference(x, weights, picks, gate_up, down,
                                                               _expert_delta(gu_lora, no_down)), rtol=1e-5, atol=1e-4)
    # pair by pair: the kernel and its PyTorch reference agree on a gate/up delta
    y_kernel = torch.randn(tokens * top_k, 2 * inter, generator=gen)
    y_reference = y_kernel.clone()
    pair_lora_triton(x, picks, gu_lora, y_kernel, x_per_pair=False)
    pair_lora_reference(x, picks, gu_lora, y_reference, x_per_pair=False)
    torch.testing.assert_close(y_kernel, y_reference, rtol=1e-5, atol=1e-4)


def test_pair_lora_tiles_the_rank_by_a_slots_most_rows_not_the_arenas_depth() -> None:
    """An arena of many adapters' rows (here 64, the slots' ranks at most 5): the kernels take
    a rank tile of max_rank rows and add what the reference adds."""
    if not interpreting():
        pytest.skip("runs in Triton's interpreter (test_fused_experts_in_the_interpreter starts it)")
    from kernels.moe.triton_kernel import pair_lora_triton

    gen = torch.Generator().manual_seed(3)
    tokens, experts, top_k = 7, 4, 2
    lora = _arena_lora(experts, 8, 48, 40, tokens, gen, torch.float32)
    junk = lambda t: torch.cat([t, torch.randn(experts, 56, t.shape[2], generator=gen)], dim=1)  # noqa: E731
    deep = PairLora(junk(lora.a), junk(lora.b), lora.token_slots, lora.first, lora.rank, lora.scaling, max_rank=8)
    assert deep.max_rank == 8 and PairLora(deep.a, deep.b, lora.token_slots, lora.first, lora.rank,
                                           lora.scaling).max_rank == 64
    x = torch.randn(tokens, 48, generator=gen)
    picks = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    y_kernel = torch.randn(tokens * top_k, 40, generator=gen)
    y_reference = y_kernel.clone()
    pair_lora_triton(x, picks, deep, y_kernel, x_per_pair=False)
    pair_lora_reference(x, picks, deep, y_reference, x_per_pair=False)
    torch.testing.assert_close(y_kernel, y_reference, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("x_per_pair", [False, True])
def test_pair_lora_in_one_launch_equals_the_two(x_per_pair: bool) -> None:
    """The shrink and expand of a pair in one program (fused) write what the two launches
    write, bit for bit: with and without down's routing weight, over tokens with no adapter."""
    if not interpreting():
        pytest.skip("runs in Triton's interpreter (test_fused_experts_in_the_interpreter starts it)")
    from kernels.moe.triton_kernel import pair_lora_triton

    gen = torch.Generator().manual_seed(5)
    tokens, experts, top_k, inp, out = 7, 4, 2, 48, 40
    lora = _arena_lora(experts, 8, inp, out, tokens, gen, torch.float32)
    x = torch.randn(tokens * top_k if x_per_pair else tokens, inp, generator=gen)
    picks = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens * top_k, generator=gen) if x_per_pair else None
    y = torch.randn(tokens * top_k, out, generator=gen)
    two, one = y.clone(), y.clone()
    pair_lora_triton(x, picks, lora, two, x_per_pair, weights, width=16)
    pair_lora_triton(x, picks, lora, one, x_per_pair, weights, width=16, fused=True)
    assert torch.equal(one, two) and not torch.equal(one, y)


@pytest.mark.parametrize("tokens, one_launch", [(3, False), (4, True)])
def test_pair_lora_takes_one_launch_where_the_pairs_fill_the_gpu(tokens: int, one_launch: bool,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """moe_lora_launches' 2: one launch where the pairs give every SM two programs (the
    interpreter's 4 SMs: 8 pairs), else two; 0 and 1 are taken as given."""
    if not interpreting():
        pytest.skip("runs in Triton's interpreter (test_fused_experts_in_the_interpreter starts it)")
    from kernels.moe import triton_kernel

    c = _lora_case(tokens, 4, 2, 48, 40, seed=tokens)
    fused = []
    real = triton_kernel.pair_lora_triton
    monkeypatch.setattr(triton_kernel, "pair_lora_triton", lambda *a, **kw: fused.append(kw["fused"]) or real(*a, **kw))
    for first in (2, 1, 0):
        launches = {"gate_up": (first, 64, 2), "down": (first, 64, 2)}
        out = triton_kernel.fused_experts_lora_triton(c["x"], c["weights"], c["picks"], c["gate_up"], c["down"], None,
                                                      c["gu_lora"], c["down_lora"], launches)
        torch.testing.assert_close(out, c["truth"], rtol=1e-5, atol=1e-4)
    assert fused == [one_launch, one_launch, True, True, False, False]
