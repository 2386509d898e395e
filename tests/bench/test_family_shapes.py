"""The benchmarks' family shapes (bench.shapes FAMILY_SHAPES, the harness's RANDOM_MODELS that
every benchmark's --model takes: the serving benchmark's engine, gRPC and HTTP paths alike):
each parses as its family with its quirks, makes a dummy checkpoint the node loads, and gets
adapters named as PEFT names the family's modules (Phi-3's fused ones), which the node accepts."""
from __future__ import annotations

import json

import pytest
import torch

from bench.harness import RANDOM_MODELS, bench_model, model_config, write_random_adapter
from bench.shapes import FAMILY_SHAPES
from inference_node.adapters.sources import LocalDirSource
from inference_node.model.config import ModelConfig
from inference_node.model.loader import checkpoint_shapes

EXPECTED = {  # family, hidden, layers, q/kv heads, head_dim, quirk
    "qwen2.5-7b": ("qwen2", 3584, 28, 28, 4, 128, lambda c: c.attention_bias),
    "qwen3-8b": ("qwen3", 4096, 36, 32, 8, 128, lambda c: c.qk_norm),
    "mistral-7b": ("mistral", 4096, 32, 32, 8, 128, lambda c: c.every_layer_windowed and c.sliding_window == 4096),
    "gemma2-9b": ("gemma2", 3584, 42, 16, 8, 256, lambda c: c.attn_logit_softcap == 50 and c.final_logit_softcap == 30
                  and c.layer_window(0) == 4096 and c.layer_window(1) == 0 and c.tie_word_embeddings),
    "phi3-mini": ("phi3", 3072, 32, 32, 32, 96, lambda c: c.every_layer_windowed and c.sliding_window == 2047),
}


@pytest.mark.parametrize("shape", list(FAMILY_SHAPES))
def test_family_shape_is_its_family_with_real_widths(shape: str, tmp_path) -> None:
    family, hidden, layers, heads, kv_heads, head_dim, quirk = EXPECTED[shape]
    config = model_config(f"{shape}-random")
    assert (config.family, config.hidden_size, config.num_layers, config.num_heads, config.num_kv_heads,
            config.head_dim) == (family, hidden, layers, heads, kv_heads, head_dim)
    assert quirk(config)
    model = bench_model(f"{shape}-random", tmp_path, torch.bfloat16, torch.device("cpu"), seed=0)
    assert model.load_format == "dummy" and ModelConfig.from_checkpoint(model.checkpoint) == config
    names = checkpoint_shapes(config)
    fused = family == "phi3"
    assert ("layers.0.self_attn.qkv_proj.weight" in names) == fused
    assert ("layers.0.self_attn.q_proj.bias" in names) == (family == "qwen2")
    assert ("layers.0.self_attn.q_norm.weight" in names) == (family == "qwen3")
    assert ("layers.0.pre_feedforward_layernorm.weight" in names) == (family == "gemma2")
    served = json.loads((model.checkpoint / "config.json").read_text())
    assert served["architectures"] == FAMILY_SHAPES[shape]["architectures"]
    assert (model.checkpoint / "tokenizer.json").exists()  # a served node detokenizes its answers
    assert f"{shape}-random" in RANDOM_MODELS


@pytest.mark.parametrize("shape", ["phi3-mini", "qwen3-8b"])
def test_bench_adapters_are_named_as_the_familys_peft_adapters(shape: str, tmp_path) -> None:
    config = ModelConfig.from_dict({**FAMILY_SHAPES[shape], "num_hidden_layers": 2})
    write_random_adapter(tmp_path / "a", config, 4, ("q_proj", "v_proj", "down_proj"), seed=0,
                         device=torch.device("cpu"), dtype=torch.float32)
    spec = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert set(spec["target_modules"]) == ({"qkv_proj", "down_proj"} if shape == "phi3-mini"
                                           else {"q_proj", "v_proj", "down_proj"})
    loaded = LocalDirSource(tmp_path, config, max_rank=16).load("a", "")
    assert set(loaded.target_modules) >= {"q_proj", "v_proj", "down_proj"}
