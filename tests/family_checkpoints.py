"""Tiny random checkpoints of every model family the node serves, written by transformers'
own classes with each family's quirks switched on (biases, q/k norms, sliding windows,
soft-capping, fused projections), and the PEFT adapters of each family's module names.

The weights that transformers initialises to a neutral value (norms, biases) are drawn at
random, so a node that ignored one of them would answer differently from the oracle."""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

# Every tiny family shares these widths: 3 layers of hidden 64 over SmolLM2's 49152-token
# vocabulary (its tokenizer ships with the checkpoints), so a parity test stays in seconds.
TINY = dict(vocab_size=49152, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
            rms_norm_eps=1e-5, initializer_range=0.3, bos_token_id=1, eos_token_id=2, pad_token_id=0)
# A window the parity prompts (up to ~70 tokens with their answers) pass several times.
TINY_WINDOW = 20


@dataclass(frozen=True)
class FamilySpec:
    """How to build one family's checkpoint with transformers, and the PEFT module names its
    adapters target."""

    config: Callable[..., Any]      # the transformers config class
    model: Callable[..., Any]       # the transformers *ForCausalLM class
    params: dict[str, Any]          # the family's quirks on top of TINY
    attention: tuple[str, ...]      # PEFT target names of its attention projections
    mlp: tuple[str, ...]            # ... and of its MLP
    # Gemma's tied embeddings, scaled by sqrt(hidden) on the way in, outweigh what random layers
    # add to the residual stream, so every answer repeats its last token: smaller embeddings and
    # a larger final norm give answers that depend on the prompt (and logits near the soft-cap).
    embed_scale: float = 1.0
    final_norm_gain: float = 0.0


def _specs() -> dict[str, FamilySpec]:
    import transformers as tf

    llama_attn = ("q_proj", "k_proj", "v_proj", "o_proj")
    llama_mlp = ("gate_proj", "up_proj", "down_proj")
    return {
        "llama": FamilySpec(tf.LlamaConfig, tf.LlamaForCausalLM, {}, llama_attn, llama_mlp),
        # q/k/v biases (always on in Qwen2)
        "qwen2": FamilySpec(tf.Qwen2Config, tf.Qwen2ForCausalLM, {}, llama_attn, llama_mlp),
        # per-head q/k RMSNorm; a head_dim of its own
        "qwen3": FamilySpec(tf.Qwen3Config, tf.Qwen3ForCausalLM, dict(head_dim=24), llama_attn, llama_mlp),
        # every layer windowed
        "mistral": FamilySpec(tf.MistralConfig, tf.MistralForCausalLM, dict(sliding_window=TINY_WINDOW),
                              llama_attn, llama_mlp),
        # soft-capped attention logits and final logits that bite at these widths (greedy
        # answers show the first; the logits tests the second, which keeps the argmax), a query
        # scale that is not head_dim's, sliding and full layers alternating, tied embeddings
        "gemma2": FamilySpec(tf.Gemma2Config, tf.Gemma2ForCausalLM, dict(
            head_dim=16, query_pre_attn_scalar=24, attn_logit_softcapping=3.0, final_logit_softcapping=5.0,
            sliding_window=TINY_WINDOW, tie_word_embeddings=True), llama_attn, llama_mlp,
            embed_scale=0.1, final_norm_gain=10.0),
        # q/k norm (1 + w), layer_types, a local and a global RoPE base, final-logit soft-cap
        "gemma3": FamilySpec(tf.Gemma3TextConfig, tf.Gemma3ForCausalLM, dict(
            head_dim=16, query_pre_attn_scalar=20, sliding_window=TINY_WINDOW, tie_word_embeddings=True,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            final_logit_softcapping=5.0,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0,
                                                "factor": 4.0}}), llama_attn, llama_mlp,
            embed_scale=0.1, final_norm_gain=10.0),
        # experts (PEFT converts the per-expert names to target_parameters on transformers 5):
        # q/k norms, top-k renormalised, a dense layer (mlp_only_layers) of its own width
        "qwen3_moe": FamilySpec(tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM, dict(
            head_dim=24, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=48, norm_topk_prob=True,
            mlp_only_layers=[1]), llama_attn, llama_mlp),
        # experts w1 (gate), w3 (up), w2 (down), every layer routed and windowed
        "mixtral": FamilySpec(tf.MixtralConfig, tf.MixtralForCausalLM, dict(
            num_local_experts=4, num_experts_per_tok=2, intermediate_size=96, sliding_window=TINY_WINDOW),
            llama_attn, ("w1", "w3", "w2")),
        # fused qkv_proj and gate_up_proj in the checkpoint and in PEFT's names; windowed
        "phi3": FamilySpec(tf.Phi3Config, tf.Phi3ForCausalLM, dict(sliding_window=TINY_WINDOW),
                           ("qkv_proj", "o_proj"), ("gate_up_proj", "down_proj")),
    }


FAMILIES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3")
# Mixture-of-experts families (tests/families/test_moe_parity.py): their adapters' MLP LoRA is
# on the experts, which the dense families' tests do not know.
MOE_FAMILIES: tuple[str, ...] = ("qwen3_moe", "mixtral")


def family_spec(family: str) -> FamilySpec:
    return _specs()[family]


def make_tiny_family(family: str, out: Path, tokenizer_from: Path, seed: int = 0,
                     **overrides: object) -> Path:
    """A small random checkpoint of `family` (HF format, float32) with SmolLM2's tokenizer."""
    spec = family_spec(family)
    torch.manual_seed(seed)
    params = {**TINY, **spec.params, **overrides}
    model = spec.model(spec.config(**params)).to(torch.float32)
    with torch.no_grad():
        _off_neutral(model, family)
        model.get_input_embeddings().weight.mul_(spec.embed_scale)
        model.model.norm.weight.add_(spec.final_norm_gain)
    return _save(model, out, tokenizer_from)


def make_family_widths(family: str, shape: dict[str, Any], out: Path, tokenizer_from: Path,
                       device: str = "cuda", dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                       **overrides: object) -> Path:
    """A checkpoint of `shape` (a config dict: bench.shapes' families) made by transformers on
    `device` in `dtype`, random weights, norms and biases off neutral, with SmolLM2's tokenizer."""
    spec = family_spec(family)
    torch.manual_seed(seed)
    params = {k: v for k, v in shape.items() if k not in ("architectures", "model_type", "torch_dtype")}
    params.update(pad_token_id=0, **overrides)
    with torch.device(device):
        model = spec.model(spec.config(**params)).to(dtype)
    with torch.no_grad():
        _off_neutral(model, family, spread=0.1)
    return _save(model, out, tokenizer_from)


def _off_neutral(model: torch.nn.Module, family: str, spread: float = 0.3) -> None:
    """Norm weights and biases drawn at random (transformers makes them neutral)."""
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            # Gemma's norms scale by (1 + w), the others by w: both away from neutral
            neutral = 0.0 if family.startswith("gemma") else 1.0
            p.copy_(neutral + spread * torch.randn_like(p))
        elif name.endswith(".bias"):
            p.normal_(0.0, 0.5 * spread / 0.3)


def _save(model: torch.nn.Module, out: Path, tokenizer_from: Path) -> Path:
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, out / name)
    return out


def make_family_adapter(base_path: Path, out: Path, rank: int, alpha: float, targets: Sequence[str],
                        use_rslora: bool = False, seed: int = 0, scale: float = 1.0) -> Path:
    """A random (non-zero) PEFT LoRA adapter of the checkpoint at base_path, targets by the
    family's own module names (embed_tokens and lm_head included), saved as safetensors
    without copies of the base embeddings (save_embedding_layers=False)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), use_rslora=use_rslora,
                        init_lora_weights=False, lora_dropout=0.0)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.mul_(scale)
    model.save_pretrained(out, safe_serialization=True, save_embedding_layers=False)
    for extra in out.iterdir():
        if extra.name not in ("adapter_config.json", "adapter_model.safetensors"):
            extra.unlink()
    return out


def refused_checkpoint(tmp_path: Path, tokenizer_dir: Path, config: dict) -> Path:
    """A checkpoint folder of `config` whose weights file is empty: for configs the node must
    refuse before it reads a weight."""
    out = tmp_path / "model"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config))
    shutil.copy(tokenizer_dir / "tokenizer.json", out / "tokenizer.json")
    (out / "model.safetensors").write_bytes(b"")
    return out
