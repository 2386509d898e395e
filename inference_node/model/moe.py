"""Mixture-of-experts decoders (Qwen3-MoE, Mixtral): the Llama decoder's attention and layer
structure with a routed MLP in its MoE layers:

    logits = x @ router^T                                  (in the weights' dtype)
    probs = softmax(logits in float32); top-k experts      (renormalised: Mixtral always,
                                                            Qwen3-MoE where norm_topk_prob)
    out = sum over the picks of weight * down_e(silu(gate_e(x)) * up_e(x))

as transformers computes it: Qwen3-MoE rounds the top-k weights to the logits' dtype before
they scale an expert's output, Mixtral keeps them in float32; each expert's rows are summed
into the output in expert order (index_add). Qwen3-MoE's dense layers (mlp_only_layers,
decoder_sparse_step) run the Llama MLP.

An adapter's expert LoRA (PEFT's target_parameters gate_up_proj / down_proj: per expert an
A [r, in] and a B [out, r]) is added beside each expert's matmul for the rows whose adapter
has it: x_e A_e^T B_e^T * scaling, exact as PEFT's merged weights are up to rounding
(`ExpertLoraApplier`, runner/lora/experts.py). On a GPU the routed experts run as fused
grouped GEMMs (kernels/moe/triton_kernel.py), whose routing a graph captures; with expert
LoRA, each (token, pick) pair's delta is added beside them from the adapters' arenas, read
by each token's slot on the device: no host sync, so decode graphs capture it (a variant of
their own, runner/decode_graphs.py EXPERTS). On a CPU, the reference (kernels/moe/reference.py:
a loop over the experts hit).
Under tensor parallelism every rank holds every expert's block of
intermediate columns (gate/up rows, down columns, like the dense MLP): its outputs are
partial sums that the layer's one all-reduce adds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kernels.gemm.fp8 import plain_rows
from kernels.lora import LoraDelta
from kernels.moe import PairLora, route, routed_experts

from ..parallel.shard import Shard
from .config import ModelConfig
from .families import Family
from .forward import LoraApplier
from .launch import LaunchChoices
from .llama import LlamaModel


@dataclass
class ExpertWeights:
    """One MoE layer's router and experts (this rank's intermediate columns of each)."""

    router: torch.Tensor   # [E, hidden], as the checkpoint's (F.linear's layout)
    gate_up: torch.Tensor  # [E, 2 * inter, hidden]: each expert's gate rows, then its up rows
    down: torch.Tensor     # [E, hidden, inter]

    def tensors(self) -> list[torch.Tensor]:
        return [self.router, self.gate_up, self.down]


class ExpertLora(Protocol):
    """The expert LoRA of one step's tokens (runner/lora/experts.py)."""

    def pairs(self, layer: int) -> tuple[PairLora | None, PairLora | None]:
        """Gate/up's and down's LoRA of layer `layer` for every (token, pick) pair, as the
        routed experts take it (None: no token of the step has that parameter's)."""


class MoeModel(LlamaModel):
    """Qwen3-MoE / Mixtral: weights and forward pass over the paged KV cache."""

    def __init__(self, *args: Any, experts: list[ExpertWeights | None], **kwargs: Any) -> None:
        """experts: each layer's router and experts (None: a dense layer, the Llama MLP)."""
        super().__init__(*args, **kwargs)
        self.experts = experts
        # Qwen3-MoE rounds its top-k weights to the model's dtype; Mixtral keeps float32.
        self.weights_in_model_dtype = self.config.family == "qwen3_moe"

    def num_parameters(self) -> int:
        return super().num_parameters() + sum(t.numel() for e in self.experts if e is not None
                                              for t in e.tensors())

    def weight_bytes(self) -> int:
        return super().weight_bytes() + sum(t.numel() * t.element_size() for e in self.experts if e is not None
                                            for t in e.tensors())

    def mlp(self, i: int, x: torch.Tensor, launch: LaunchChoices,
            lora: LoraApplier | None) -> tuple[torch.Tensor, LoraDelta | None, torch.Tensor | None]:
        layer = self.experts[i]
        if layer is None:
            return super().mlp(i, x, launch, lora)
        x = plain_rows(x)  # the router and the experts read 16-bit rows
        cfg = self.config
        weights, picks = route(x, layer.router, cfg.num_experts_per_tok, cfg.norm_topk_prob,
                               self.weights_in_model_dtype)
        expert_lora: ExpertLora | None = getattr(lora, "experts", None) if lora is not None else None
        pairs = expert_lora.pairs(i) if expert_lora is not None else (None, None)
        out = routed_experts(x, weights, picks, layer.gate_up, layer.down, launch.tuning.moe_tilings, pairs,
                             launch.tuning.moe_lora_launches)
        return out, None, None  # a partial sum under tensor parallelism, as the dense MLP's


# ---------------------------------------------------------------------------- checkpoint


def expert_checkpoint_shapes(config: ModelConfig, family: Family, layer: int) -> dict[str, tuple[int, ...]]:
    """The tensors of one MoE layer in a checkpoint's per-expert layout (names without
    "model."): what a dummy checkpoint makes up."""
    h, inter = config.hidden_size, config.moe_intermediate_size
    p = f"layers.{layer}.{family.expert_parent}."
    gate, up, down = family.expert_names
    shapes: dict[str, tuple[int, ...]] = {f"{p}gate.weight": (config.num_experts, h)}
    for e in range(config.num_experts):
        shapes[f"{p}experts.{e}.{gate}.weight"] = (inter, h)
        shapes[f"{p}experts.{e}.{up}.weight"] = (inter, h)
        shapes[f"{p}experts.{e}.{down}.weight"] = (h, inter)
    return shapes


def read_experts(reader: Any, family: Family, config: ModelConfig, shard: Shard, layer: int) -> ExpertWeights:
    """Layer `layer`'s router and this rank's block of every expert, from either layout a
    checkpoint may hold: per-expert matrices ("experts.{e}.gate_proj.weight", Mixtral's
    "block_sparse_moe.experts.{e}.w1.weight"), as released checkpoints are, or the 3D
    tensors transformers 5 holds in memory ("mlp.experts.gate_up_proj" [E, 2I, H],
    "mlp.experts.down_proj" [E, H, I])."""
    inter = config.moe_intermediate_size
    lo, hi = shard.block(inter)
    parents = [f"layers.{layer}.{family.expert_parent}.", f"layers.{layer}.mlp."]
    p = next((q for q in parents if reader.has(f"{q}gate.weight")), parents[0])
    router = reader.take(f"{p}gate.weight")
    fused = next((q for q in parents if reader.has(f"{q}experts.gate_up_proj")), None)
    if fused is not None:
        gate_up, down = reader.take(f"{fused}experts.gate_up_proj"), reader.take(f"{fused}experts.down_proj")
        if shard.size > 1:
            gate_up = torch.cat([gate_up[:, lo:hi], gate_up[:, inter + lo:inter + hi]], dim=1)
            down = down[:, :, lo:hi]
        return ExpertWeights(router, gate_up.contiguous(), down.contiguous())
    gate_name, up_name, down_name = family.expert_names
    rows = None if shard.size == 1 else (lo, hi)
    gate_ups, downs = [], []
    for e in range(config.num_experts):
        q = f"{p}experts.{e}."
        gate_ups.append(torch.cat([reader.take(f"{q}{gate_name}.weight", rows=rows),
                                   reader.take(f"{q}{up_name}.weight", rows=rows)]))
        downs.append(reader.take(f"{q}{down_name}.weight", cols=rows))
    return ExpertWeights(router, torch.stack(gate_ups), torch.stack(downs))
