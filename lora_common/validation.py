"""PEFT LoRA adapter checks, as pure functions over bytes: no I/O, no torch, never pickle.

The store runs them before it lists an adapter as valid; the inference node reuses them
on what it fetched and then compares `AdapterSpec.module_shapes()` with its base model.
Every refusal is an `AdapterInvalid` whose message is the reason a person reads.
"""
from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field
from typing import Any, Mapping, Union

import numpy as np

# Projections a Llama-family model can carry LoRA on, in canonical order, with their parent.
LORA_MODULES: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MODULE_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                 "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# Every projection of a decoder layer that a served family names (Phi-3 fuses q/k/v and
# gate/up), and the modules outside the layers: which of them fit a base model is the node's
# check (inference_node/model/families.py); the store knows no base model.
LAYER_PARENT = {**MODULE_PARENT, "qkv_proj": "self_attn", "gate_up_proj": "mlp"}
LAYER_MODULES: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "gate_proj", "up_proj",
                                  "gate_up_proj", "down_proj")
EDGE_MODULES: tuple[str, ...] = ("embed_tokens", "lm_head")
# The experts' 3D parameters of transformers 5's MoE blocks (Qwen3-MoE, Mixtral), which PEFT
# targets with target_parameters, in the order PEFT nests its wrappers of them: the first
# targeted is innermost ("experts.base_layer.lora_A" when both are), the last outermost
# ("experts.lora_A"). Each holds every expert's pair in one matrix: A [r x experts, in]
# (expert-major rows), B [out, r x experts] (rank-major columns).
EXPERT_PARAMETERS: tuple[str, ...] = ("gate_up_proj", "down_proj")
EXPERT_TARGETS: tuple[str, ...] = tuple(f"experts.{p}" for p in EXPERT_PARAMETERS)
TARGET_MODULES: tuple[str, ...] = LAYER_MODULES + EDGE_MODULES
EDGE_LAYER = -1  # the layer index of an embed_tokens or lm_head LoRA in AdapterSpec.modules
DEFAULT_MAX_CONFIG_BYTES = 1 << 20
DEFAULT_MAX_HEADER_BYTES = 16 << 20
DEFAULT_MAX_RANK = 4096
MAX_TENSORS = 100_000
# The largest |value| a LoRA weight may hold (--max-weight-abs on the store and the node; 0:
# no bound). Trained adapters hold values well under 1 (the samples: at most 0.15); values
# far above this make the forward overflow (a finite 1e30 still turns the logits into NaN).
DEFAULT_MAX_WEIGHT_ABS = 1000.0
# safetensors dtypes and their sizes; only the float ones are accepted as LoRA weights.
DTYPE_SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2,
               "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
# For each accepted dtype: the unsigned view, the mask of all bits but the sign, and Inf's
# magnitude bits. An IEEE float's magnitude bits order like its magnitude, so one integer max
# over them finds the largest value, and a max at or above Inf's bits means a NaN or an Inf.
_FLOAT_BITS = {"F16": (np.uint16, 0x7FFF, 0x7C00), "BF16": (np.uint16, 0x7FFF, 0x7F80),
               "F32": (np.uint32, 0x7FFFFFFF, 0x7F800000),
               "F64": (np.uint64, 0x7FFFFFFFFFFFFFFF, 0x7FF0000000000000)}
_TENSOR_NAME = re.compile(
    r"(?:base_model\.model\.)?(?:model\.)?layers\.(\d{1,6})\.(self_attn|mlp)\."
    r"(q_proj|k_proj|v_proj|qkv_proj|o_proj|gate_proj|up_proj|gate_up_proj|down_proj)"
    r"\.lora_([AB])(?:\.default)?\.weight")
# PEFT's embedding LoRA (A [r, vocab], B [hidden, r]: parameters, no ".weight") and the LM
# head's (a Linear's: A [r, hidden], B [vocab, r]).
_EDGE_TENSOR = re.compile(
    r"(?:base_model\.model\.)?(?:model\.)?(?:(embed_tokens)\.lora_embedding_([AB])(?:\.default)?"
    r"|(lm_head)\.lora_([AB])(?:\.default)?\.weight)")
_EXPERT_TENSOR = re.compile(
    r"(?:base_model\.model\.)?(?:model\.)?layers\.(\d{1,6})\.mlp\.experts((?:\.base_layer)*)"
    r"\.lora_([AB])(?:\.default)?\.weight")
# transformers 4's per-expert Linear modules (and PEFT's names for them then).
_PER_EXPERT_TENSOR = re.compile(r".*layers\.\d+\.(?:mlp|block_sparse_moe)\.experts\.\d+\..*lora_[AB].*")
_FINITE_CHUNK = 1 << 22  # elements checked at a time, to bound temporary memory

Buffer = Union[bytes, bytearray, memoryview, Any]  # anything with the buffer protocol (mmap too)


class AdapterInvalid(ValueError):
    """The adapter is refused; str(exc) is the human-readable reason."""

    @property
    def reason(self) -> str:
        return str(self)


@dataclass(frozen=True)
class LoraConfig:
    """The parts of a PEFT adapter_config.json that serving needs."""

    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]  # short names (q_proj, ...), canonical order
    base_model_name_or_path: str
    # True when target_modules was a regex: the weights then decide what is targeted.
    targets_from_pattern: bool = False
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    # The experts' parameters targeted (EXPERT_PARAMETERS, in that order), and the rank and
    # alpha of those PEFT's rank_pattern / alpha_pattern set apart from r and lora_alpha
    # (PEFT doubles both for gate_up_proj, which holds gate and up).
    target_parameters: tuple[str, ...] = ()
    expert_ranks: Mapping[str, int] = field(default_factory=dict)
    expert_alphas: Mapping[str, float] = field(default_factory=dict)

    @property
    def scaling(self) -> float:
        return self.lora_alpha / (self.r ** 0.5) if self.use_rslora else self.lora_alpha / self.r

    def expert_rank(self, parameter: str) -> int:
        """The rank of each expert's LoRA on an expert parameter."""
        return self.expert_ranks.get(parameter, self.r)

    def expert_scaling(self, parameter: str) -> float:
        rank, alpha = self.expert_rank(parameter), self.expert_alphas.get(parameter, self.lora_alpha)
        return alpha / (rank ** 0.5) if self.use_rslora else alpha / rank


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offsets within the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class SafetensorsHeader:
    header_bytes: int  # length of the JSON header
    data_offset: int   # 8 + header_bytes
    file_size: int
    tensors: Mapping[str, TensorInfo]
    metadata: Mapping[str, str]


@dataclass(frozen=True)
class ModuleSpec:
    """One LoRA pair: A is [rank, in_features], B is [out_features, rank]."""

    layer: int
    module: str
    in_features: int
    out_features: int
    rank: int
    dtype: str
    a: TensorInfo
    b: TensorInfo
    # An expert parameter's pair (EXPERT_TARGETS) holds this many experts' pairs, each of
    # `rank` (A [rank x experts, in], B [out, rank x experts]); 0 for any other module.
    experts: int = 0


@dataclass(frozen=True)
class AdapterSpec:
    """What a validated adapter holds, for checking against a base model."""

    config: LoraConfig
    modules: Mapping[tuple[int, str], ModuleSpec]
    target_modules: tuple[str, ...]  # modules that actually carry weights, canonical order
    num_layers: int                  # highest layer index + 1
    dtypes: tuple[str, ...]
    nbytes: int

    @property
    def rank(self) -> int:
        return self.config.r

    def module_shapes(self) -> dict[str, tuple[int, int]]:
        """module -> (in_features, out_features), the same for every layer."""
        return {m.module: (m.in_features, m.out_features) for m in self.modules.values()}


# ----------------------------------------------------------------------------- config


def parse_adapter_config(data: str | bytes | bytearray | Mapping[str, Any],
                         max_bytes: int = DEFAULT_MAX_CONFIG_BYTES,
                         max_rank: int = DEFAULT_MAX_RANK) -> LoraConfig:
    """Parses adapter_config.json; refuses what is not plain LoRA on supported projections."""
    if isinstance(data, Mapping):
        raw: Any = dict(data)
    else:
        if len(data) > max_bytes:
            raise AdapterInvalid(f"adapter_config.json is {len(data)} bytes; the limit is {max_bytes}")
        try:
            text = data.decode("utf-8") if isinstance(data, (bytes, bytearray)) else data
            raw = json.loads(text)
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise AdapterInvalid(f"adapter_config.json is not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise AdapterInvalid("adapter_config.json is not a JSON object")
    peft_type = raw.get("peft_type")
    if peft_type is None:
        raise AdapterInvalid("adapter_config.json has no peft_type (expected LORA)")
    if not isinstance(peft_type, str) or peft_type.upper() != "LORA":
        raise AdapterInvalid(f"peft_type {peft_type!r} is not supported (only LORA)")
    r = raw.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise AdapterInvalid(f"r must be a positive integer, not {r!r}")
    if r > max_rank:
        raise AdapterInvalid(f"r={r} exceeds the largest supported rank {max_rank}")
    alpha = raw.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not np.isfinite(alpha) or alpha <= 0:
        raise AdapterInvalid(f"lora_alpha must be a positive number, not {alpha!r}")
    use_rslora = raw.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise AdapterInvalid(f"use_rslora must be true or false, not {use_rslora!r}")
    _refuse_unsupported(raw)
    parameters = _expert_parameters(raw.get("target_parameters"))
    ranks, alphas = _expert_patterns(raw, parameters)
    if parameters and raw.get("target_modules") in (None, []):
        targets, from_pattern = (), False
    else:
        targets, from_pattern = _normalize_targets(raw.get("target_modules"))
    base = raw.get("base_model_name_or_path") or ""
    if not isinstance(base, str):
        raise AdapterInvalid(f"base_model_name_or_path must be a string, not {base!r}")
    return LoraConfig(r, float(alpha), use_rslora, targets, base, from_pattern, raw, parameters, ranks, alphas)


def _refuse_unsupported(raw: Mapping[str, Any]) -> None:
    if raw.get("use_dora"):
        raise AdapterInvalid("DoRA adapters (use_dora: true) are not supported")
    if raw.get("lora_bias"):
        raise AdapterInvalid("LoRA biases (lora_bias: true) are not supported")
    if raw.get("fan_in_fan_out"):
        raise AdapterInvalid("fan_in_fan_out adapters (Conv1D layouts) are not supported")
    for key in ("modules_to_save", "layer_replication", "trainable_token_indices"):
        if raw.get(key):
            raise AdapterInvalid(f"{key} is not supported (the adapter must hold only LoRA weights)")


def _expert_parameters(value: Any) -> tuple[str, ...]:
    """The experts' parameters of PEFT's target_parameters ("gate_up_proj",
    "mlp.experts.down_proj", ...), in EXPERT_PARAMETERS order; anything else is refused."""
    if not value:
        return ()
    if not isinstance(value, (list, tuple)):
        raise AdapterInvalid("target_parameters must be a list of parameter names")
    found = set()
    for item in value:
        leaf = item.rsplit(".", 1)[-1] if isinstance(item, str) else None
        container = item.rsplit(".", 1)[0] if isinstance(item, str) and "." in item else "experts"
        if leaf not in EXPERT_PARAMETERS or container.rsplit(".", 1)[-1] != "experts":
            raise AdapterInvalid(f"target parameter {str(item)[:200]!r} is not supported (supported: the "
                                 f"experts' {', '.join(EXPERT_PARAMETERS)})")
        found.add(leaf)
    return tuple(p for p in EXPERT_PARAMETERS if p in found)


def _expert_patterns(raw: Mapping[str, Any], parameters: tuple[str, ...]) -> tuple[dict[str, int], dict[str, float]]:
    """rank_pattern and alpha_pattern, which the node serves only where they name an expert
    parameter (PEFT's ".*\\.gate_up_proj"): one rank and alpha per module of the rest."""
    out: list[dict[str, Any]] = []
    for key in ("rank_pattern", "alpha_pattern"):
        pattern = raw.get(key) or {}
        if not isinstance(pattern, dict):
            raise AdapterInvalid(f"{key} must be an object")
        values: dict[str, Any] = {}
        for name, value in pattern.items():
            leaf = next((p for p in parameters if isinstance(name, str) and name.endswith(p)), None)
            if leaf is None:
                raise AdapterInvalid(f"per-module {key} entry {str(name)[:200]!r} is not supported (modules share "
                                     "r and lora_alpha; only the experts' parameters may have their own)")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or (
                    key == "rank_pattern" and not isinstance(value, int)):
                raise AdapterInvalid(f"{key}[{name[:200]!r}] must be a positive {'integer' if key == 'rank_pattern' else 'number'}")
            values[leaf] = value
        out.append(values)
    return out[0], {p: float(a) for p, a in out[1].items()}


def _normalize_targets(value: Any) -> tuple[tuple[str, ...], bool]:
    """Short module names. A regex is never evaluated (it is untrusted): the modules it
    names literally are the candidates and the weights decide."""
    if isinstance(value, str):
        if value == "all-linear":  # PEFT's: every linear layer but the LM head
            return LAYER_MODULES, True
        found = tuple(m for m in TARGET_MODULES if m in value)
        if not found:
            raise AdapterInvalid(f"target_modules pattern {value[:200]!r} names none of {', '.join(TARGET_MODULES)}")
        return found, True
    if not isinstance(value, (list, tuple)) or not value:
        raise AdapterInvalid("target_modules must be a non-empty list of module names")
    short: set[str] = set()
    for item in value:
        if not isinstance(item, str) or not item:
            raise AdapterInvalid(f"target_modules holds {item!r}, not a module name")
        leaf = item.rsplit(".", 1)[-1]
        if leaf not in TARGET_MODULES:
            raise AdapterInvalid(f"target module {item[:200]!r} is not supported "
                                 f"(supported: {', '.join(TARGET_MODULES)})")
        short.add(leaf)
    return tuple(m for m in TARGET_MODULES if m in short), False


# ------------------------------------------------------------------------- safetensors


def parse_safetensors_header(data: Buffer, file_size: int | None = None,
                             max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES) -> SafetensorsHeader:
    """Parses and bounds-checks a safetensors header.

    `data` is the file, or at least its first 8 + header bytes; `file_size` defaults to
    len(data). Offsets must tile the data region exactly, as the format requires.
    """
    with memoryview(data) as whole, whole.cast("B") as view:
        size = len(view) if file_size is None else file_size
        if size < 8 or len(view) < 8:
            raise AdapterInvalid(f"safetensors file is truncated: {size} bytes, shorter than its 8-byte header length")
        (n,) = struct.unpack("<Q", bytes(view[:8]))
        if n > max_header_bytes:
            raise AdapterInvalid(f"safetensors header length {n} exceeds the limit of {max_header_bytes} bytes")
        if 8 + n > size:
            raise AdapterInvalid(f"safetensors header length {n} is larger than the file ({size} bytes)")
        if len(view) < 8 + n:
            raise AdapterInvalid(f"safetensors header needs {8 + n} bytes but only {len(view)} were given")
        raw_header = bytes(view[8:8 + n])
    if not raw_header.lstrip().startswith(b"{"):
        raise AdapterInvalid("safetensors header is not JSON (it must be a JSON object)")
    try:
        header = json.loads(raw_header.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise AdapterInvalid(f"safetensors header is not JSON ({str(exc)[:200]})") from None
    if not isinstance(header, dict):
        raise AdapterInvalid("safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in metadata.items()):
        raise AdapterInvalid("safetensors __metadata__ must map strings to strings")
    if len(header) > MAX_TENSORS:
        raise AdapterInvalid(f"safetensors file lists {len(header)} tensors; the limit is {MAX_TENSORS}")
    data_offset = 8 + n
    tensors = {name: _tensor_info(name, entry, data_offset) for name, entry in header.items()}
    _check_tiling(tensors, data_offset, size)
    return SafetensorsHeader(n, data_offset, size, tensors, metadata)


def _tensor_info(name: str, entry: Any, data_offset: int) -> TensorInfo:
    shown = name[:200]
    if not isinstance(entry, dict):
        raise AdapterInvalid(f"tensor {shown!r}: header entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_SIZES:
        raise AdapterInvalid(f"tensor {shown!r}: unknown dtype {str(dtype)[:40]!r}")
    if (not isinstance(shape, list) or len(shape) > 8
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise AdapterInvalid(f"tensor {shown!r}: shape {str(shape)[:80]} is not a list of non-negative integers")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
            or offsets[0] > offsets[1]):
        raise AdapterInvalid(f"tensor {shown!r}: data_offsets {str(offsets)[:80]} are not [begin, end]")
    numel = 1
    for d in shape:
        numel *= d
    if numel * DTYPE_SIZES[dtype] != offsets[1] - offsets[0]:
        raise AdapterInvalid(f"tensor {shown!r}: shape {tuple(shape)} of {dtype} needs "
                             f"{numel * DTYPE_SIZES[dtype]} bytes but its offsets span {offsets[1] - offsets[0]}")
    return TensorInfo(name, dtype, tuple(shape), data_offset + offsets[0], data_offset + offsets[1])


def _check_tiling(tensors: Mapping[str, TensorInfo], data_offset: int, size: int) -> None:
    position = data_offset
    for info in sorted(tensors.values(), key=lambda t: (t.start, t.end)):
        if info.start != position:
            raise AdapterInvalid(f"tensor {info.name[:200]!r}: data starts at {info.start - data_offset}, "
                                 f"expected {position - data_offset} (overlap or hole)")
        position = info.end
    if position > size:
        raise AdapterInvalid(f"safetensors file is truncated: its tensors need {position} bytes, "
                             f"the file has {size}")
    if position < size:
        raise AdapterInvalid(f"safetensors file has {size - position} bytes after its last tensor")


# ----------------------------------------------------------------------------- weights


def validate_weights(config: LoraConfig, header: SafetensorsHeader, data: Buffer | None = None,
                     max_weight_abs: float = DEFAULT_MAX_WEIGHT_ABS) -> AdapterSpec:
    """Checks every tensor against the config; with `data` (the whole file) also the values:
    no NaN or Inf, none larger than max_weight_abs (0: no bound), and each module's LoRA
    path finite on a probe input (probe_lora_path)."""
    pairs: dict[tuple[int, str], dict[str, TensorInfo]] = {}
    for name, info in header.tensors.items():
        match = _TENSOR_NAME.fullmatch(name)
        expert = _EXPERT_TENSOR.fullmatch(name)
        if match is not None:
            layer, parent, module, which = int(match[1]), match[2], match[3], match[4]
            if LAYER_PARENT[module] != parent:
                raise AdapterInvalid(f"tensor {name!r}: {module} belongs under {LAYER_PARENT[module]}, not {parent}")
        elif expert is not None:
            layer, module, which = int(expert[1]), _expert_target(config, name, expert[2].count(".base_layer")), expert[3]
        else:
            edge = _EDGE_TENSOR.fullmatch(name)
            if edge is None:
                raise AdapterInvalid(_unexpected_tensor(name))
            layer, module, which = EDGE_LAYER, edge[1] or edge[3], edge[2] or edge[4]
        if info.dtype not in _FLOAT_BITS:
            raise AdapterInvalid(f"tensor {name!r} has dtype {info.dtype}; LoRA weights must be F16, BF16, F32 or F64")
        if len(info.shape) != 2 or 0 in info.shape:
            raise AdapterInvalid(f"tensor {name!r} has shape {info.shape}; LoRA weights are non-empty matrices")
        slot = pairs.setdefault((layer, module), {})
        if which in slot:
            raise AdapterInvalid(f"layer {layer} {module} has two lora_{which} tensors")
        slot[which] = info
    if not pairs:
        raise AdapterInvalid("the safetensors file holds no LoRA weights")
    modules: dict[tuple[int, str], ModuleSpec] = {}
    shapes: dict[str, tuple[int, int, int]] = {}
    num_experts: int | None = None
    for (layer, module), pair in sorted(pairs.items(), key=lambda kv: (kv[0][0], _ORDER.index(kv[0][1]))):
        missing = {"A", "B"} - set(pair)
        if missing:
            raise AdapterInvalid(f"layer {layer} {module} has no lora_{missing.pop()} weight")
        a, b = pair["A"], pair["B"]
        (rank_a, fan_in), (fan_out, rank_b) = a.shape, b.shape
        if rank_a != rank_b:
            raise AdapterInvalid(f"layer {layer} {module}: rank mismatch between lora_A {a.shape} "
                                 f"(r={rank_a}) and lora_B {b.shape} (r={rank_b})")
        experts = 0
        if module in EXPERT_TARGETS:
            rank = config.expert_rank(module.removeprefix("experts."))
            experts = rank_a // rank
            if rank_a % rank or (num_experts or experts) != experts:
                raise AdapterInvalid(f"layer {layer} {module}: lora_A {a.shape} is not {rank}-rank pairs of "
                                     f"{num_experts or 'some number of'} experts")
            num_experts, rank_a = experts, rank
        elif rank_a != config.r:
            raise AdapterInvalid(f"layer {layer} {module}: lora_A {a.shape} and lora_B {b.shape} have rank "
                                 f"{rank_a} but the config says r={config.r}")
        elif module not in config.target_modules:
            raise AdapterInvalid(f"layer {layer} {module} has weights but the config does not target "
                                 f"{module} (target_modules: {', '.join(config.target_modules)})")
        seen = shapes.setdefault(module, (fan_in, fan_out, layer))
        if seen[:2] != (fan_in, fan_out):
            raise AdapterInvalid(f"{module} is {seen[0]}->{seen[1]} in layer {seen[2]} but "
                                 f"{fan_in}->{fan_out} in layer {layer}")
        modules[(layer, module)] = ModuleSpec(layer, module, fan_in, fan_out, rank_a, a.dtype, a, b, experts)
    present = tuple(m for m in _ORDER if m in shapes)
    if not config.targets_from_pattern:
        absent = [m for m in config.target_modules + tuple(f"experts.{p}" for p in config.target_parameters)
                  if m not in shapes]
        if absent:
            raise AdapterInvalid(f"the config targets {', '.join(absent)} but the weights hold none for it")
    dtypes = tuple(sorted({t.dtype for t in header.tensors.values()}))
    nbytes = sum(t.nbytes for t in header.tensors.values())
    spec = AdapterSpec(config, modules, present, max(layer for layer, _ in modules) + 1, dtypes, nbytes)
    if data is not None:
        check_finite(header, data, max_weight_abs)
        probe_lora_path(spec, data, max_weight_abs)
    return spec


_ORDER = TARGET_MODULES + EXPERT_TARGETS  # the modules of an AdapterSpec, in its order


def _expert_target(config: LoraConfig, name: str, depth: int) -> str:
    """The expert parameter a PEFT wrapper `depth` levels inside the outermost one adapts."""
    index = len(config.target_parameters) - 1 - depth
    if index < 0:
        raise AdapterInvalid(f"tensor {name[:200]!r} adapts an expert parameter, but the config's target_parameters "
                             f"name {len(config.target_parameters)} of the experts' {', '.join(EXPERT_PARAMETERS)}")
    return f"experts.{config.target_parameters[index]}"


def _unexpected_tensor(name: str) -> str:
    shown = name[:200]
    if _PER_EXPERT_TENSOR.fullmatch(name):
        return (f"tensor {shown!r} is a LoRA of one expert's Linear (transformers 4's layout); the node serves "
                "expert LoRA as PEFT saves it over transformers 5's fused experts (target_parameters "
                "gate_up_proj / down_proj): load the adapter with PEFT >= 0.19 on transformers 5 and save it again")
    if "lora_magnitude_vector" in name:
        return f"tensor {shown!r} is a DoRA magnitude; DoRA adapters are not supported"
    if name.endswith("base_layer.weight") and any(m in name for m in EDGE_MODULES):
        return (f"tensor {shown!r} is a copy of the base model's weights (PEFT saves one with an embedding or "
                "LM head LoRA, save_embedding_layers); the node serves LoRA weights only: save the adapter "
                "with save_embedding_layers=False")
    if "lora_embedding" in name:
        return f"tensor {shown!r} is not an embedding LoRA of embed_tokens"
    if ".bias" in name:
        return f"tensor {shown!r} is a bias; LoRA biases are not supported"
    return (f"tensor {shown!r} is not a LoRA weight of a supported module (expected "
            f"base_model.model.model.layers.N.self_attn|mlp.<module>.lora_A|lora_B.weight, "
            f"base_model.model.model.embed_tokens.lora_embedding_A|B or base_model.model.lm_head.lora_A|B.weight)")


def check_finite(header: SafetensorsHeader, data: Buffer, max_abs: float = 0.0) -> None:
    """Refuses NaN or Inf in any float tensor, and with max_abs > 0 any value whose magnitude
    is above it: one integer pass over each tensor's magnitude bits, in chunks to bound
    temporary memory."""
    with memoryview(data) as whole, whole.cast("B") as view:
        if len(view) < header.file_size:
            raise AdapterInvalid(f"safetensors data is truncated: {len(view)} of {header.file_size} bytes")
        for info in header.tensors.values():
            largest = _largest_magnitude(view, info)
            if largest is None:
                raise AdapterInvalid(f"tensor {info.name[:200]!r} holds NaN or Inf values")
            if max_abs > 0 and largest > max_abs:
                raise AdapterInvalid(
                    f"tensor {info.name[:200]!r} holds a value of magnitude {largest:.3g}; LoRA weights "
                    f"above {max_abs:g} make the forward overflow (trained adapters stay well under 1); "
                    "the bound is --max-weight-abs")


def _largest_magnitude(view: memoryview, info: TensorInfo) -> float | None:
    """The largest magnitude in a float tensor (0.0 for others), None where it holds a NaN or Inf."""
    spec = _FLOAT_BITS.get(info.dtype)
    if spec is None:
        return 0.0
    utype, magnitude, inf_bits = spec
    itemsize = np.dtype(utype).itemsize
    count = info.nbytes // itemsize
    largest = 0
    scratch = np.empty(min(_FINITE_CHUNK, count), dtype=utype)
    for first in range(0, count, _FINITE_CHUNK):
        n = min(_FINITE_CHUNK, count - first)
        values = np.frombuffer(view, dtype=utype, count=n, offset=info.start + first * itemsize)
        largest = max(largest, int(np.bitwise_and(values, utype(magnitude), out=scratch[:n]).max()))
        del values  # the buffer must be free again when the caller's memoryview closes
        if largest >= inf_bits:
            return None
    if info.dtype == "BF16":
        return float(np.array([largest << 16], dtype=np.uint32).view(np.float32)[0])
    native = {"F16": np.float16, "F32": np.float32, "F64": np.float64}[info.dtype]
    return float(np.array([largest], dtype=utype).view(native)[0])


def _as_float(view: memoryview, info: TensorInfo) -> np.ndarray:
    """A float tensor as a new float32/float64 array (BF16 widened exactly through its bit pattern)."""
    itemsize = DTYPE_SIZES[info.dtype]
    count = info.nbytes // itemsize
    if info.dtype == "BF16":
        raw = np.frombuffer(view, dtype=np.uint16, count=count, offset=info.start)
        return (raw.astype(np.uint32) << 16).view(np.float32)
    native = {"F16": np.float16, "F32": np.float32, "F64": np.float64}[info.dtype]
    raw = np.frombuffer(view, dtype=native, count=count, offset=info.start)
    return raw.astype(np.float64 if info.dtype == "F64" else np.float32)


def probe_lora_path(spec: AdapterSpec, data: Buffer, max_weight_abs: float = 0.0) -> None:
    """Each module's LoRA update, scaling * B @ (A @ x), at its largest over inputs whose
    entries are at most 1 in magnitude (the scale the base model's norms give), must be
    finite in float32, the widest dtype a node serves in (bfloat16 has its range): weights
    that are finite one by one can still overflow together. Taken over |A| and |B|, so
    weights of opposite signs cannot hide an overflow. Nodes probe again in their own dtype.

    With every weight known to be at most max_weight_abs (> 0) in magnitude, a module whose
    worst case |scaling| * rank * in_features * max_weight_abs**2 is far inside float32's
    range cannot overflow and is not probed (with the default bound, every module of a
    usual scaling): its casts and matmuls were most of a validation's time."""
    limit = float(np.finfo(np.float32).max) / 1024
    with memoryview(data) as whole, whole.cast("B") as view:
        for (layer, module), m in spec.modules.items():
            # An expert parameter's pairs are probed together: a bound of each expert's.
            scaling = np.float32(spec.config.expert_scaling(module.removeprefix("experts."))
                                 if m.experts else spec.config.scaling)
            rank, in_features = m.a.shape
            if 0 < max_weight_abs and abs(float(scaling)) * rank * in_features * max_weight_abs ** 2 < limit:
                continue
            a = np.abs(_as_float(view, m.a).astype(np.float32)).reshape(m.a.shape)
            b = np.abs(_as_float(view, m.b).astype(np.float32)).reshape(m.b.shape)
            with np.errstate(over="ignore", invalid="ignore"):
                largest = float((b @ a.sum(axis=1, dtype=np.float32)).max() * scaling)
            if not np.isfinite(largest):
                raise AdapterInvalid(f"layer {layer} {module}: the LoRA update of a unit input overflows "
                                     "float32 (the weights are too large to serve)")


def validate_adapter(config_json: str | bytes | bytearray, weights: Buffer,
                     max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
                     max_config_bytes: int = DEFAULT_MAX_CONFIG_BYTES,
                     max_rank: int = DEFAULT_MAX_RANK, check_values: bool = True,
                     max_weight_abs: float = DEFAULT_MAX_WEIGHT_ABS) -> AdapterSpec:
    """The whole check: config, safetensors header, names and shapes, and (by default) values."""
    config = parse_adapter_config(config_json, max_config_bytes, max_rank)
    header = parse_safetensors_header(weights, max_header_bytes=max_header_bytes)
    return validate_weights(config, header, weights if check_values else None, max_weight_abs)
