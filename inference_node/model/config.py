"""Model hyper-parameters read from a Hugging Face `config.json`, for every family the node
serves (families.py): the shapes, and the switches that tell the families' decoders apart."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .families import FAMILIES, UnsupportedModel, family_of
from .quant import WeightQuant, checkpoint_quant

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
# Gated MLP activations: SiLU (SwiGLU) and GeLU's tanh approximation (Gemma's GeGLU).
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}
ROPE_TYPES = ("default", "linear", "llama3")  # model/rope.py


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool          # biases on q, k and v
    mlp_bias: bool                # biases on gate, up and down
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    family: str = "llama"         # families.FAMILIES key
    o_bias: bool = False          # a bias on o (Llama's attention_bias puts one there too)
    qk_norm: bool = False         # per-head RMSNorm of queries and keys before RoPE (Qwen3, Gemma 3)
    sliding_window: int = 0       # keys a windowed layer's query sees, itself included (0: none)
    # Per layer "full_attention" or "sliding_attention" (empty: every layer windowed when
    # sliding_window is set, else every layer full).
    layer_types: tuple[str, ...] = ()
    query_pre_attn_scalar: float = 0.0  # attention scale = this ** -0.5 (0: head_dim's)
    attn_logit_softcap: float = 0.0     # scores = cap * tanh(scores / cap) (0: none)
    final_logit_softcap: float = 0.0
    activation: str = "silu"            # the gated MLP's: "silu" or "gelu_tanh"
    # Windowed layers' RoPE where it is not the others' (Gemma 3's local base).
    sliding_rope_theta: float = 0.0
    sliding_rope_scaling: dict[str, Any] | None = None
    # Mixture of experts (families.py's "moe" decoder): experts per MoE layer, the experts
    # each token is routed to, each expert's intermediate width, whether the top-k routing
    # weights are renormalised to sum to 1, and the layers with a dense MLP instead
    # (Qwen3-MoE's mlp_only_layers / decoder_sparse_step), of intermediate_size.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    dense_layers: tuple[int, ...] = ()
    # The checkpoint's FP8 projections (quantization_config; model/quant.py), None: plain weights.
    weight_quant: WeightQuant | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_window(self, layer: int) -> int:
        """The sliding window of `layer` (0: it attends to the whole context)."""
        if not self.sliding_window:
            return 0
        if not self.layer_types or self.layer_types[layer] == SLIDING_ATTENTION:
            return self.sliding_window
        return 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether `layer`'s MLP is routed over experts."""
        return self.num_experts > 0 and layer not in self.dense_layers

    def expert_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each expert's fused projections, by the PEFT
        parameter name an adapter targets them with (gate and up stacked, as transformers)."""
        h, i = self.hidden_size, self.moe_intermediate_size
        return {"gate_up_proj": (h, 2 * i), "down_proj": (i, h)}

    @property
    def every_layer_windowed(self) -> bool:
        """Every layer forgets keys past its window: KV blocks behind it can be freed."""
        return all(self.layer_window(i) for i in range(self.num_layers))

    def module_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each LoRA-targetable projection of a layer."""
        h, i = self.hidden_size, self.intermediate_size
        return {
            "q_proj": (h, self.q_size), "k_proj": (h, self.kv_size), "v_proj": (h, self.kv_size),
            "o_proj": (self.q_size, h), "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
        }

    def edge_shapes(self) -> dict[str, tuple[int, int]]:
        """(A's in_features, B's out_features) of the LoRA modules outside the layers: the
        embedding's A is [r, vocab] and B [hidden, r]; the LM head's A [r, hidden], B [vocab, r]."""
        return {"embed_tokens": (self.vocab_size, self.hidden_size),
                "lm_head": (self.hidden_size, self.vocab_size)}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        """The config of a family this node serves; UnsupportedModel (one line naming what it
        serves) for any other, or for a switch of a served family that it does not implement."""
        family = family_of(raw)
        model_type = raw.get("model_type", family.model_types[0])
        gemma = FAMILIES[family.name].decoder == "gemma"
        rope_theta, rope_scaling = _rope(raw, FULL_ATTENTION if gemma else None, default_theta=10000.0)
        sliding_theta, sliding_scaling = 0.0, None
        if family.name == "gemma3":
            sliding_theta, sliding_scaling = _rope(raw, SLIDING_ATTENTION,
                                                   float(raw.get("rope_local_base_freq", 10000.0)))
        partial = float((raw.get("rope_parameters") or {}).get("partial_rotary_factor",
                                                               raw.get("partial_rotary_factor", 1.0)))
        if partial != 1.0:
            raise UnsupportedModel(f"{family.name}: partial rotary embeddings (partial_rotary_factor "
                                   f"{partial}) are not served")
        heads = int(raw["num_attention_heads"])
        layers = int(raw["num_hidden_layers"])
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        act_name = raw.get("hidden_activation") or raw.get("hidden_act") or ("gelu_pytorch_tanh" if gemma else "silu")
        if act_name not in ACTIVATIONS:
            raise UnsupportedModel(f"{family.name}: MLP activation {act_name!r} is not served "
                                   f"(served: {', '.join(ACTIVATIONS)})")
        window, layer_types = _windows(raw, family.name, layers)
        weight_quant = checkpoint_quant(raw, layers)
        # As transformers builds each family: Qwen2's q/k/v always carry biases (o never);
        # Llama's, Qwen3's and Gemma's attention_bias puts them on q, k, v and o; Mistral's and
        # Phi-3's attention has none; only Llama has MLP biases (mlp_bias).
        if family.name == "qwen2":
            qkv_bias, o_bias = True, False
        elif family.name in ("mistral", "phi3", "mixtral"):
            qkv_bias = o_bias = False
        else:
            qkv_bias = o_bias = bool(raw.get("attention_bias", False))
        mlp_bias = family.name == "llama" and bool(raw.get("mlp_bias", False))
        if gemma and raw.get("use_bidirectional_attention"):
            raise UnsupportedModel(f"{family.name}: bidirectional attention (an embedding model) is not served")
        moe = _experts(raw, family.name, layers) if family.decoder == "moe" else {}
        if moe and weight_quant is not None:
            raise UnsupportedModel(f"{family.name}: FP8 weights (quantization_config) of a mixture-of-experts "
                                   f"model are not served; serve its 16-bit checkpoint")
        return cls(
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", gemma)),
            attention_bias=qkv_bias,
            mlp_bias=mlp_bias,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            family=family.name,
            o_bias=o_bias,
            qk_norm=family.name in ("qwen3", "gemma3", "qwen3_moe"),
            sliding_window=window,
            layer_types=layer_types,
            query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar") or 0.0) if gemma else 0.0,
            attn_logit_softcap=float(raw.get("attn_logit_softcapping") or 0.0) if gemma else 0.0,
            final_logit_softcap=float(raw.get("final_logit_softcapping") or 0.0) if gemma else 0.0,
            activation=ACTIVATIONS[act_name],
            sliding_rope_theta=sliding_theta,
            sliding_rope_scaling=sliding_scaling,
            **moe,
            weight_quant=weight_quant,
        )

    @classmethod
    def from_checkpoint(cls, path: Path) -> "ModelConfig":
        raw = json.loads((path / "config.json").read_text())
        gen_path = path / "generation_config.json"
        if gen_path.exists():  # generation_config's eos list is the one chat models stop on
            gen_eos = json.loads(gen_path.read_text()).get("eos_token_id")
            if gen_eos is not None:
                raw = {**raw, "eos_token_id": gen_eos}
        return cls.from_dict(raw)


def _rope(raw: dict[str, Any], layer_type: str | None, default_theta: float) -> tuple[float, dict[str, Any] | None]:
    """(base, scaling or None) of RoPE, from transformers 5's rope_parameters (per layer type
    where a family has one per type) or the older rope_theta / rope_scaling."""
    params = dict(raw.get("rope_parameters") or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    elif layer_type is not None and any(isinstance(v, dict) for v in params.values()):
        params = {}
    if layer_type == SLIDING_ATTENTION and not params:
        return default_theta, None  # Gemma 3's local layers: rope_local_base_freq, unscaled
    theta = float(params.get("rope_theta", raw.get("rope_theta", default_theta)))
    scaling = raw.get("rope_scaling") if layer_type != SLIDING_ATTENTION else None
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = params
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModel(f"RoPE scaling {rope_type!r} is not served (served: {', '.join(ROPE_TYPES)})")
    return theta, scaling if rope_type != "default" else None


def _windows(raw: dict[str, Any], family: str, layers: int) -> tuple[int, tuple[str, ...]]:
    """(sliding window, per-layer types) as transformers builds them for the family."""
    window = raw.get("sliding_window")
    if family == "qwen3_moe" and raw.get("use_sliding_window", False):
        raise UnsupportedModel("qwen3_moe: use_sliding_window is not served")
    if family in ("llama", "qwen3_moe") or (family in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False)):
        window = None  # transformers' Llama has no window; Qwen's is off unless use_sliding_window
    if not window:
        return 0, ()
    if family in ("mistral", "phi3", "mixtral"):
        return int(window), ()  # every layer (transformers reads no layer_types for them)
    types = raw.get("layer_types")
    if types is None:
        if family in ("qwen2", "qwen3"):
            first = int(raw.get("max_window_layers", layers))
            types = [SLIDING_ATTENTION if i >= first else FULL_ATTENTION for i in range(layers)]
        elif family == "gemma2":
            types = [SLIDING_ATTENTION if (i + 1) % 2 else FULL_ATTENTION for i in range(layers)]
        else:  # gemma3
            pattern = int(raw.get("sliding_window_pattern", 6))
            types = [SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(layers)]
    types = tuple(types)
    if len(types) != layers or not set(types) <= {FULL_ATTENTION, SLIDING_ATTENTION}:
        raise UnsupportedModel(f"{family}: layer_types {list(types)[:8]} is not {layers} of "
                               f"{FULL_ATTENTION!r} / {SLIDING_ATTENTION!r}")
    if SLIDING_ATTENTION not in types:
        return 0, ()
    return int(window), types



def _experts(raw: dict[str, Any], family: str, layers: int) -> dict[str, Any]:
    """The MoE fields of ModelConfig, as transformers builds each family: Mixtral routes every
    layer, renormalises its top-k and its experts are intermediate_size wide; Qwen3-MoE's
    experts are moe_intermediate_size wide and its dense layers are mlp_only_layers and those
    decoder_sparse_step skips."""
    experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    top_k = int(raw.get("num_experts_per_tok") or 0)
    if experts <= 0 or not 0 < top_k <= experts:
        raise UnsupportedModel(f"{family}: {experts} experts with {top_k} per token is not a mixture of experts "
                               "this node serves")
    if family == "mixtral":
        return dict(num_experts=experts, num_experts_per_tok=top_k,
                    moe_intermediate_size=int(raw["intermediate_size"]), norm_topk_prob=True)
    if raw.get("shared_expert_intermediate_size"):
        raise UnsupportedModel(f"{family}: shared experts are not served")
    step = int(raw.get("decoder_sparse_step") or 1)
    only = set(raw.get("mlp_only_layers") or ())
    dense = tuple(i for i in range(layers) if i in only or (i + 1) % step)
    return dict(num_experts=experts, num_experts_per_tok=top_k,
                moe_intermediate_size=int(raw["moe_intermediate_size"]),
                norm_topk_prob=bool(raw.get("norm_topk_prob", False)), dense_layers=dense)
