"""config.json per family: an architecture the node does not serve makes `inference-node
serve` exit 1 at start with one line naming what it serves, and no traceback; a switch of a
served family the node does not implement is refused alike; the switches it reads are where
transformers reads them."""
from __future__ import annotations

import subprocess
import sys

import pytest

from family_checkpoints import refused_checkpoint
from inference_node.model.config import ModelConfig
from inference_node.model.families import UnsupportedModel


QWEN2_MOE = {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "vocab_size": 32000,
             "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_experts": 8, "num_experts_per_tok": 2, "shared_expert_intermediate_size": 128}


@pytest.mark.parametrize("config, named", [
    (QWEN2_MOE, "mixture-of-experts"),
    ({**QWEN2_MOE, "architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox"}, "GPTNeoXForCausalLM"),
])
def test_serve_refuses_an_unserved_architecture_in_one_line(config, named, tmp_path, tokenizer_dir) -> None:
    model = refused_checkpoint(tmp_path, tokenizer_dir, config)
    proc = subprocess.run([sys.executable, "-m", "inference_node.cli", "serve", "--model", str(model),
                           "--device", "cpu", "--port", "0"], capture_output=True, text=True, timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output
    assert "Traceback" not in output, output
    errors = [line for line in output.splitlines() if " ERROR " in line]
    assert len(errors) == 1, output
    assert named in errors[0] and "it serves: llama (LlamaForCausalLM)" in errors[0]
    for family in ("qwen3", "gemma2", "gemma3", "phi3", "mistral", "qwen2", "qwen3_moe", "mixtral"):
        assert family in errors[0]


@pytest.mark.parametrize("raw, phrase", [
    ({"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]}, "Gemma3ForConditionalGeneration"),
    ({"model_type": "phi3", "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.75}},
     "partial rotary"),
    ({"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn' is not served"),
    ({"model_type": "llama", "hidden_act": "relu"}, "activation 'relu'"),
])
def test_config_switches_the_node_does_not_implement_are_refused(raw, phrase) -> None:
    base = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4}
    with pytest.raises(UnsupportedModel, match=phrase):
        ModelConfig.from_dict({**base, **raw})


@pytest.mark.parametrize("model_type, attention_bias, expected", [
    ("llama", True, (True, True)), ("qwen2", False, (True, False)), ("qwen3", True, (True, True)),
    ("gemma2", True, (True, True)), ("mistral", True, (False, False)), ("phi3", True, (False, False)),
])
def test_biases_are_where_transformers_puts_them(model_type, attention_bias, expected) -> None:
    """(q/k/v bias, o bias) as each family's transformers attention builds them."""
    config = ModelConfig.from_dict({"model_type": model_type, "vocab_size": 100, "hidden_size": 64,
                                    "intermediate_size": 128, "num_hidden_layers": 2,
                                    "num_attention_heads": 4, "attention_bias": attention_bias,
                                    "mlp_bias": True})
    assert (config.attention_bias, config.o_bias) == expected
    assert config.mlp_bias == (model_type == "llama")
