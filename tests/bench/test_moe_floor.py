"""The decode floor of a mixture-of-experts model (bench/harness.py StepBytes): the weights
every step reads, plus the experts its batch is expected to touch under uniform routing."""
from __future__ import annotations

import math

import pytest

from bench.harness import StepBytes, expected_experts, expert_bytes_per_rank, weight_bytes_per_rank
from bench.shapes import QWEN3_30B_A3B
from inference_node.model.config import ModelConfig
from inference_node.model.loader import checkpoint_shapes


def test_expected_experts_under_uniform_routing() -> None:
    assert expected_experts(128, 8, 1) == pytest.approx(8.0)
    assert expected_experts(128, 8, 64) == pytest.approx(128 * (1 - (15 / 16) ** 64))
    assert 125.5 < expected_experts(128, 8, 64) < 126.5  # batch 64 reads nearly every expert
    assert expected_experts(0, 0, 64) == 0.0


def test_qwen3_30b_a3b_floor_counts_its_weights_once() -> None:
    """Every weight of the checkpoint is in the floor exactly once when every expert is hit
    (the embedding aside: a step reads a row a token; q/k norms aside: a few KB)."""
    cfg = ModelConfig.from_dict(QWEN3_30B_A3B)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.dense_layers) == (128, 8, 768, ())
    shapes = checkpoint_shapes(cfg)
    counted = sum(math.prod(s) for n, s in shapes.items()
                  if n != "embed_tokens.weight" and not n.endswith(("q_norm.weight", "k_norm.weight")))
    everything = weight_bytes_per_rank(cfg, 2) + cfg.num_experts * expert_bytes_per_rank(cfg, 2)
    assert everything == 2 * counted
    floor = StepBytes.of(cfg, 2, {})
    at_64 = floor.step(64, frozenset(), kv_tokens=0)
    assert at_64 == weight_bytes_per_rank(cfg, 2) + round(expected_experts(128, 8, 64) * floor.expert) + 64 * 2048 * 2
    # batch 1 reads 8 experts: the active parameters (about 3.3 B of 30.5 B)
    assert floor.step(1, frozenset(), 0) < at_64 / 4
