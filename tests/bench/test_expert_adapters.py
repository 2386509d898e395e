"""Rows x of bench.serving: adapters with LoRA on every routed expert of a mixture of experts,
written by bench.harness without a model (a tensor at a time) under the names, shapes and
config fields PEFT saves over transformers 5's fused experts; the node validates and serves
them, PEFT loads them tensor for tensor, and their bytes are the floor's."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from bench import serving
from bench.harness import (ATTENTION_MODULES, StepBytes, adapter_bytes_per_rank, expected_experts,
                           expert_lora_bytes_per_rank, write_random_adapter)
from bench.shapes import MIXTRAL_8X7B, QWEN3_30B_A3B
from family_checkpoints import MOE_FAMILIES, family_spec, make_family_adapter
from inference_node.model.config import ModelConfig

CPU = torch.device("cpu")


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(folder / "adapter_model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_expert_adapter_is_what_peft_writes(family: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """Against PEFT's own adapter of the same tiny checkpoint (Qwen3-MoE's with a dense layer,
    which PEFT leaves without MLP LoRA): the same tensor names and shapes and config fields;
    the node's validation takes it with both expert parameters; PEFT loads every tensor of it
    into the model's LoRA parameters, none missing, none left over."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from inference_node.adapters.sources import weights_from_files

    path = request.getfixturevalue(f"tiny_{family}_path")
    cfg = ModelConfig.from_checkpoint(path)
    ours = write_random_adapter(tmp_path / "ours", cfg, 4, ATTENTION_MODULES, 0, CPU, torch.float32, experts=True)
    spec = family_spec(family)
    peft = make_family_adapter(path, tmp_path / "peft", 4, 8.0, [*spec.attention, *spec.mlp])
    mine, theirs = tensors(ours), tensors(peft)
    assert {k: t.shape for k, t in mine.items()} == {k: t.shape for k, t in theirs.items()}
    assert all(t.abs().min() > 0 for t in mine.values())  # random, non-zero A and B
    config, peft_config = (json.loads((f / "adapter_config.json").read_text()) for f in (ours, peft))
    for key in ("peft_type", "r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern"):
        assert config[key] == peft_config[key], key
    for key in ("target_modules", "target_parameters"):  # (PEFT saves sets)
        assert sorted(config[key]) == sorted(peft_config[key]), key

    weights = weights_from_files("x", "v1", (ours / "adapter_config.json").read_text(),
                                 bytearray((ours / "adapter_model.safetensors").read_bytes()), cfg, max_rank=4)
    assert set(weights.target_modules) == {*ATTENTION_MODULES, "experts.gate_up_proj", "experts.down_proj"}
    routed = [layer for layer in range(cfg.num_layers) if cfg.is_moe_layer(layer)]
    assert sorted(weights.experts) == [(layer, p) for layer in routed for p in ("down_proj", "gate_up_proj")]

    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, ours)
    loaded = {k.replace(".default.weight", ".weight"): p for k, p in model.named_parameters() if "lora_" in k}
    assert set(loaded) == set(mine)
    for name, tensor in mine.items():
        assert torch.equal(loaded[name].detach(), tensor), name


@pytest.mark.parametrize("shape", [QWEN3_30B_A3B, MIXTRAL_8X7B], ids=["qwen3-30b-a3b", "mixtral-8x7b"])
def test_expert_lora_bytes(shape: dict, tmp_path: Path) -> None:
    """An adapter's expert LoRA is num_experts x expert_lora_bytes_per_rank (gate_up at twice
    the rank), split over tensor-parallel ranks as the node splits it; a step reads the experts
    its adapter's tokens hit."""
    cfg = ModelConfig.from_dict(shape)
    h, inter, e, layers = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_layers
    per_expert = expert_lora_bytes_per_rank(cfg, 16, 2)
    assert per_expert == layers * 2 * (32 * (h + 2 * inter) + 16 * (inter + h))
    assert expert_lora_bytes_per_rank(cfg, 16, 2, tp=2) == layers * 2 * (32 * (h + inter) + 16 * (inter // 2 + h))
    whole = adapter_bytes_per_rank(cfg, 16, ATTENTION_MODULES, 2) + e * per_expert
    if shape is QWEN3_30B_A3B:  # what --expert-adapters' help says: 2 GB an adapter
        assert 1.95e9 < whole < 2.0e9
    floor = StepBytes.of(cfg, 2, {"x": 0, "c": 100}, expert_lora={"x": per_expert})
    assert floor.adapter_read(1, frozenset({"x"})) == round(cfg.num_experts_per_tok * per_expert)
    assert floor.adapter_read(64, frozenset({"x", "c"})) == 100 + round(expected_experts(e, cfg.num_experts_per_tok,
                                                                                          32) * per_expert)
    assert floor.step(8, frozenset({"x"}), 0) - floor.step(8, frozenset(), 0) == floor.adapter_read(8, frozenset({"x"}))


def test_written_adapter_holds_the_counted_bytes(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    cfg = ModelConfig.from_checkpoint(request.getfixturevalue("tiny_qwen3_moe_path"))
    out = write_random_adapter(tmp_path / "x", cfg, 16, ATTENTION_MODULES, 0, CPU, torch.bfloat16, experts=True)
    held = sum(t.numel() * t.element_size() for t in tensors(out).values())
    assert held == adapter_bytes_per_rank(cfg, 16, ATTENTION_MODULES, 2) + cfg.num_experts * expert_lora_bytes_per_rank(
        cfg, 16, 2)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_serving_row_x_runs_expert_lora(family: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """bench.serving --rows a --expert-adapters 2 on a tiny MoE checkpoint (CPU): row x-2 runs
    on a node whose expert arenas hold both adapters, its steps apply gate_up's and down's
    LoRA, and the summary says x-2's decode throughput against a's."""
    from inference_node.runner.lora.experts import ExpertLoraApplier

    applied: list[tuple[bool, bool]] = []
    pairs = ExpertLoraApplier.pairs

    def counted(self, layer: int):
        gate_up, down = pairs(self, layer)
        applied.append((gate_up is not None, down is not None))
        return gate_up, down

    monkeypatch.setattr(ExpertLoraApplier, "pairs", counted)
    path = request.getfixturevalue(f"tiny_{family}_path")
    summaries = serving.main(["--device", "cpu", "--model", str(path), "--rows", "a", "--expert-adapters", "2",
                              "--requests", "4", "--concurrency", "2", "--prompt-len", "4:8", "--output-len", "3",
                              "--threads", "1"])
    out = capsys.readouterr().out
    assert set(summaries) == {("a", "engine"), ("x-2", "engine")}, out
    x = summaries[("x-2", "engine")]
    assert x.error is None and x.output_tokens == 4 * 3 and x.adapters_per_step == 2, x
    assert math.isfinite(x.floor_p50) and x.floor_p50 > summaries[("a", "engine")].floor_p50
    assert applied and all(g and d for g, d in applied), applied  # every step of x-2: both parameters' LoRA
    assert "2 adapters, 2 with expert LoRA" in out and "x: r16 q,k,v,o + experts = " in out, out
    for phrase in ("x-2/a decode throughput", "x-2 extra decode step over a"):
        assert phrase in out, out


def test_expert_adapters_need_experts(tiny_llama_path: Path) -> None:
    with pytest.raises(SystemExit, match="is not a mixture of experts"):
        serving.main(["--device", "cpu", "--model", str(tiny_llama_path), "--expert-adapters", "1"])
