"""LoRA over FP8 bases (#57), as a user runs them: a mixed batch of the base model and PEFT
adapters of several ranks and targets through gRPC, over (a) a plain checkpoint served with
`--quantization fp8` and (b) checkpoints written in Hugging Face's fine-grained FP8 format
(block scales, the projections' widths multiples of the block or not: the fused q/k/v then
holds per-row scales) and in compressed-tensors' per-channel and per-tensor formats, against
transformers + PEFT running the same FP8 values dequantized to float32 (tests/fp8_checkpoints.py):
token for token, greedy."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from family_checkpoints import family_spec, make_family_adapter
from fp8_checkpoints import write_dequantized_twin, write_fp8_checkpoint, write_quantized_twin
from harness import InProcessNode, generate_all, peft_greedy
from inference_node.adapters.slots import row_nbytes
from inference_node.config import NodeConfig
from inference_node.model.config import ModelConfig
from kernels.gemm import Fp8Weight


def adapters_of(family: str, edges: bool) -> dict[str, tuple[int, float, list[str]]]:
    spec = family_spec(family)
    attn, mlp = list(spec.attention), list(spec.mlp)
    embed, head = (["embed_tokens"], ["lm_head"]) if edges else ([], [])
    return {"r2-attn": (2, 4.0, attn[:1] + attn[-1:]), "r8-all": (8, 16.0, attn + mlp + embed),
            "r16-mlp-head": (16, 16.0, mlp + head)}


def run_parity(served: Path, oracle: Path, family: str, tmp_path: Path, graphs: bool = False,
               prepare=None, agree: int | None = None, **settings: object) -> InProcessNode:
    """Serves `served` with `settings`, checks every job's tokens against transformers + PEFT
    over `oracle` (plain weights; `prepare` hooks the oracle's model), and returns the stopped
    node. agree: only each job's first `agree` tokens must be equal (and 3 in 4 of all)."""
    adapters = adapters_of(family, edges=not graphs)
    root = tmp_path / "adapters"
    for seed, (name, (rank, alpha, targets)) in enumerate(adapters.items()):
        make_family_adapter(oracle, root / name, rank, alpha, targets, seed=seed, scale=3.0)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randrange(4, 40))] for _ in range(3)]
    expected = {name: peft_greedy(oracle, root / name, prompts, 10, prepare) for name in adapters}
    expected[""] = peft_greedy(oracle, None, prompts, 10, prepare)
    assert sum(expected[n] != expected[""] for n in adapters) >= len(adapters) - 1, "adapters too weak"
    row = sum(row_nbytes(ModelConfig.from_checkpoint(oracle), torch.float32).values())
    mode = "on" if graphs else "off"
    node = InProcessNode(NodeConfig.of(checkpoint=str(served), device="cpu", dtype="float32", num_kv_blocks=256,
                                      max_loras=3, max_lora_rank=16, lora_memory_bytes=16 * row,
                                      adapter_dir=str(root), debug_checks=True, max_num_batched_tokens=128,
                                      decode_graphs=mode, mixed_graphs=mode, **settings))
    try:
        jobs = [(name, prompts[i], 10) for name in ["", *adapters] for i in range(len(prompts))]
        rng.shuffle(jobs)
        equal = total = 0
        for (name, prompt, _), got in zip(jobs, generate_all(node, jobs)):
            want = expected[name][prompts.index(prompt)]
            assert got[:agree] == want[:agree], f"adapter {name or 'base'} diverged: {got} != {want}"
            equal, total = equal + sum(a == b for a, b in zip(got, want)), total + len(want)
        assert 4 * equal >= 3 * total, f"{equal} of {total} tokens as the oracle's"
        node.check_idle()
        assert all(e.refs == 0 for e in node.node.adapters.entries())
        if graphs:
            stats = node.engine.snapshot()
            assert stats["graph_steps"] > 0 and stats["piecewise_graph_steps"] > 0, stats
    finally:
        node.stop()
    return node


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_quantized_at_load_matches_peft_over_its_fp8_values(graphs: bool, tiny_llama_path: Path,
                                                            tmp_path: Path) -> None:
    """`--quantization fp8` on a plain checkpoint: the node answers as transformers + PEFT over
    the per-channel FP8 values dequantized (and not as over the plain weights: the check
    would be weak otherwise). graphs: the decode and piecewise graphs' paths (where a step of
    more adapters than here would shrink gate/up's LoRA in its FP8 GEMM's launch: the test
    below)."""
    twin = write_quantized_twin(tiny_llama_path, tmp_path / "twin")
    run_parity(tiny_llama_path, twin, "llama", tmp_path, graphs=graphs, quantization="fp8")
    plain = peft_greedy(tiny_llama_path, None, [[500, 600, 700, 800]], 10)
    assert plain != peft_greedy(twin, None, [[500, 600, 700, 800]], 10), "FP8 rounding changes no answer"


@pytest.mark.parametrize("quantization", ["fp8", "fp8-w8a8"])
def test_lora_shrunk_in_the_fp8_gemms_launch_matches_peft(quantization: str, tiny_llama_path: Path,
                                                          tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Tuning.fp8_shrink_fold_groups on every group, in decode graph steps of any number of
    adapters (no side-stream expands): each FP8 GEMM's launch shrinks its LoRA (here, on the
    CPU, the fold's reference stores the same rows) and the op after it expands; the node
    answers as transformers + PEFT do, and the fold ran."""
    from kernels.gemm import fold
    from kernels.tuning import GROUPS, Tuning

    shrinks = []
    store = fold.GemmLora.store_shrink
    monkeypatch.setattr(fold.GemmLora, "store_shrink", lambda self, x: (shrinks.append(x.shape[0]), store(self, x)))
    tuning = Tuning(fp8_shrink_fold_groups=frozenset(GROUPS), side_expand_segments=0,
                    side_expand_group_segments={})
    fixed = frozenset({"fp8_shrink_fold_groups", "side_expand_segments", "side_expand_group_segments"})
    twin = write_quantized_twin(tiny_llama_path, tmp_path / "twin")
    w8a8 = quantization == "fp8-w8a8"
    run_parity(tiny_llama_path, twin, "llama", tmp_path, graphs=True, quantization=quantization,
               prepare=quantize_projection_inputs if w8a8 else None, agree=4 if w8a8 else None,
               tuning=tuning, tuning_fixed=fixed)
    assert shrinks, "no FP8 GEMM shrank a LoRA"


PROJECTIONS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


ROW_PARALLEL = {"o_proj", "down_proj"}  # under tensor parallelism each rank holds a part of their input


def quantize_projection_inputs(model: torch.nn.Module, ranks: int = 1) -> None:
    """The oracle of --quantization fp8-w8a8: each decoder projection's base matmul (not its LoRA,
    not the LM head) takes its input rounded to e4m3 per token (kernels/gemm/fp8.py's
    quantize_rows, dequantized), as the node's fp8 tensor cores do; over `ranks` ranks the
    row-parallel projections' inputs are rounded a rank's columns at a time, each part with
    its own scale, as each rank rounds its own."""
    from kernels.gemm.fp8 import quantize_rows

    def rounded(x: torch.Tensor) -> torch.Tensor:
        quantized, scale = quantize_rows(x.reshape(-1, x.shape[-1]))
        return (quantized.float() * scale).reshape(x.shape).to(x.dtype)

    def per_rank(module: torch.nn.Module, args: tuple) -> tuple:
        return (torch.cat([rounded(part) for part in args[0].chunk(ranks, dim=-1)], dim=-1),)

    for name, module in model.named_modules():
        parts = name.split(".")
        projection = parts[-2] if parts[-1] == "base_layer" else parts[-1]
        if isinstance(module, torch.nn.Linear) and projection in PROJECTIONS:
            module.register_forward_pre_hook(per_rank if projection in ROW_PARALLEL else
                                             lambda module, args: (rounded(args[0]),))


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_w8a8_matches_peft_with_its_inputs_quantized_per_token(graphs: bool, tiny_llama_path: Path,
                                                               tmp_path: Path) -> None:
    """`--quantization fp8-w8a8`: the node answers as transformers + PEFT over the FP8 values with
    each projection's input rounded to e4m3 per token (the adapters' shrink on the unrounded
    input), and not as weight-only FP8 does (so the setting reaches the matmuls). Each job's
    first 4 tokens must be the oracle's and 3 in 4 of all: where rounding x to e4m3 is a step
    function, float32 noise between the two (summation order) can move an element across a
    rounding edge, and a later near-tie then goes the other way (seen: one job of 12 parts at
    its 6th token, at a top-2 logit margin of 0.057)."""
    twin = write_quantized_twin(tiny_llama_path, tmp_path / "twin")
    run_parity(tiny_llama_path, twin, "llama", tmp_path, graphs=graphs, prepare=quantize_projection_inputs,
               agree=4, quantization="fp8-w8a8")
    prompt = [[500, 600, 700, 800, 900, 1000]]
    assert (peft_greedy(twin, None, prompt, 12, quantize_projection_inputs)
            != peft_greedy(twin, None, prompt, 12)), "rounding the inputs changes no answer"


@pytest.mark.parametrize("family, block", [
    ("llama", (32, 32)),   # every width a multiple of the block
    ("qwen3", (32, 32)),   # k and v 48 rows wide: the fused q/k/v's scales go per row
    ("llama", (48, 48)),   # no width a multiple: partial edge tiles on both sides
    ("phi3", (48, 48)),    # q/k/v and gate/up fused in the checkpoint, parts off the block edges
    ("gemma3", (32, 32)),  # Gemma's own layer (model/gemma.py) over FP8 projections, tied LM head unquantized
])
def test_block_fp8_checkpoint_matches_peft(family: str, block: tuple[int, int], request: pytest.FixtureRequest,
                                           tmp_path: Path) -> None:
    plain = request.getfixturevalue(f"tiny_{family}_path")
    fp8 = write_fp8_checkpoint(plain, tmp_path / "fp8", "fp8", block)
    run_parity(fp8, write_dequantized_twin(fp8, tmp_path / "twin"), family, tmp_path)


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_compressed_tensors_fp8_checkpoint_matches_peft(strategy: str, tiny_qwen2_path: Path, tmp_path: Path) -> None:
    """compressed-tensors' float-quantized FP8 (dynamic per-token activations declared: the
    node keeps activations unquantized), on Qwen2 (q/k/v biases beside the FP8 weights)."""
    fp8 = write_fp8_checkpoint(tiny_qwen2_path, tmp_path / "fp8", strategy)
    run_parity(fp8, write_dequantized_twin(fp8, tmp_path / "twin"), "qwen2", tmp_path, quantization="fp8")


def test_fp8_checkpoint_is_held_as_its_own_fp8_bytes_and_scales(tiny_llama_path: Path, tmp_path: Path) -> None:
    """The pre-quantized checkpoint is not read as plain weights: every projection is an
    Fp8Weight holding the checkpoint's own bytes and scales (q/k/v fused in order), and the
    same file without its quantization_config is refused, not read as plain weights."""
    import json

    from safetensors.torch import load_file

    from inference_node.model.checkpoint import CheckpointError
    from inference_node.model.loader import load_model

    fp8 = write_fp8_checkpoint(tiny_llama_path, tmp_path / "fp8", "fp8", (32, 32))
    model = load_model(fp8, torch.device("cpu"), torch.float32)
    stored = load_file(str(fp8 / "model.safetensors"))
    qkv = model.layers[1].qkv
    assert isinstance(qkv, Fp8Weight) and qkv.weight.dtype == torch.float8_e4m3fn and qkv.block == (32, 32)
    names = [f"model.layers.1.self_attn.{m}_proj.weight" for m in "qkv"]
    assert torch.equal(qkv.weight.view(torch.uint8), torch.cat([stored[n] for n in names]).view(torch.uint8))
    assert torch.equal(qkv.scale, torch.cat([stored[n + "_scale_inv"] for n in names]))
    assert all(isinstance(getattr(layer, g), Fp8Weight) for layer in model.layers for g in ("qkv", "o", "gate_up", "down"))
    assert model.lm_head.dtype == torch.float32 and model.embed.dtype == torch.float32

    config = json.loads((fp8 / "config.json").read_text())
    del config["quantization_config"]
    (fp8 / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"float8_e4m3fn, not plain weights.*quantization_config"):
        load_model(fp8, torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("family, quantization", [("llama", "none"), ("llama", "fp8"), ("qwen2", "none")])
def test_matmuls_without_a_fold_get_no_lora_fold(family: str, quantization: str,
                                                 request: pytest.FixtureRequest) -> None:
    """The FP8 GEMM adds no whole LoRA delta (it shrinks, for Tuning.fp8_shrink_fold_groups),
    and the fold kernel adds no bias: over FP8 projections, and for Qwen2's biased q/k/v, the
    step plan shrinks and expands beside the matmul (a fold there would fall back to its
    reference's per-row gather, the c-32 row's step tripled on the GPU); the others keep the
    table's folds."""
    from inference_node.node import Shard, checked_config, load_rank

    path = request.getfixturevalue(f"tiny_{family}_path")
    config, _ = checked_config(NodeConfig.of(checkpoint=str(path), device="cpu", quantization=quantization,
                                             num_kv_blocks=8, max_loras=2, max_lora_rank=16))
    parts = load_rank(config, Shard(0, 1), None)
    tunings = [parts.launches.tunings.base, *(t for _, _, t in parts.launches.tunings.entries)]
    folds = [t.fold_groups | t.shrink_fold_groups for t in tunings]
    if quantization == "fp8":  # the FP8 GEMM only shrinks, for the groups its tuning names
        assert parts.model.fp8_projections and not any(t.fold_groups | t.fold_shrink_spread for t in tunings)
        assert all(t.shrink_fold_groups == t.fp8_shrink_fold_groups for t in tunings)
    elif family == "qwen2":
        assert parts.model.layers[0].qkv_bias is not None
        assert all(fold and "qkv" not in fold for fold in folds)
    else:
        assert all("qkv" in fold for fold in folds)
