"""An adapter's LoRA weights in host memory, checked against the base model's shapes."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Collection, Iterable

import torch

from ..model.config import ModelConfig

LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


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
    load_seconds: float = 0.0  # fetch, validation and probe (AdapterManager's load-time metric)
    source_tier: str = "store"  # where the source found it: "disk" (a disk tier, a directory) or "store"

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                   for a, b in self.tensors.values())


def lora_scaling(rank: int, alpha: float, use_rslora: bool) -> float:
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


def never_servable(name: str, rank: int, targets: Iterable[str], max_rank: int,
                   modules: Collection[str] = LORA_MODULES) -> str | None:
    """Why this node can never serve an adapter of this rank and these target modules, from
    metadata alone (a catalog entry, a config), before any weight is read; None if it can.
    modules: those the node keeps adapter memory for (slots.held_modules)."""
    if rank > max_rank:
        return f"adapter {name!r} has rank {rank}; this node serves ranks up to {max_rank} (--max-lora-rank)"
    missing = [m for m in targets if m not in modules]
    if missing:
        return (f"adapter {name!r} targets {','.join(missing)}; this node keeps adapter memory for "
                f"{','.join(modules)} only (--lora-modules)")
    return None


def build_adapter_weights(name: str, version: str, rank: int, alpha: float, use_rslora: bool,
                          pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
                          model: ModelConfig, max_rank: int) -> AdapterWeights:
    """Checks every (layer, module) pair of A [r, in] and B [out, r] against the model."""
    if rank <= 0:
        raise AdapterIncompatible(f"adapter {name!r} has rank {rank}")
    refusal = never_servable(name, rank, (), max_rank)
    if refusal is not None:
        raise AdapterIncompatible(refusal)
    shapes = model.module_shapes()
    for (layer, module), (a, b) in pairs.items():
        if module not in shapes:
            raise AdapterIncompatible(f"adapter {name!r}: module {module} is not a Llama projection")
        if layer >= model.num_layers:
            raise AdapterIncompatible(f"adapter {name!r}: layer {layer} but the base model has "
                                      f"{model.num_layers} layers")
        fan_in, fan_out = shapes[module]
        if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
            raise AdapterIncompatible(
                f"adapter {name!r}: layer {layer} {module} has A {tuple(a.shape)} and B "
                f"{tuple(b.shape)}; this base model needs A ({rank}, {fan_in}) and B ({fan_out}, {rank})")
    if not pairs:
        raise AdapterIncompatible(f"adapter {name!r} has no LoRA weights")
    modules = tuple(m for m in LORA_MODULES if any(mod == m for _, mod in pairs))
    return AdapterWeights(name, version, rank, lora_scaling(rank, alpha, use_rslora), modules, dict(pairs))


def probe_in_dtype(weights: AdapterWeights, dtype: torch.dtype, max_weight_abs: float = 0.0) -> None:
    """The shared validation probes each module's LoRA update in float32; the node serves in
    `dtype`, whose range may be narrower (float16 overflows at 65504). Casts the weights as
    the GPU slots will, then takes the update's largest value for an input with entries at
    most 1 in magnitude (over |A| and |B|, so signs cannot hide it). Raises
    AdapterIncompatible when it is not finite.

    With the weights known to be at most `max_weight_abs` in magnitude (checked on load, or
    proven by sha256 to be bytes that were), a module whose worst case |scaling| * rank *
    in_features * max_weight_abs**2 is far inside the dtype's range cannot overflow, and its
    probe is skipped: in bfloat16 or float32 that is every module (1000**2 * 64 * 14336 is
    about 1e12, the range about 3e38), and the probe's casts and scans of every weight on the
    host were most of a disk-tier load. float16 is still probed."""
    limit = torch.finfo(dtype).max
    for (layer, module), (a, b) in sorted(weights.tensors.items()):
        rank, in_features = a.shape
        if 0 < max_weight_abs and abs(weights.scaling) * rank * in_features * max_weight_abs ** 2 < limit / 1024:
            continue
        a_cast, b_cast = a.to(dtype), b.to(dtype)
        if not (torch.isfinite(a_cast).all() and torch.isfinite(b_cast).all()):
            raise AdapterIncompatible(f"adapter {weights.name!r}: layer {layer} {module} has weights that "
                                      f"overflow {_dtype_name(dtype)}, the dtype this node serves in")
        inner = a_cast.abs().sum(dim=1, dtype=torch.float32).to(dtype)      # |A| @ 1, as the slots hold it
        update = (b_cast.abs().float() @ inner.float()).to(dtype) * weights.scaling
        if not torch.isfinite(inner).all() or not torch.isfinite(update).all():
            raise AdapterIncompatible(f"adapter {weights.name!r}: layer {layer} {module}: the LoRA update of "
                                      f"a unit input overflows {_dtype_name(dtype)}, the dtype this node serves in")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
