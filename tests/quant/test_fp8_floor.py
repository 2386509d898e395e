"""The serving benchmark's decode-step floor over FP8 projections: the bytes it counts per step
are the loaded model's (one byte a projection weight plus its float32 scales, the rest in the
model's dtype), per channel with --quantization fp8 and per block for an FP8 checkpoint."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench import harness
from inference_node.model.config import ModelConfig
from inference_node.model.llama import LlamaModel
from inference_node.model.loader import load_model
from kernels.gemm import Fp8Weight

RAW = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1000, "hidden_size": 256,
       "intermediate_size": 640, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
       "attention_bias": True}


def read_per_step(model: LlamaModel) -> int:
    """What a decode step reads of the loaded weights (the embedding only at its rows)."""
    tensors = [model.final_norm, model.lm_head]
    for layer in model.layers:
        for t in (layer.input_norm, layer.qkv, layer.qkv_bias, layer.o, layer.post_norm, layer.gate_up, layer.down):
            tensors += [t.weight, t.scale] if isinstance(t, Fp8Weight) else [t]
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("quantization_config, flag", [
    (None, "fp8"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}, "none"),
    (None, "none"),
])
def test_floor_counts_the_loaded_fp8_bytes(quantization_config, flag, tmp_path: Path) -> None:
    raw = {**RAW, "quantization_config": quantization_config} if quantization_config else RAW
    (tmp_path / "config.json").write_text(json.dumps(raw))
    model = load_model(tmp_path, torch.device("cpu"), torch.bfloat16, max_positions=64, load_format="dummy",
                            quantization=flag)
    fp8 = flag == "fp8" or quantization_config is not None
    assert model.fp8_projections == fp8
    cfg = ModelConfig.from_dict(raw)
    assert harness.weight_bytes_per_rank(cfg, 2, fp8=flag == "fp8") == read_per_step(model)
    plain = harness.weight_bytes_per_rank(ModelConfig.from_dict(RAW), 2)
    if fp8:  # about half: one byte a weight instead of two, the LM head and scales beside
        projections = sum(n * k for n, k in harness.projection_shapes_per_rank(cfg)) * cfg.num_layers
        assert plain - read_per_step(model) == projections - 4 * sum(
            t.scale.numel() for layer in model.layers for t in (layer.qkv, layer.o, layer.gate_up, layer.down))
