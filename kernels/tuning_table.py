"""Tuned launch choices kept as data: one JSON file per (device, model shape, dtype), holding
per decode batch bucket (and adapter-count bucket) the Tuning fields that differ from the
defaults, and what it was tuned with (torch and Triton versions, how long it took). The tuner
(inference_node/tuner) writes them from a sweep on the device: the seeds under
kernels/configs/, and the tables a node makes for itself in its cache directory; the node
picks the one whose key matches its GPU, its (shard's) shapes and its dtype, and each step
runs with its bucket's Tuning. kernels/configs/README.md documents the format.

Why per bucket: the decode GEMM's best tiling depends on the rows it multiplies (its
BLOCK_M, and how many programs a wave holds), and on the device; one frozen Tuning tuned at
batch 64 on one shape leaves the others to chance.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

if TYPE_CHECKING:
    import torch

from .tuning import (DEFAULT_TUNING, EXPERT_GROUPS, FP8_TILING_FIELDS, GROUPS, Tuning, attention_launch_valid,
                     fp8_choice_valid)

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
FORMAT = 2
DTYPES = ("bfloat16", "float16", "float32")
# The projections' weights a table's GEMMs multiply: the dtype's own ("none"), or FP8 widened to
# it (weight-only) or with e4m3 activations (W8A8): each runs other kernels, so its own table.
QUANTIZATIONS = ("none", "fp8", "fp8-w8a8")

# Choices that size buffers built once per node (the LoRA step plan's) or set the weights'
# layout (gemm_groups): a table may set them for the whole node ("node"), never per bucket.
NODE_CHOICES = frozenset({"gemm_groups", "fold_groups", "shrink_fold_groups", "fold_shrink_spread",
                          "side_expand_segments", "side_expand_group_segments",
                          "norm_split_columns", "norm_split_groups", "attention_decode_launches"})
CHOICES = tuple(f.name for f in dataclasses.fields(Tuning))
BUCKET_CHOICES = tuple(name for name in CHOICES if name not in NODE_CHOICES)
_TOP_KEYS = {"format", "device", "shape", "dtype", "quantization", "versions", "tuning_s", "unmeasured", "produced_by",
             "node", "buckets"}
VERSIONS = ("torch", "triton")  # the libraries whose code generation a table's timings depend on
_BUCKET_KEYS = {"batch", "adapters", "choices"}


class TuningTableError(ValueError):
    """A table file that cannot be used; the message names the file and what is wrong."""


@dataclass(frozen=True)
class ModelShape:
    """The shapes the decode GEMMs run at: a model's, or under tensor parallelism its
    shard's (heads, KV heads and MLP width divided; hidden size whole). A mixture of experts
    (experts > 0) has no dense MLP: `intermediate` is each expert's width, and its routed
    experts' grouped GEMMs are tuned beside q/k/v and o."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int = 0   # routed experts a layer (0: a dense model)
    top_k: int = 0     # experts a token is routed to

    @property
    def key(self) -> str:
        return (f"h{self.hidden}_i{self.intermediate}_q{self.heads}_kv{self.kv_heads}"
                f"_d{self.head_dim}" + (f"_e{self.experts}k{self.top_k}" if self.experts else ""))

    def gemms(self) -> dict[str, tuple[int, int]]:
        """(N, K) of each fused group's matmul, x [M, K] @ W [K, N] (a mixture of experts'
        MLP is its grouped GEMMs, not these)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = {"qkv": (q + 2 * kv, self.hidden), "o": (self.hidden, q)}
        if self.experts:
            return attention
        return attention | {"gate_up": (2 * self.intermediate, self.hidden), "down": (self.hidden, self.intermediate)}

    def to_json(self) -> dict[str, int]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v or k not in _OPTIONAL_SHAPE}

    @classmethod
    def of(cls, config: Any) -> "ModelShape":
        """From a model config with the Hugging Face-like fields of inference_node's
        ModelConfig (hidden_size, intermediate_size, num_heads, num_kv_heads, head_dim; a
        mixture of experts' num_experts, num_experts_per_tok, moe_intermediate_size)."""
        experts = getattr(config, "num_experts", 0)
        if experts:
            return cls(config.hidden_size, config.moe_intermediate_size, config.num_heads, config.num_kv_heads,
                       config.head_dim, experts, config.num_experts_per_tok)
        return cls(config.hidden_size, config.intermediate_size, config.num_heads,
                   config.num_kv_heads, config.head_dim)


_OPTIONAL_SHAPE = ("experts", "top_k")


def device_name(device: torch.device) -> str:
    """The name a table is filed under: the CUDA device's name, "cpu" elsewhere."""
    if device.type == "cuda":
        import torch  # here only: the node's command line reads tables without loading torch

        return torch.cuda.get_device_name(device)
    return device.type


def table_name(device: str, shape: ModelShape, dtype: str, quantization: str = "none") -> str:
    """The file name of (device, shape, dtype, quantization)'s table: e.g.
    NVIDIA_H100_80GB_HBM3__h2048_i8192_q32_kv8_d64__bfloat16.json, or
    ..._d128__bfloat16__fp8-w8a8.json over FP8 weights."""
    weights = "" if quantization == "none" else f"__{quantization}"
    return f"{re.sub(r'[^A-Za-z0-9]+', '_', device).strip('_')}__{shape.key}__{dtype}{weights}.json"


@dataclass(frozen=True)
class TableKey:
    """What a table is valid for: the device and the shapes its kernels run at, their dtype,
    and the torch and Triton versions that compile them (a new compiler can move the best
    tiling). The file name holds all but the versions, which the table records."""

    device: str
    shape: ModelShape
    dtype: str
    torch: str
    triton: str
    quantization: str = "none"

    @property
    def name(self) -> str:
        return table_name(self.device, self.shape, self.dtype, self.quantization)

    @property
    def versions(self) -> dict[str, str]:
        return {"torch": self.torch, "triton": self.triton}

    def __str__(self) -> str:
        return f"{self.device} {self.shape.key} {self.dtype}" + (
            f" {self.quantization}" if self.quantization != "none" else "")


# -- the choices as JSON ------------------------------------------------------------------------

def is_tiling_table(name: str) -> bool:
    """Whether choice `name` is a table of launch tuples per group (tilings, FP8 choices);
    attention_decode_launches is keyed by rows, not groups."""
    default = getattr(DEFAULT_TUNING, name)
    return (name != "attention_decode_launches" and isinstance(default, Mapping)
            and all(isinstance(v, tuple) for v in default.values()))


def choice_from_json(name: str, value: Any) -> Any:
    """The Tuning value of choice `name` written as JSON (choice_to_json's forms); ValueError
    saying what was expected otherwise. A tiling table's groups replace the defaults' entries
    of those groups."""
    default = getattr(DEFAULT_TUNING, name)
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
        raise ValueError(f"{name}: expected true or false, not {value!r}")
    if isinstance(default, int):
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
        raise ValueError(f"{name}: expected a non-negative integer, not {value!r}")
    if isinstance(default, frozenset):
        if isinstance(value, list) and all(v in GROUPS for v in value):
            return frozenset(value)
        raise ValueError(f"{name}: expected a list of groups of {list(GROUPS)}, not {value!r}")
    if isinstance(default, tuple):
        if (isinstance(value, list) and len(value) == len(default)
                and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
            return tuple(value)
        raise ValueError(f"{name}: expected {len(default)} positive integers, not {value!r}")
    if name == "attention_decode_launches":
        if not (isinstance(value, dict) and all(isinstance(v, list) and attention_launch_valid(r, tuple(v))
                                                for r, v in value.items())):
            raise ValueError(f"{name}: expected an object of rows -> [key tile (a power of two of at least "
                             f"256), warps (1-16, a power of two), stages (1-8)], each 0 for the rule's, "
                             f"not {value!r}")
        return MappingProxyType({r: tuple(v) for r, v in value.items()})
    if not isinstance(value, dict) or not set(value) <= set(GROUPS):
        raise ValueError(f"{name}: expected an object keyed by groups of {list(GROUPS)}, not {value!r}")
    if name in FP8_TILING_FIELDS:
        for group, choice in value.items():
            if not (isinstance(choice, list) and fp8_choice_valid(tuple(choice))):
                raise ValueError(f"{name}.{group}: expected [block_n, block_k, stages, splits], block_n and "
                                 f"block_k powers of two of at least 16, 1-8 stages, splits 0 (the rule) or "
                                 f"a power of two, not {choice!r}")
        return MappingProxyType({**default, **{g: tuple(t) for g, t in value.items()}})
    if is_tiling_table(name):
        for group, tiling in value.items():
            ints = (isinstance(tiling, list) and len(tiling) == 3
                    and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in tiling))
            if name == "moe_lora_launches":  # (one launch or two, columns a tile, warps)
                if not (ints and tiling[0] in (0, 1, 2) and tiling[1] >= 16 and tiling[1] & (tiling[1] - 1) == 0
                        and tiling[2] in (1, 2, 4, 8, 16)):
                    raise ValueError(f"{name}.{group}: expected [0, 1 or 2, columns a tile (a power of two "
                                     f"of at least 16), warps (1-16, a power of two)], not {tiling!r}")
            elif not (ints and all(v > 0 and v & (v - 1) == 0 for v in tiling[:2]) and tiling[2] > 0):
                raise ValueError(f"{name}.{group}: expected [block_n, block_k, stages], block_n "
                                 f"and block_k powers of two, not {tiling!r}")
        return MappingProxyType({**default, **{g: tuple(t) for g, t in value.items()}})
    for group, count in value.items():
        if not (isinstance(count, int) and not isinstance(count, bool) and count >= 0):
            raise ValueError(f"{name}.{group}: expected a non-negative integer, not {count!r}")
    return MappingProxyType(dict(value))


def choice_to_json(name: str, value: Any) -> Any:
    """`value` of choice `name` as choice_from_json reads it; a tiling table only with the
    groups whose entry differs from the default."""
    if isinstance(value, frozenset):
        return [g for g in GROUPS if g in value]
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, Mapping):
        default = getattr(DEFAULT_TUNING, name)
        if is_tiling_table(name):
            return {g: list(t) for g, t in value.items() if default.get(g) != t}
        return {k: list(v) if isinstance(v, tuple) else v for k, v in value.items()}
    return value


def changed_choices(tuning: Tuning, base: Tuning = DEFAULT_TUNING) -> dict[str, Any]:
    """The JSON of the choices where `tuning` differs from `base`."""
    return {name: choice_to_json(name, getattr(tuning, name)) for name in CHOICES
            if getattr(tuning, name) != getattr(base, name)}


# -- the table -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Bucket:
    """Steps of at most `batch` rows, down to the next smaller bucket's (the largest bucket:
    any step above it too), and at least `adapters` distinct adapters (up to the next adapter
    bucket), run with `choices` over the node's base tuning."""

    batch: int
    adapters: int
    choices: Mapping[str, Any]   # choice name -> Tuning value


@dataclass(frozen=True)
class TuningTable:
    device: str
    shape: ModelShape
    dtype: str
    node: Mapping[str, Any]          # choices for every step (Tuning values)
    buckets: tuple[Bucket, ...]      # sorted by (batch, adapters)
    produced_by: str = ""
    versions: Mapping[str, str] = dataclasses.field(default_factory=dict)  # torch and Triton it was tuned with ({}: not recorded)
    tuning_s: float | None = None    # seconds its sweep took (None: not recorded)
    unmeasured: tuple[tuple[str, int, int], ...] = ()  # (group, batch, adapters) the sweep's budget left
    path: Path | None = None         # where it was read from (messages)
    quantization: str = "none"       # the projections' weights (QUANTIZATIONS)

    def refusal(self, key: TableKey, check_versions: bool = True) -> str | None:
        """Why this table is not `key`'s (None: it is): another device, shape or dtype, or
        (check_versions) versions other than the key's or none recorded."""
        mine = (self.device, self.shape, self.dtype, self.quantization)
        if mine != (key.device, key.shape, key.dtype, key.quantization):
            weights = f" {self.quantization}" if self.quantization != "none" else ""
            return f"it is for {self.device} {self.shape.key} {self.dtype}{weights}, not {key}"
        if check_versions and dict(self.versions) != key.versions:
            tuned = ", ".join(f"{k} {v}" for k, v in self.versions.items()) or "unrecorded versions"
            return (f"it was tuned with {tuned}; this node runs "
                    + ", ".join(f"{k} {v}" for k, v in key.versions.items()))
        return None

    # -- reading and writing ----------------------------------------------------------------
    @classmethod
    def read(cls, path: Path) -> "TuningTable":
        """The table in `path`, validated; TuningTableError naming the file otherwise."""
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise TuningTableError(f"tuning table {path}: cannot be read: {exc}") from None
        try:
            return cls.from_json(raw, path)
        except ValueError as exc:
            raise TuningTableError(f"tuning table {path}: {exc}") from None

    @classmethod
    def from_json(cls, raw: Any, path: Path | None = None) -> "TuningTable":
        if not isinstance(raw, dict):
            raise ValueError("expected a JSON object")
        unknown = set(raw) - _TOP_KEYS
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)}: expected some of {sorted(_TOP_KEYS)}")
        if raw.get("format") != FORMAT:
            raise ValueError(f"format {raw.get('format')!r}: this node reads format {FORMAT}")
        if not isinstance(raw.get("device"), str):
            raise ValueError("device: expected the device's name (torch.cuda.get_device_name)")
        if raw.get("dtype") not in DTYPES:
            raise ValueError(f"dtype {raw.get('dtype')!r}: expected one of {', '.join(DTYPES)}")
        quantization = raw.get("quantization", "none")
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization {quantization!r}: expected one of {', '.join(QUANTIZATIONS)}")
        versions = raw.get("versions", {})
        if (not isinstance(versions, dict) or not set(versions) <= set(VERSIONS)
                or not all(isinstance(v, str) for v in versions.values())):
            raise ValueError(f"versions: expected an object of version strings of {list(VERSIONS)}, "
                             f"not {versions!r}")
        tuning_s = raw.get("tuning_s")
        if tuning_s is not None and (isinstance(tuning_s, bool) or not isinstance(tuning_s, (int, float))
                                     or tuning_s < 0):
            raise ValueError(f"tuning_s: expected a non-negative number of seconds, not {tuning_s!r}")
        unmeasured = raw.get("unmeasured", [])
        if not (isinstance(unmeasured, list) and all(
                isinstance(u, list) and len(u) == 3 and u[0] in GROUPS + EXPERT_GROUPS
                and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in u[1:])
                for u in unmeasured)):
            raise ValueError(f"unmeasured: expected [group, batch, adapters] entries, not {unmeasured!r}")
        fields = {f.name for f in dataclasses.fields(ModelShape)}
        required = fields - set(_OPTIONAL_SHAPE)
        shape = raw.get("shape")
        if (not isinstance(shape, dict) or not required <= set(shape) <= fields
                or not all(isinstance(v, int) and not isinstance(v, bool) and (v > 0 or k in _OPTIONAL_SHAPE and v == 0)
                           for k, v in shape.items())):
            raise ValueError(f"shape: expected positive integers {sorted(required)} (and a mixture of experts' "
                             f"{' and '.join(_OPTIONAL_SHAPE)}), not {shape!r}")
        node = _choices(raw.get("node", {}), "node", CHOICES)
        buckets_raw = raw.get("buckets", [])
        if not isinstance(buckets_raw, list):
            raise ValueError("buckets: expected a list")
        buckets, seen = [], set()
        for i, entry in enumerate(buckets_raw):
            where = f"buckets[{i}]"
            if not isinstance(entry, dict) or set(entry) - _BUCKET_KEYS or "batch" not in entry:
                raise ValueError(f"{where}: expected an object with batch, optional adapters, "
                                 f"and choices (keys {sorted(_BUCKET_KEYS)}), not {entry!r}")
            batch, adapters = entry["batch"], entry.get("adapters", 0)
            if not (isinstance(batch, int) and batch >= 1 and isinstance(adapters, int) and adapters >= 0):
                raise ValueError(f"{where}: batch must be a positive and adapters a non-negative integer")
            if (batch, adapters) in seen:
                raise ValueError(f"{where}: a second entry for batch {batch}, adapters {adapters}")
            seen.add((batch, adapters))
            choices = _choices(entry.get("choices", {}), f"{where} (batch {batch}, adapters "
                               f"{adapters})", BUCKET_CHOICES)
            buckets.append(Bucket(batch, adapters, choices))
        table = cls(raw["device"], ModelShape(**shape), raw["dtype"], node,
                    tuple(sorted(buckets, key=lambda b: (b.batch, b.adapters))),
                    str(raw.get("produced_by", "")), MappingProxyType(dict(versions)),
                    None if tuning_s is None else float(tuning_s),
                    tuple((g, b, a) for g, b, a in unmeasured), path, quantization)
        table.tunings(DEFAULT_TUNING)  # every entry builds a Tuning (group sets checked there)
        return table

    def to_json(self) -> dict[str, Any]:
        recorded = ({"versions": dict(self.versions)} if self.versions else {}) | (
            {"tuning_s": round(self.tuning_s, 1)} if self.tuning_s is not None else {}) | (
            {"unmeasured": [list(u) for u in self.unmeasured]} if self.unmeasured else {})
        return {
            "format": FORMAT, "device": self.device, "shape": self.shape.to_json(),
            "dtype": self.dtype, **({"quantization": self.quantization} if self.quantization != "none" else {}),
            **recorded, "produced_by": self.produced_by,
            "node": {n: choice_to_json(n, v) for n, v in self.node.items()},
            "buckets": [{"batch": b.batch, "adapters": b.adapters,
                         "choices": {n: choice_to_json(n, v) for n, v in b.choices.items()}}
                        for b in self.buckets],
        }

    def text(self) -> str:
        """The table as its file holds it."""
        text = json.dumps(self.to_json(), indent=1)
        # Short lists (a tiling, a group set) on one line each.
        text = re.sub(r"\[\s+([^\[\]{}]*?)\s+\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text)
        return text + "\n"

    def write(self, path: Path) -> None:
        """The table into `path`, whole or not at all: written beside it and renamed over it,
        so a node reading it while another writes it sees the old table or the new one."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(self.text())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    # -- use ------------------------------------------------------------------------------------
    def tunings(self, base: Tuning, fixed: Iterable[str] = ()) -> "StepTunings":
        """Each bucket's Tuning: `base` with the table's node-wide choices, then the bucket's,
        except the choices named in `fixed` (given on the node's command line), which keep
        base's values."""
        fixed = frozenset(fixed)
        where = f"tuning table {self.path}" if self.path else "tuning table"

        def build(choices: Mapping[str, Any], what: str) -> Tuning:
            try:
                return base.replace(**{n: v for n, v in choices.items() if n not in fixed})
            except ValueError as exc:
                raise TuningTableError(f"{where}: {what}: {exc}") from None

        node = build(self.node, "node")
        return StepTunings(node, tuple(
            (b.batch, b.adapters, build({**self.node, **b.choices}, f"batch {b.batch}, adapters {b.adapters}"))
            for b in self.buckets), self)


def _choices(raw: Any, where: str, allowed: tuple[str, ...]) -> Mapping[str, Any]:
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected an object of choices")
    unknown = set(raw) - set(CHOICES)
    if unknown:
        raise ValueError(f"{where}: unknown choices {sorted(unknown)}: expected some of "
                         f"{', '.join(allowed)}")
    node_only = set(raw) - set(allowed)
    if node_only:
        raise ValueError(f"{where}: {sorted(node_only)} size buffers built once per node or set "
                         f"the weights' layout: set them under \"node\", not per bucket")
    return MappingProxyType({name: choice_from_json(name, value) for name, value in raw.items()})


@dataclass(frozen=True)
class StepTunings:
    """The Tuning of each step: among the table's buckets of at most its distinct adapters,
    the one of the fewest rows at or above its own (else the most rows), then of the most
    adapters; `base` where none applies.

    Rows round up because a decode GEMM compiles for a row tile of the next power of two
    (kernels.gemm.shapes.row_tile): a bucket is timed at its own batch, and every step it
    serves runs that tile or a smaller one. Rounding down handed a 40-row graph the 32-row
    bucket's tilings, timed at a 32-row tile and run at a 64-row one (H200 replays, 8B,
    32 adapters at 40 rows: 7.111 ms against 6.590 taking the 64-row bucket's)."""

    base: Tuning
    entries: tuple[tuple[int, int, Tuning], ...] = ()   # (batch, adapters, tuning), sorted
    table: TuningTable | None = None

    def for_step(self, rows: int, adapters: int = 0) -> Tuning:
        fits = [(batch, count, tuning) for batch, count, tuning in self.entries if count <= adapters]
        if not fits:
            return self.base
        batches = {batch for batch, _, _ in fits}
        batch = min((b for b in batches if b >= rows), default=max(batches))
        return [tuning for b, _, tuning in fits if b == batch][-1]  # sorted: the most adapters last

    def map(self, change: Callable[[Tuning], Tuning]) -> "StepTunings":
        """Every step's Tuning (the base's and each bucket's) passed through `change`: a rule
        that holds whatever the table says (tensor parallelism's, parallel/shard.py)."""
        return StepTunings(change(self.base), tuple((b, a, change(t)) for b, a, t in self.entries), self.table)

    @classmethod
    def fixed(cls, tuning: Tuning) -> "StepTunings":
        """One tuning for every step (no table)."""
        return cls(tuning)


def find_table(device: str, shape: ModelShape, dtype: str, folder: Path | None = None,
               quantization: str = "none") -> Path | None:
    """The table filed for (device, shape, dtype, quantization) in `folder` (None:
    kernels/configs), if any."""
    path = (folder or CONFIG_DIR) / table_name(device, shape, dtype, quantization)
    return path if path.is_file() else None


def load_table(setting: str, shape: ModelShape) -> TuningTable | None:
    """The table a resolved `--tuning-table` names: "off" none, else the file at that path,
    which must be for `shape` (another device's or dtype's is taken: its numbers are then a
    starting point, not tuned here). "auto" is resolved to one of these before (the tuner's
    lookup: inference_node/tuner)."""
    if setting == "off":
        return None
    table = TuningTable.read(Path(setting))
    if table.shape != shape:
        raise TuningTableError(f"tuning table {setting} is for shape {table.shape.key}; this "
                               f"node's (shard's) shape is {shape.key}")
    return table
