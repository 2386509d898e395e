"""The model families the node serves, keyed by a checkpoint's config.json (`architectures`,
then `model_type`): each family's decoder kind, its checkpoint's projection names and the
module names its PEFT adapters target.

One decoder serves the families that differ by switches (Llama, Mistral, Qwen2/2.5 with q/k/v
biases, Qwen3 with per-head q/k norms, Phi-3 with fused projections); Gemma 2 and 3 differ in
kind (scaled embeddings, (1 + w) norms around attention and the MLP, GeLU-tanh, soft-capping)
and have a module of their own (gemma.py). The mixture-of-experts families (Qwen3-MoE, Mixtral)
run the Llama attention with a routed MLP of their own (moe.py); their adapters carry LoRA on
the attention projections and on the experts, which PEFT (with transformers 5's fused expert
tensors) targets as parameters (`target_parameters`: gate_up_proj, down_proj). Inside the node every family's projections are the
same fused groups (model/llama.py FUSED_MODULES: q/k/v, o, gate/up, down), so the adapter
memory, the LoRA kernels and the graphs know no family.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

# The node's LoRA modules of one decoder layer (model/llama.py LORA_MODULES, which this module
# may not import: it is read by the config parser below it).
_LAYER_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_IDENTITY = {m: (m,) for m in _LAYER_MODULES}
_ATTENTION = {m: (m,) for m in _LAYER_MODULES[:4]}
# The experts' fused parameters PEFT targets on transformers 5's MoE blocks (lora_common/validation.py).
EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")
# Their adapter targets (as AdapterWeights.target_modules names them), and the MLP modules whose
# adapter memory (--lora-modules) holds each.
EXPERT_MODULES: dict[str, tuple[str, ...]] = {"experts.gate_up_proj": ("gate_proj", "up_proj"),
                                              "experts.down_proj": ("down_proj",)}
# LoRA modules outside the decoder layers, one per model (adapters/edge.py).
EDGE_MODULES = ("embed_tokens", "lm_head")


class UnsupportedModel(ValueError):
    """The checkpoint's architecture is not one this node serves (one line for the operator)."""


@dataclass(frozen=True)
class Family:
    name: str                      # registry key, as logs and errors show it
    model_types: tuple[str, ...]   # config.json model_type values
    architectures: tuple[str, ...]  # config.json architectures values
    decoder: str                   # "llama" (model/llama.py), "gemma" (model/gemma.py) or "moe" (model/moe.py)
    # PEFT target name -> the node's modules its LoRA B rows are split over, in order (a
    # fused projection's adapter is one A and a stacked B: each slice is an (A, B part) pair).
    adapter_modules: Mapping[str, tuple[str, ...]]
    # Checkpoint tensors of a fused group held as one matrix (its node modules' rows stacked).
    fused_weights: Mapping[str, str]  # node fused group -> "self_attn.qkv_proj" etc.
    # The experts' 3D parameters its adapters may target (PEFT target_parameters), and the
    # checkpoint's per-expert names of gate, up and down ("experts.{e}.<name>.weight" under
    # `expert_parent`).
    expert_parameters: tuple[str, ...] = ()
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    expert_parent: str = "mlp"

    def peft_targets(self) -> tuple[str, ...]:
        """The module names this family's adapters may target (an expert parameter as
        "experts.<parameter>", lora_common.validation's EXPERT_TARGETS)."""
        return tuple(self.adapter_modules) + EDGE_MODULES + tuple(f"experts.{p}" for p in self.expert_parameters)


_FAMILIES = (
    Family("llama", ("llama",), ("LlamaForCausalLM",), "llama", _IDENTITY, {}),
    Family("mistral", ("mistral",), ("MistralForCausalLM",), "llama", _IDENTITY, {}),
    Family("qwen2", ("qwen2",), ("Qwen2ForCausalLM",), "llama", _IDENTITY, {}),
    Family("qwen3", ("qwen3",), ("Qwen3ForCausalLM",), "llama", _IDENTITY, {}),
    Family("phi3", ("phi3",), ("Phi3ForCausalLM",), "llama",
           {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
            "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)},
           {"qkv": "self_attn.qkv_proj", "gate_up": "mlp.gate_up_proj"}),
    Family("gemma2", ("gemma2",), ("Gemma2ForCausalLM",), "gemma", _IDENTITY, {}),
    Family("gemma3", ("gemma3_text",), ("Gemma3ForCausalLM",), "gemma", _IDENTITY, {}),
    Family("qwen3_moe", ("qwen3_moe",), ("Qwen3MoeForCausalLM",), "moe", _ATTENTION, {},
           EXPERT_PARAMETERS),
    Family("mixtral", ("mixtral",), ("MixtralForCausalLM",), "moe", _ATTENTION, {},
           EXPERT_PARAMETERS, ("w1", "w3", "w2"), "block_sparse_moe"),
)
FAMILIES: dict[str, Family] = {f.name: f for f in _FAMILIES}
# Mixture-of-experts families not served (yet): refused by name.
_MOE_TYPES = frozenset({"qwen2_moe", "deepseek_v2", "deepseek_v3", "dbrx",
                        "phimoe", "olmoe", "jamba", "granitemoe", "llama4", "gpt_oss"})


def expert_target(target: str) -> str | None:
    """The expert parameter an adapter target names ("experts.gate_up_proj"), else None."""
    parameter = target.removeprefix("experts.")
    return parameter if parameter != target and parameter in EXPERT_PARAMETERS else None


def served() -> str:
    """What the node serves, as one phrase for a refusal."""
    return ", ".join(f"{f.name} ({'/'.join(f.architectures)})" for f in _FAMILIES)


def family_of(raw: Mapping[str, Any]) -> Family:
    """The family of a config.json's contents, or UnsupportedModel naming what is served."""
    architectures = raw.get("architectures") or []
    if isinstance(architectures, str):
        architectures = [architectures]
    for arch in architectures:
        for family in _FAMILIES:
            if arch in family.architectures:
                return family
    model_type = raw.get("model_type", "llama" if not architectures else None)
    for family in _FAMILIES:
        if model_type in family.model_types and not architectures:
            return family
    what = f"model_type {model_type!r}" + (f" ({', '.join(map(str, architectures))})" if architectures else "")
    kind = " (of the mixture-of-experts models it serves only qwen3_moe and mixtral)" if model_type in _MOE_TYPES else ""
    raise UnsupportedModel(f"{what} is not a model this node serves{kind}; it serves: {served()}")
