"""Every served family through the node, as a new user runs it: a tiny random checkpoint
with the family's quirks on (tests/family_checkpoints.py), PEFT adapters on the family's own
module names of mixed ranks and targets (the embedding and the LM head included), all of them
and the base model in one mixed batch through gRPC, with less adapter memory than they need
(evictions), against transformers + PEFT running each alone: token for token, greedy."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from family_checkpoints import FAMILIES, family_spec, make_family_adapter
from harness import InProcessNode, generate_all, peft_greedy
from inference_node.adapters.slots import budget_row_nbytes
from inference_node.model.config import ModelConfig
from inference_node.config import NodeConfig


def family_adapters(family: str, edges: bool = True) -> dict[str, tuple[int, float, list[str], bool]]:
    """name: (rank, alpha, PEFT targets, rsLoRA), by the family's own module names; edges:
    with LoRA on the embedding and the LM head."""
    spec = family_spec(family)
    attn, mlp = list(spec.attention), list(spec.mlp)
    embed, head = (["embed_tokens"], ["lm_head"]) if edges else ([], [])
    return {
        "r2-attn": (2, 4.0, attn[:1] + attn[-1:], False),
        "r8-all-embed": (8, 16.0, attn + mlp + embed, True),
        "r16-mlp-head": (16, 16.0, mlp + head, False),
        "r4-edges": (4, 8.0, embed + head + [attn[-1]], False),
    }


def run_family_parity(base: Path, family: str, adapter_root: Path, device: str, dtype: str,
                      num_prompts: int, max_new: int, scale: float, edges: bool = True,
                      float_ties: bool = False, start_timeout: float | None = None,
                      **settings: object) -> InProcessNode:
    """Runs the mixed batch and checks it; returns the (stopped) node for further checks.
    float_ties: a token may also be one whose logit ties transformers' greedy choice within
    float32 rounding (kernels that sum in another order: the Triton path)."""
    adapters = family_adapters(family, edges)
    for seed, (name, (rank, alpha, targets, rs)) in enumerate(adapters.items()):
        make_family_adapter(base, adapter_root / name, rank, alpha, targets, rs, seed=seed, scale=scale)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randrange(4, 60))] for _ in range(num_prompts)]
    expected = {name: peft_greedy(base, adapter_root / name, prompts, max_new) for name in adapters}
    expected[""] = peft_greedy(base, None, prompts, max_new)
    differs = sum(expected[n] != expected[""] for n in adapters)
    assert differs >= len(adapters) - 1, "the adapters barely change the model: the test would be weak"

    # Room for 16 rank rows per module (the experts' gate_up_proj: 32): r16-mlp-head and
    # r8-all-embed never on the GPU at once.
    row = budget_row_nbytes(ModelConfig.from_checkpoint(base), torch.float32)
    node = InProcessNode(NodeConfig.of(checkpoint=str(base), device=device, dtype=dtype, num_kv_blocks=256,
                                      max_loras=3, max_lora_rank=16, max_cpu_loras=4,
                                      lora_memory_bytes=16 * row, adapter_dir=str(adapter_root),
                                      debug_checks=True, max_num_batched_tokens=128, **settings),
                        start_timeout=start_timeout)
    try:
        jobs = [(name, prompts[i], max_new) for name in [""] + list(adapters) for i in range(len(prompts))]
        rng.shuffle(jobs)
        results = generate_all(node, jobs)
        for (name, prompt, _), got in zip(jobs, results):
            want = expected[name][prompts.index(prompt)]
            if float_ties and got != want:
                assert_float_tie(base, adapter_root / name if name else None, prompt, got)
                continue
            assert got == want, f"{family}: adapter {name or 'base'} diverged"
        assert node.node.adapters.stats["evictions"] > 0
        node.check_idle()
        assert all(e.refs == 0 for e in node.node.adapters.entries())
    finally:
        node.stop()
    return node


def assert_float_tie(base: Path, adapter: Path | None, prompt: list[int], answer: list[int]) -> None:
    """Every token of the answer is transformers + PEFT's greedy choice teacher-forced over it,
    or ties it within float32 rounding."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    ids = torch.tensor([list(prompt) + answer])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1]
    best = logits.max(dim=-1).values
    chosen = logits.gather(1, torch.tensor(answer)[:, None])[:, 0]
    assert ((best - chosen) <= 1e-4 * best.abs().clamp(min=1.0)).all(), (best - chosen).tolist()


@pytest.mark.parametrize("family", ["gemma3", "qwen3", "phi3", "qwen3_moe"])
def test_family_with_the_triton_kernels_matches_peft(family: str, request: pytest.FixtureRequest,
                                                    tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The graphs' paths with the Triton kernels (in Triton's interpreter, on the CPU: the
    slow tier, tests/kernels/test_triton_interpreter.py): the families' kernel options where
    the engine launches them, against PEFT (ties within float32 rounding allowed). A mixture
    of experts' expert LoRA runs beside its fused grouped GEMMs."""
    from kernels.host import interpreting

    if not interpreting():
        pytest.skip("runs the Triton kernels in Triton's interpreter (TRITON_INTERPRET=1)")
    from kernels.moe import triton_kernel as moe_kernels

    calls = []
    fused_with_lora = moe_kernels.fused_experts_lora_triton
    monkeypatch.setattr(moe_kernels, "fused_experts_lora_triton", lambda *a: calls.append(1) or fused_with_lora(*a))
    base = request.getfixturevalue(f"tiny_{family}_path")
    # Few graph sizes (8 rows): each is run through at start, every kernel interpreted.
    run_family_parity(base, family, tmp_path / "adapters", "cpu", "float32", num_prompts=2, max_new=10,
                      scale=3.0, edges=False, float_ties=True, start_timeout=300.0, decode_graphs="on",
                      mixed_graphs="on", max_num_seqs=8)
    assert bool(calls) == (family == "qwen3_moe")


@pytest.mark.parametrize("graphs", ["eager", "graphs"])
@pytest.mark.parametrize("family", FAMILIES)
def test_family_mixed_batch_matches_peft(family: str, graphs: str, request: pytest.FixtureRequest,
                                         tmp_path: Path) -> None:
    """graphs: the decode graphs' and piecewise graphs' static-buffer paths (run without
    capture on CPU), with adapters on the decoder layers only (a step whose adapters have
    embedding or LM head LoRA runs eagerly)."""
    base = request.getfixturevalue(f"tiny_{family}_path")
    mode = "on" if graphs == "graphs" else "off"
    node = run_family_parity(base, family, tmp_path / "adapters", "cpu", "float32", num_prompts=3,
                             max_new=12, scale=3.0, edges=graphs == "eager", decode_graphs=mode,
                             mixed_graphs=mode)
    if graphs == "graphs":
        stats = node.engine.snapshot()
        assert stats["graph_steps"] > 0 and stats["piecewise_graph_steps"] > 0, stats
