"""Llama-family causal LM (Llama 2/3, SmolLM2, Qwen2, Mistral) over a paged KV cache.

The projections are fused (q/k/v into one matrix, gate/up into one) so one matmul and one
LoRA launch serve each group. LoRA enters through a `LoraApplier` that the engine builds
per step; when no scheduled token uses an adapter the applier is None and the base path
runs unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import os

import torch
import torch.nn.functional as F

from kernels.attention import paged_attention
from .checkpoint import CheckpointError, iter_tensors
from .config import ModelConfig
from .rope import RotaryEmbedding, rope_qk

# Fused groups of projections and the LoRA module names they hold, in column order.
FUSED_MODULES: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


class LoraApplier(Protocol):
    """Adds the LoRA deltas of one step's tokens into a fused projection's output."""

    def apply(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None: ...


@dataclass
class ForwardBatch:
    """One engine step, flattened over all scheduled sequences (built once per step)."""

    input_ids: torch.Tensor        # [T] int64
    positions: torch.Tensor        # [T] int64
    slot_mapping: torch.Tensor     # [T] int64: KV cache slot (block * block_size + offset)
    block_tables: torch.Tensor     # [B, max_blocks] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor         # [B] int32
    logits_indices: torch.Tensor   # [N] int64: rows whose logits are needed (sampling)
    max_query_len: int
    max_seq_len: int


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(hidden: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next norm, one kernel when compiled."""
    hidden = hidden + delta
    return hidden, rms_norm(hidden, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class ElementwiseOps:
    """The small per-layer ops between the matmuls. Eager, they are a few dozen kernel
    launches per layer; on CUDA they are compiled (torch.compile, dynamic shapes) into a few
    fused kernels, which CUDA graphs then replay. LORA_COMPILE=0 keeps them eager."""

    def __init__(self, device: torch.device) -> None:
        self.rms_norm, self.add_rms_norm, self.silu_mul, self.rope = rms_norm, add_rms_norm, silu_mul, rope_qk
        if device.type == "cuda" and os.environ.get("LORA_COMPILE", "1") != "0":
            def compiled(fn):
                return torch.compile(fn, dynamic=True, fullgraph=True)
            self.rms_norm, self.add_rms_norm = compiled(rms_norm), compiled(add_rms_norm)
            self.silu_mul, self.rope = compiled(silu_mul), compiled(rope_qk)


class LlamaModel:
    """Weights and forward pass; holds no per-request state (the KV cache is passed in)."""

    def __init__(self, config: ModelConfig, layers: list[LayerWeights], embed: torch.Tensor,
                 final_norm: torch.Tensor, lm_head: torch.Tensor, device: torch.device,
                 max_positions: int) -> None:
        self.config = config
        self.layers = layers
        self.embed = embed
        self.final_norm = final_norm
        self.lm_head = lm_head
        self.device = device
        self.dtype = embed.dtype
        self.rope = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta,
                                    config.rope_scaling, device)
        self.scale = config.head_dim ** -0.5
        self.ops = ElementwiseOps(device)

    @classmethod
    def load(cls, path: Path, device: torch.device, dtype: torch.dtype,
             max_positions: int | None = None) -> "LlamaModel":
        config = ModelConfig.from_checkpoint(path)
        tensors = {name.removeprefix("model."): t for name, t in iter_tensors(path)}

        def take(name: str) -> torch.Tensor:
            if name not in tensors:
                raise CheckpointError(f"checkpoint {path} lacks tensor {name!r}")
            return tensors.pop(name).to(device=device, dtype=dtype)

        def maybe(name: str) -> torch.Tensor | None:
            return take(name) if name in tensors else None

        layers = []
        for i in range(config.num_layers):
            p = f"layers.{i}."
            qkv_bias = None
            if config.attention_bias:
                qkv_bias = torch.cat([take(p + f"self_attn.{m}.bias") for m in FUSED_MODULES["qkv"]])
            layers.append(LayerWeights(
                input_norm=take(p + "input_layernorm.weight"),
                qkv=torch.cat([take(p + f"self_attn.{m}.weight") for m in FUSED_MODULES["qkv"]]),
                qkv_bias=qkv_bias,
                o=take(p + "self_attn.o_proj.weight"),
                post_norm=take(p + "post_attention_layernorm.weight"),
                gate_up=torch.cat([take(p + f"mlp.{m}.weight") for m in FUSED_MODULES["gate_up"]]),
                down=take(p + "mlp.down_proj.weight"),
            ))
        embed = take("embed_tokens.weight")
        lm_head = maybe("lm_head.weight")
        if lm_head is None:
            if not config.tie_word_embeddings:
                raise CheckpointError(f"checkpoint {path} has no lm_head.weight")
            lm_head = embed
        positions = max_positions or config.max_position_embeddings
        return cls(config, layers, embed, take("norm.weight"), lm_head, device, positions)

    def num_parameters(self) -> int:
        tensors = [self.embed, self.final_norm]
        if self.lm_head is not self.embed:
            tensors.append(self.lm_head)
        for layer in self.layers:
            tensors += [layer.input_norm, layer.qkv, layer.o, layer.post_norm, layer.gate_up, layer.down]
        return sum(t.numel() for t in tensors)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, k_caches: list[torch.Tensor],
                v_caches: list[torch.Tensor], lora: LoraApplier | None = None) -> torch.Tensor:
        """Runs all layers over the step's tokens; returns logits [N, vocab] (float32)."""
        cfg, ops = self.config, self.ops
        hidden = self.embed[batch.input_ids]
        x = ops.rms_norm(hidden, self.layers[0].input_norm, cfg.rms_norm_eps)
        for i, layer in enumerate(self.layers):
            qkv = F.linear(x, layer.qkv, layer.qkv_bias)
            if lora is not None:
                lora.apply(i, "qkv", x, qkv)
            q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
            q, k = ops.rope(q.view(-1, cfg.num_heads, cfg.head_dim), k.view(-1, cfg.num_kv_heads, cfg.head_dim),
                            self.rope.cos, self.rope.sin, batch.positions)
            v = v.view(-1, cfg.num_kv_heads, cfg.head_dim)
            k_cache, v_cache = k_caches[i], v_caches[i]
            k_cache.view(-1, cfg.num_kv_heads, cfg.head_dim).index_copy_(0, batch.slot_mapping, k)
            v_cache.view(-1, cfg.num_kv_heads, cfg.head_dim).index_copy_(0, batch.slot_mapping, v)
            attn = paged_attention(q, k_cache, v_cache, batch.block_tables, batch.query_start_loc,
                                   batch.seq_lens, self.scale, batch.max_query_len,
                                   batch.max_seq_len).reshape(-1, cfg.q_size)
            out = F.linear(attn, layer.o)
            if lora is not None:
                lora.apply(i, "o", attn, out)
            hidden, x = ops.add_rms_norm(hidden, out, layer.post_norm, cfg.rms_norm_eps)
            gate_up = F.linear(x, layer.gate_up)
            if lora is not None:
                lora.apply(i, "gate_up", x, gate_up)
            act = ops.silu_mul(gate_up)
            down = F.linear(act, layer.down)
            if lora is not None:
                lora.apply(i, "down", act, down)
            if i + 1 < len(self.layers):
                hidden, x = ops.add_rms_norm(hidden, down, self.layers[i + 1].input_norm, cfg.rms_norm_eps)
            else:
                hidden = hidden + down
        last = rms_norm(hidden[batch.logits_indices], self.final_norm, cfg.rms_norm_eps)
        return F.linear(last, self.lm_head).float()
