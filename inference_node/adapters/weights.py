"""An adapter's LoRA weights in host memory, checked against the base model's shapes."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from ..model.config import ModelConfig

LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_TENSOR_NAME = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\."
    r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.lora_([AB])(?:\.default)?\.weight$")


class AdapterIncompatible(ValueError):
    """The adapter does not fit this node's base model or limits (FAILED_PRECONDITION)."""


@dataclass
class AdapterWeights:
    name: str
    version: str
    rank: int
    scaling: float
    target_modules: tuple[str, ...]
    # (layer, module) -> (A [r, in], B [out, r]) on the host
    tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                   for a, b in self.tensors.values())


def lora_scaling(rank: int, alpha: float, use_rslora: bool) -> float:
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


def build_adapter_weights(name: str, version: str, rank: int, alpha: float, use_rslora: bool,
                          tensors: dict[str, torch.Tensor], model: ModelConfig,
                          max_rank: int) -> AdapterWeights:
    """Groups PEFT tensors by (layer, module) and checks every shape against the model."""
    if rank <= 0:
        raise AdapterIncompatible(f"adapter {name!r} has rank {rank}")
    if rank > max_rank:
        raise AdapterIncompatible(f"adapter {name!r} has rank {rank}; this node serves ranks up to "
                                  f"{max_rank} (--max-lora-rank)")
    shapes = model.module_shapes()
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for tensor_name, tensor in tensors.items():
        match = _TENSOR_NAME.match(tensor_name)
        if match is None:
            raise AdapterIncompatible(f"adapter {name!r}: tensor {tensor_name!r} is not a LoRA "
                                      "weight of a Llama projection")
        layer, module, which = int(match[1]), match[2], match[3]
        if layer >= model.num_layers:
            raise AdapterIncompatible(f"adapter {name!r}: layer {layer} but the base model has "
                                      f"{model.num_layers} layers")
        pairs.setdefault((layer, module), {})[which] = tensor
    result: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise AdapterIncompatible(f"adapter {name!r}: layer {layer} {module} lacks lora_"
                                      f"{({'A', 'B'} - set(pair)).pop()}")
        a, b = pair["A"], pair["B"]
        fan_in, fan_out = shapes[module]
        if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
            raise AdapterIncompatible(
                f"adapter {name!r}: layer {layer} {module} has A {tuple(a.shape)} and B "
                f"{tuple(b.shape)}; this base model needs A ({rank}, {fan_in}) and B ({fan_out}, {rank})")
        result[(layer, module)] = (a, b)
    if not result:
        raise AdapterIncompatible(f"adapter {name!r} has no LoRA weights")
    modules = tuple(m for m in LORA_MODULES if any(mod == m for _, mod in result))
    return AdapterWeights(name, version, rank, lora_scaling(rank, alpha, use_rslora), modules, result)
