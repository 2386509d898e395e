"""Gemma 2 and Gemma 3 (text): the Llama decoder's attention (windows on the layers
`layer_types` names, Gemma 2's soft-capped scores, `query_pre_attn_scalar`'s scale, Gemma 3's
q/k norms and its windowed layers' own RoPE base) inside Gemma's own layer:

    hidden = embed(tokens) * sqrt(hidden_size)            (the scale rounded to the dtype)
    per layer: hidden += post_attention_norm(attention(input_norm(hidden)))
               hidden += post_feedforward_norm(down(gelu_tanh(gate(x)) * up(x))),
                         x = pre_feedforward_norm(hidden)
    logits = cap * tanh(lm_head(norm(hidden)) / cap)      (tied embeddings; Gemma 2's cap)

Every norm scales by (1 + w), multiplied in float32 and rounded once (kernels/norm). A norm of
a sublayer's output and the residual add and norm after it are one op (`out_norm`), its LoRA
delta expanded first, as the Llama decoder's add + norm does.
"""
from __future__ import annotations

import torch

from kernels.rope import QKNorm

from .forward import ForwardBatch, LoraApplier
from .launch import LaunchChoices
from .llama import LlamaModel
from .rope import RotaryEmbedding


class GemmaModel(LlamaModel):
    """Gemma 2 / Gemma 3 text: weights and forward pass over the paged KV cache."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        cfg = self.config
        # transformers keeps sqrt(hidden) as a float32 buffer and casts it to the weights'
        # dtype before the multiply: in bfloat16 sqrt(3584) is 60.0, not 59.87.
        self.normalizer = torch.tensor(cfg.hidden_size ** 0.5, dtype=torch.float32).to(self.dtype).to(self.device)
        if cfg.sliding_rope_theta:  # Gemma 3: windowed layers rotate with a base of their own
            local = RotaryEmbedding(cfg.head_dim, self.rope.cos.shape[0], cfg.sliding_rope_theta,
                                    cfg.sliding_rope_scaling, self.device)
            self.layer_ropes = [local if cfg.layer_window(i) else self.rope for i in range(cfg.num_layers)]

    def qk_norm(self, i: int) -> QKNorm | None:
        layer = self.layers[i]
        if layer.q_norm is None:
            return None
        return QKNorm(layer.q_norm, layer.k_norm, self.config.rms_norm_eps, unit_offset=True)

    def embed_inputs(self, batch: ForwardBatch, launch: LaunchChoices, lora: LoraApplier | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self._embed(batch, lora, self.normalizer)
        return hidden, launch.ops.rms_norm(hidden, self.layers[0].input_norm, self.config.rms_norm_eps,
                                           unit_offset=True)

    def after_attention(self, i: int, attn: torch.Tensor, hidden: torch.Tensor, launch: LaunchChoices,
                        lora: LoraApplier | None) -> tuple[torch.Tensor, torch.Tensor]:
        cfg, layer = self.config, self.layers[i]
        hidden, x = self._add_norm(launch, *self._project(launch, lora, i, "o", attn, layer.o), hidden,
                                   layer.post_norm, unit_offset=True, out_norm=layer.attn_out_norm)
        gate_up, delta = self._project(launch, lora, i, "gate_up", x, layer.gate_up)
        act = launch.ops.silu_mul(gate_up, delta, activation=cfg.activation)
        last_layer = i + 1 == len(self.layers)
        norm = self.final_norm if last_layer else self.layers[i + 1].input_norm
        return self._add_norm(launch, *self._project(launch, lora, i, "down", act, layer.down), hidden, norm,
                              unit_offset=True, out_norm=layer.mlp_out_norm)
