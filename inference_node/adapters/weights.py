"""An adapter's LoRA weights in host memory, checked against the base model's shapes."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Collection, Iterable, Mapping

import torch

from ..model.config import ModelConfig
from ..model.families import EDGE_MODULES, EXPERT_MODULES, FAMILIES, Family, expert_target
from ..model.llama import LORA_MODULES

EDGE_LAYER = -1  # the layer key of an embed_tokens or lm_head pair in AdapterWeights.tensors


class AdapterIncompatible(ValueError):
    """The adapter does not fit this node's base model or limits (FAILED_PRECONDITION)."""


@dataclass
class AdapterWeights:
    name: str
    version: str
    rank: int
    scaling: float
    target_modules: tuple[str, ...]  # the node's modules (LORA_MODULES, EDGE_MODULES)
    # (layer, module) -> (A [r, in], B [out, r]) on the host; (EDGE_LAYER, embed_tokens or
    # lm_head) for the modules outside the layers
    tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    load_seconds: float = 0.0  # fetch, validation and probe (AdapterManager's load-time metric)
    source_tier: str = "store"  # where the source found it: "disk" (a disk tier, a directory) or "store"
    # (layer, expert parameter: "gate_up_proj" or "down_proj") -> (A [experts, r, in],
    # B [experts, out, r], scaling) on the host: the experts' LoRA of a mixture-of-experts
    # base model (its rank and scaling its own: PEFT doubles both for gate_up_proj).
    experts: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes of its weights (a fused projection's A counted once per module it feeds)."""
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                   for a, b, *_ in list(self.tensors.values()) + list(self.experts.values()))


def lora_scaling(rank: int, alpha: float, use_rslora: bool) -> float:
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


def never_servable(name: str, rank: int, targets: Iterable[str], max_rank: int,
                   modules: Collection[str] = LORA_MODULES + EDGE_MODULES,
                   family: Family = FAMILIES["llama"]) -> str | None:
    """Why this node can never serve an adapter of this rank and these target modules (PEFT's
    names, by the base model's family), from metadata alone (a catalog entry, a config),
    before any weight is read; None if it can. modules: those the node keeps adapter memory
    for (slots.held_modules)."""
    if rank > max_rank:
        return f"adapter {name!r} has rank {rank}; this node serves ranks up to {max_rank} (--max-lora-rank)"
    targets = list(targets)
    foreign = sorted({t for t in targets if t not in family.peft_targets()})
    if foreign:
        return (f"adapter {name!r} targets {', '.join(foreign)}, which this {family.name} base model does not "
                f"have: its adapters target {', '.join(family.peft_targets())}")
    held = dict.fromkeys(m for t in targets if expert_target(t) is None
                         for m in family.adapter_modules.get(t, (t,)))
    missing = [m for m in held if m not in modules]
    # An expert parameter's arena is held with the MLP modules that name it (experts.py).
    experts = [t for t in dict.fromkeys(targets) if expert_target(t) is not None
               and t not in modules and not set(EXPERT_MODULES[t]) & set(modules)]
    if missing or experts:
        hint = "; gate_proj,up_proj hold the experts' gate_up_proj, down_proj their down_proj" if experts else ""
        return (f"adapter {name!r} targets {','.join(missing + experts)}; this node keeps adapter memory for "
                f"{','.join(modules)} only (--lora-modules{hint})")
    return None


def build_adapter_weights(name: str, version: str, rank: int, alpha: float, use_rslora: bool,
                          pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
                          model: ModelConfig, max_rank: int,
                          expert_ranks: Mapping[str, int] = {},
                          expert_scalings: Mapping[str, float] = {}) -> AdapterWeights:
    """Checks every (layer, PEFT module) pair of A [r, in] and B [out, r] against the model's
    family and shapes, and maps it onto the node's modules: a fused projection's pair (Phi-3's
    qkv_proj, gate_up_proj) becomes one pair per module it holds, the same A with that
    module's rows of B, which is the fused LoRA's output column for column. An expert
    parameter's pair ("experts.gate_up_proj": PEFT's A [r x experts, in], B [out, r x
    experts]) becomes each expert's, of its own rank and scaling (expert_ranks,
    expert_scalings by parameter)."""
    if rank <= 0:
        raise AdapterIncompatible(f"adapter {name!r} has rank {rank}")
    family = FAMILIES[model.family]
    refusal = never_servable(name, rank, {m for _, m in pairs}, max_rank, family=family)
    if refusal is not None:
        raise AdapterIncompatible(refusal)
    experts = _expert_pairs(name, {k: v for k, v in pairs.items() if expert_target(k[1])}, model, max_rank,
                            expert_ranks, expert_scalings)
    pairs = {k: v for k, v in pairs.items() if not expert_target(k[1])}
    shapes, edges = model.module_shapes(), model.edge_shapes()
    mapped: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), (a, b) in pairs.items():
        if module in EDGE_MODULES:
            fan_in, fan_out = edges[module]
            targets: tuple[str, ...] = (module,)
            where = module
        else:
            if not 0 <= layer < model.num_layers:
                raise AdapterIncompatible(f"adapter {name!r}: layer {layer} but the base model has "
                                          f"{model.num_layers} layers")
            targets = family.adapter_modules[module]
            fan_in, fan_out = shapes[targets[0]][0], sum(shapes[m][1] for m in targets)
            where = f"layer {layer} {module}"
        if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
            raise AdapterIncompatible(
                f"adapter {name!r}: {where} has A {tuple(a.shape)} and B {tuple(b.shape)}; this base "
                f"model needs A ({rank}, {fan_in}) and B ({fan_out}, {rank})")
        if module in EDGE_MODULES:
            mapped[(EDGE_LAYER, module)] = (a, b)
            continue
        start = 0
        for m in targets:
            mapped[(layer, m)] = (a, b[start:start + shapes[m][1]])
            start += shapes[m][1]
    if not mapped and not experts:
        raise AdapterIncompatible(f"adapter {name!r} has no LoRA weights")
    held = {m for _, m in mapped}
    modules = tuple(m for m in LORA_MODULES + EDGE_MODULES if m in held)
    modules += tuple(dict.fromkeys(f"experts.{p}" for _, p in sorted(experts)))
    return AdapterWeights(name, version, rank, lora_scaling(rank, alpha, use_rslora), modules, mapped,
                          experts=experts)


def _expert_pairs(name: str, pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]], model: ModelConfig,
                  max_rank: int, ranks: Mapping[str, int], scalings: Mapping[str, float]
                  ) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]]:
    """Each MoE layer's expert pairs as A [experts, r, in] and B [experts, out, r] (views of
    PEFT's A [r x experts, in], expert-major rows, and B [out, r x experts], rank-major
    columns), checked against the model's experts."""
    out = {}
    shapes, num = model.expert_shapes(), model.num_experts
    for (layer, target), (a, b) in pairs.items():
        parameter = expert_target(target)
        if not (0 <= layer < model.num_layers and model.is_moe_layer(layer)):
            raise AdapterIncompatible(f"adapter {name!r}: layer {layer} {target}, but layer {layer} of the base "
                                      "model has no experts")
        r = ranks.get(parameter, 0)
        # gate_up_proj holds gate and up: PEFT gives it twice the rank of the other modules.
        limit = max_rank * (2 if parameter == "gate_up_proj" else 1)
        if not 0 < r <= limit:
            raise AdapterIncompatible(f"adapter {name!r} has rank {r} on the experts' {parameter}; this node "
                                      f"serves up to {limit} there (--max-lora-rank)")
        fan_in, fan_out = shapes[parameter]
        if tuple(a.shape) != (r * num, fan_in) or tuple(b.shape) != (fan_out, r * num):
            raise AdapterIncompatible(
                f"adapter {name!r}: layer {layer} {target} has A {tuple(a.shape)} and B {tuple(b.shape)}; this "
                f"base model's {num} experts need A ({r * num}, {fan_in}) and B ({fan_out}, {r * num})")
        out[(layer, parameter)] = (a.reshape(num, r, fan_in), b.reshape(fan_out, r, num).permute(2, 0, 1),
                                   scalings[parameter])
    return out


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
