"""Tensor parallelism (CPU, gloo) for the families' own weights: Phi-3's fused q/k/v and
gate/up (each rank reads its heads' rows of every part of the fused tensor) and its fused
adapters, Qwen2's biases, Qwen3's q/k norms, Gemma's norms, soft-caps and tied embeddings,
and LoRA on the embedding and the LM head (whole on every rank; the LM head's delta taken
over each rank's block of the vocabulary), the MoE families' experts and expert LoRA (each
rank its block of every expert's intermediate columns): TP=2 gives TP=1's greedy tokens, base and adapters
in one batch."""
from __future__ import annotations

import random

import pytest

from family_checkpoints import family_spec, make_family_adapter
from harness import InProcessNode, generate_all
from inference_node.config import NodeConfig


@pytest.mark.parametrize("family", ["phi3", "qwen2", "qwen3", "gemma2", "qwen3_moe", "mixtral"])
def test_tp2_gives_tp1_tokens_for_the_familys_weights_and_adapters(family, request, tmp_path) -> None:
    base = request.getfixturevalue(f"tiny_{family}_path")
    spec = family_spec(family)
    root = tmp_path / "adapters"
    make_family_adapter(base, root / "all-edges", 4, 8.0, [*spec.attention, *spec.mlp, "embed_tokens", "lm_head"],
                        seed=1, scale=3.0)
    make_family_adapter(base, root / "mlp", 8, 8.0, list(spec.mlp), seed=2, scale=3.0)
    rng = random.Random(1)
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in (5, 23, 41)]
    jobs = [(name, p, 6) for name in ("", "all-edges", "mlp") for p in prompts]
    answers = []
    for size in (1, 2):
        node = InProcessNode(NodeConfig.of(checkpoint=str(base), device="cpu", dtype="float32", num_kv_blocks=128,
                                          cpu_threads=1, tensor_parallel_size=size, max_loras=2,
                                          max_lora_rank=8, adapter_dir=str(root), debug_checks=True))
        try:
            answers.append(generate_all(node, jobs))
            node.check_idle()
        finally:
            node.stop()
            node.node.close()
    assert answers[0] == answers[1]
    by_job = dict(zip(((name, tuple(p)) for name, p, _ in jobs), answers[0]))
    for name in ("all-edges", "mlp"):  # each adapter changed the answers: its shards were applied
        assert any(by_job[(name, tuple(p))] != by_job[("", tuple(p))] for p in prompts), name
