"""A checkpoint's quantization_config (model/quant.py): the FP8 schemes the node serves are
read with their block sizes; anything else is refused at start in one line naming the
quant_method or field (exit 1, no traceback, before any process starts), never loaded as
plain weights. `--quantization` takes fp8 or none."""
from __future__ import annotations

import subprocess
import sys

import pytest

from family_checkpoints import refused_checkpoint
from inference_node.cli import serve_parser
from inference_node.model.config import ModelConfig
from inference_node.model.families import UnsupportedModel
from inference_node.model.quant import WeightQuant

BASE = {"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4}
FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
CT_GROUP = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                                               "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}
CT = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": CT_GROUP},
      "ignore": ["lm_head"], "quantization_status": "compressed"}


def _quant(qc: dict) -> WeightQuant | None:
    return ModelConfig.from_dict({**BASE, "quantization_config": qc}).weight_quant


@pytest.mark.parametrize("qc, expected", [
    (FP8, WeightQuant("fp8", "weight_scale_inv", (128, 128))),
    ({"quant_method": "fp8"}, WeightQuant("fp8", "weight_scale_inv", (128, 128))),  # transformers' default
    ({**FP8, "weight_block_size": [64, 32], "modules_to_not_convert": ["lm_head", "model.embed_tokens"]},
     WeightQuant("fp8", "weight_scale_inv", (64, 32))),
    ({**FP8, "weight_block_size": None}, WeightQuant("fp8", "weight_scale_inv", None)),
    (CT, WeightQuant("compressed-tensors", "weight_scale")),
    ({**CT, "config_groups": {"g": {**CT_GROUP, "input_activations": None,
                                    "weights": {**CT_GROUP["weights"], "strategy": "tensor"}}}},
     WeightQuant("compressed-tensors", "weight_scale")),
    ({**CT, "ignore": ["lm_head", "re:.*embed_tokens.*"]}, WeightQuant("compressed-tensors", "weight_scale")),
])
def test_served_fp8_schemes_are_read(qc, expected) -> None:
    assert _quant(qc) == expected
    assert ModelConfig.from_dict(BASE).weight_quant is None


@pytest.mark.parametrize("qc, named", [
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
    ({"quant_method": "awq", "bits": 4}, "quant_method 'awq'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
    ({"quant_method": "fbgemm_fp8"}, "quant_method 'fbgemm_fp8'"),
    ({"bits": 4}, "quant_method None"),
    ({**FP8, "activation_scheme": "static"}, "activation_scheme 'static'"),
    ({**FP8, "scale_fmt": "ue8m0"}, "scale_fmt 'ue8m0'"),
    ({**FP8, "weight_block_size": [128]}, "weight_block_size"),
    ({**FP8, "modules_to_not_convert": ["down_proj"]}, "modules_to_not_convert entry 'down_proj'"),
    ({**FP8, "modules_to_convert": ["embed_tokens"]}, "modules_to_convert"),
    ({**CT, "format": "pack-quantized", "config_groups": {"g": {**CT_GROUP}}}, "format 'pack-quantized'"),
    ({**CT, "config_groups": {"g": {**CT_GROUP, "weights": {**CT_GROUP["weights"], "type": "int"}}}}, "type: 'int'"),
    ({**CT, "config_groups": {"g": {**CT_GROUP, "weights": {**CT_GROUP["weights"], "strategy": "block"}}}},
     "strategy: 'block'"),
    ({**CT, "config_groups": {"g": {**CT_GROUP, "weights": {**CT_GROUP["weights"], "num_bits": 4}}}},
     "num_bits: 4"),
    ({**CT, "config_groups": {"g": {**CT_GROUP, "input_activations": {**CT_GROUP["input_activations"],
                                                                      "dynamic": False}}}}, "input_activations"),
    ({**CT, "config_groups": {"g": {**CT_GROUP, "targets": ["re:.*down_proj$"]}}}, "targets"),
    ({**CT, "config_groups": {"a": CT_GROUP, "b": CT_GROUP}}, "2 config_groups"),
    ({**CT, "ignore": ["lm_head", "re:.*self_attn.*"]}, "ignore entry 're:.*self_attn.*'"),
    ({**CT, "ignore": ["model.layers.1.mlp.down_proj"]}, "ignore entry 'model.layers.1.mlp.down_proj'"),
    ({**CT, "kv_cache_scheme": {"num_bits": 8, "type": "float"}}, "kv_cache_scheme"),
    ({**CT, "sparsity_config": {"format": "sparse-24"}}, "sparsity_config"),
])
def test_unserved_quantization_is_refused_naming_it(qc, named) -> None:
    with pytest.raises(UnsupportedModel, match="quantization_config") as refused:
        _quant(qc)
    assert named in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("qc, named", [
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "quant_method 'gptq'"),
    ({**FP8, "activation_scheme": "static"}, "activation_scheme 'static'"),
])
def test_serve_refuses_an_unserved_quantization_in_one_line(qc, named, tmp_path, tokenizer_dir) -> None:
    model = refused_checkpoint(tmp_path, tokenizer_dir, {**BASE, "architectures": ["LlamaForCausalLM"],
                                                  "quantization_config": qc})
    proc = subprocess.run([sys.executable, "-m", "inference_node.cli", "serve", "--model", str(model),
                           "--device", "cpu", "--port", "0", "--quantization", "fp8"],
                          capture_output=True, text=True, timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output
    assert "Traceback" not in output, output
    errors = [line for line in output.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and named in errors[0] and "quantization_config" in errors[0], output


def test_quantization_flag_takes_fp8_or_none(capsys) -> None:
    parser = serve_parser(False)
    assert parser.parse_args([]).quantization == "none"
    assert parser.parse_args(["--quantization", "fp8"]).quantization == "fp8"
    assert parser.parse_args(["--quantization", "fp8-w8a8"]).quantization == "fp8-w8a8"
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(["--quantization", "int8"])
    assert exited.value.code == 2 and "invalid choice: 'int8'" in capsys.readouterr().err


MOE = {**BASE, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4,
       "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True}


def test_fp8_of_a_mixture_of_experts_model_is_refused() -> None:
    with pytest.raises(UnsupportedModel, match="FP8 weights .* mixture-of-experts"):
        ModelConfig.from_dict({**MOE, "quantization_config": FP8})
    assert ModelConfig.from_dict(MOE).num_experts == 4  # the 16-bit checkpoint is served


def test_serve_refuses_quantizing_a_mixture_of_experts_model_in_one_line(tmp_path, tokenizer_dir) -> None:
    model = refused_checkpoint(tmp_path, tokenizer_dir, MOE)
    proc = subprocess.run([sys.executable, "-m", "inference_node.cli", "serve", "--model", str(model),
                           "--device", "cpu", "--port", "0", "--quantization", "fp8"],
                          capture_output=True, text=True, timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output
    errors = [line for line in output.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "--quantization fp8 of a mixture-of-experts model" in errors[0], output
