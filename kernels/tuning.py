"""The decode step's tuning: every launch choice of the kernels and of the LoRA step plan, in
one frozen object that the node builds once (from `inference-node serve`'s flags) and passes
down. Kernels read nothing from the environment; a benchmark sweeps a choice by building
another Tuning (dataclasses.replace).

The defaults are the fastest measured on an H100 at decode batch 64 with Llama-3.2-1B's
shapes (docs/PERFORMANCE.md says how, and what else was tried). Shapes a group's tiling does
not divide, and devices without a feature (PDL and TMA need Hopper and compiled CUDA), fall
back by themselves, so the defaults are safe anywhere.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Collection, Mapping

if TYPE_CHECKING:
    import torch

# The fused projection groups (the model's q/k/v, o, gate/up and down matmuls), in order.
GROUPS: tuple[str, ...] = ("qkv", "o", "gate_up", "down")
# The routed experts' grouped GEMMs (Tuning.moe_tilings' keys), as the tuner's cases name them.
EXPERT_GROUPS: tuple[str, ...] = ("experts.gate_up", "experts.down")

Tiling = tuple[int, int, int]  # (block_n, block_k, pipeline stages) of the decode GEMM
Fp8Choice = tuple[int, int, int, int]  # the FP8 decode GEMM's: and its K splits (0: its rule)
# The Tuning tables of the FP8 decode GEMM's launches: weight-only and W8A8 (fp8_tilings_field).
FP8_TILING_FIELDS = ("fp8_tilings", "w8a8_tilings")


def _frozen(mapping: Mapping[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(dict(mapping))


def _plain(value: Any) -> Any:
    return dict(value) if isinstance(value, MappingProxyType) else value


def _rebuild(cls: type, fields: dict[str, Any]) -> Any:
    return cls(**fields)


def _power_of_two(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def attention_launch_valid(rows: Any, launch: Any) -> bool:
    """Whether rows -> launch is an entry of Tuning.attention_decode_launches: a row count
    (its decimal text) and (key tile elements, warps, stages), each 0 for the rule's."""
    return (isinstance(rows, str) and rows.isdigit() and int(rows) > 0 and isinstance(launch, tuple)
            and len(launch) == 3 and all(isinstance(v, int) and not isinstance(v, bool) for v in launch)
            and (launch[0] == 0 or _power_of_two(launch[0]) and launch[0] >= 256)
            and launch[1] in (0, 1, 2, 4, 8, 16) and 0 <= launch[2] <= 8)


def fp8_choice_valid(choice: Any) -> bool:
    """Whether `choice` is an FP8 decode launch: (block_n, block_k, stages, splits) with block_n
    and block_k powers of two of at least 16, 1-8 stages, splits 0 or a power of two."""
    return (isinstance(choice, tuple) and len(choice) == 4
            and all(isinstance(v, int) and not isinstance(v, bool) for v in choice)
            and all(_power_of_two(v) and v >= 16 for v in choice[:2])
            and 1 <= choice[2] <= 8 and (choice[3] == 0 or _power_of_two(choice[3])))


@dataclass(frozen=True)
class Tuning:
    """Launch choices of the decode step. Group sets name fused groups (GROUPS)."""

    # -- launch features (Hopper, compiled CUDA; elsewhere off whatever they say) --
    pdl: bool = field(default=True, metadata={"help": (
        "programmatic dependent launch: each decode kernel lets the next launch at its start "
        "and waits for the one ahead before reading its output")})
    attention_early_kv: bool = field(default=True, metadata={"help": (
        "with PDL, paged attention reads its first tile's older keys before its wait")})
    attention_decode_key_tile: int = field(default=4096, metadata={"help": (
        "keys times head dims of a decode program's key tile in paged attention, a power of "
        "two: 64 keys of 64-wide heads, 32 of 128-wide ones")})
    attention_decode_launches: Mapping[str, tuple[int, int, int]] = field(
        default_factory=dict, metadata={"help": (
            "decode attention's launch by the step's rows: ROWS=TILE.WARPS.STAGES, each for steps "
            "of at most ROWS rows down to the next smaller entry's (the largest: any step above "
            "it); TILE keys times head dims of a key tile; each 0 for the rule's launch "
            "(attention_decode_key_tile, the rule's warps, Triton's stages); the tuner writes "
            "them")})
    expand_early_b: bool = field(default=True, metadata={"help": (
        "with PDL, the ops that expand a LoRA delta (RoPE + KV write, SiLU) read their rows' "
        "B before their wait")})
    gemm_tma: bool = field(default=True, metadata={"help": (
        "the decode GEMM fetches its tiles with the tensor memory accelerator")})
    # -- the decode GEMM (kernels/gemm) --
    gemm_groups: frozenset[str] = field(default=frozenset(GROUPS), metadata={"help": (
        "projections whose decode-shaped matmuls run the Triton decode GEMM (the others, and "
        "every prefill matmul, run cuBLAS)")})
    gemm_prefetch_k: int = field(default=512, metadata={"help": (
        "with PDL, columns of its weight slab each decode GEMM program asks of L2 before its "
        "wait")})
    gemm_early_trigger: bool = field(default=True, metadata={"help": (
        "with PDL, the decode GEMM lets the next kernel launch once every program has its "
        "input rows, not after its main loop")})
    gemm_tilings: Mapping[str, Tiling] = field(default_factory=lambda: _frozen({
        "qkv": (32, 256, 4), "o": (16, 256, 4), "down": (16, 256, 4), "gate_up": (32, 128, 4)}),
        metadata={"help": "the decode GEMM's (block_n, block_k, stages) per group, pointer loads"})
    gemm_tma_tilings: Mapping[str, Tiling] = field(default_factory=lambda: _frozen({
        "qkv": (32, 256, 4), "o": (16, 256, 4), "down": (16, 128, 8), "gate_up": (32, 128, 4)}),
        metadata={"help": "the decode GEMM's (block_n, block_k, stages) per group, TMA loads"})
    gemm_split_k: Mapping[str, int] = field(default_factory=lambda: _frozen({"o": 1, "down": 1}),
                                            metadata={"help": (
        "K splits of each decode GEMM tile of o or down, whose float32 partials the add + norm "
        "after it sums: wider tiles for as many programs read x fewer times from L2 (1: none)")})
    # At most 96 KB of pipeline a program, so that the shrink programs a fold adds do not
    # push its tiles into another wave (gate/up's 256 tiles then share one wave with them).
    fold_tilings: Mapping[str, Tiling] = field(default_factory=lambda: _frozen({
        "qkv": (32, 128, 4), "o": (16, 128, 4), "down": (16, 128, 4), "gate_up": (64, 128, 2)}),
        metadata={"help": "the decode GEMM's (block_n, block_k, stages) per group with LoRA "
                          "folded in"})
    # -- the routed experts' grouped GEMMs (kernels/moe), in mixture-of-experts layers --
    # (Qwen3-30B-A3B's widths at 64 rows on an H200, tuner.moe_experts: 543 -> 363 us a layer
    # against (64, 32, 3) for both.)
    moe_tilings: Mapping[str, Tiling] = field(default_factory=lambda: _frozen({
        "gate_up": (32, 128, 4), "down": (128, 128, 3)}), metadata={"help": (
            "the routed experts' grouped GEMMs' (block_n, block_k, stages) for gate/up and down "
            "(block_n: columns of gate and of up each, for gate/up)")})
    # (64 rows of Qwen3-30B-A3B, 8 adapters, on an H200, tuner.moe_experts --lora 8: gate/up
    # 60.6 us in one launch against 73.0 in two at (128, 4 warps); down 36.6 against 60.3.)
    moe_lora_launches: Mapping[str, Tiling] = field(default_factory=lambda: _frozen({
        "gate_up": (2, 256, 2), "down": (0, 256, 2)}), metadata={"help": (
            "each (token, expert) pair's LoRA beside the grouped GEMMs, for gate/up and down: "
            "(1 for a shrink and expand in one launch, 0 for two, 2 for one where the pairs "
            "give every SM two programs; columns a tile; warps)")})
    # -- the FP8 decode GEMM (kernels/gemm/fp8.py), over FP8 projections' weights --
    # (8B widths at 64 rows on an H200, tuner.fp8_gemm --sweep and graphs of each GEMM with the
    # kernel reading its output: weight-only fastest in 64 columns by 128 of K; W8A8's gate/up
    # in 128 columns, its q/k/v, o and down in 64 by 256-wide K steps, 3 stages.)
    fp8_tilings: Mapping[str, Fp8Choice] = field(default_factory=lambda: _frozen({
        g: (64, 128, 4, 0) for g in GROUPS}), metadata={"help": (
            "the weight-only FP8 decode GEMM's (block_n, block_k, stages, K splits) per group (0 "
            "splits: enough to give every SM a program)")})
    w8a8_tilings: Mapping[str, Fp8Choice] = field(default_factory=lambda: _frozen({
        "qkv": (64, 256, 3, 0), "o": (64, 256, 3, 0), "down": (64, 256, 3, 0), "gate_up": (128, 128, 4, 0)}),
        metadata={"help": (
            "the W8A8 FP8 decode GEMM's (block_n, block_k, stages, K splits) per group (0 splits: the "
            "fewest giving 0.7 of the SMs a program, each at most 4096 columns of K)")})
    fold_prefetch_a: int = field(default=2048, metadata={"help": (
        "with PDL, columns of each adapter's A the shrink programs of a whole fold ask of L2 "
        "before their wait (0: none)")})
    # -- the LoRA step plan (inference_node/runner/lora) --
    fold_groups: frozenset[str] = field(default=frozenset({"o"}), metadata={"help": (
        "groups whose LoRA their decode GEMM adds in the same launch (in steps of many "
        "adapters, those also in shrink_fold_groups only shrink there)")})
    shrink_fold_groups: frozenset[str] = field(
        default=frozenset({"qkv", "gate_up", "o"}), metadata={"help": (
            "groups whose decode GEMM computes their LoRA shrink while the op after it "
            "expands")})
    fold_shrink_spread: frozenset[str] = field(default=frozenset(), metadata={"help": (
        "of the groups whose decode GEMM only shrinks, those whose tile programs compute the "
        "shrink in units of (adapter, slice, K range) before their weight stream, rather than "
        "programs of their own over the whole K")})
    # (H200, 8B, 64 rows, tuner.profile replays, extra over base. W8A8 c32 / c64: side-stream
    # shrinks +1.356 / +1.833 ms; gate/up's in its GEMM +1.171 / +1.788; q/k/v's and o's too
    # +1.540 / +2.072, q/k/v's and o's alone +1.715 / +2.106: their GEMMs, a wave or less of
    # tiles, end later by the shrink programs than the side stream's shrinks do. Weight-only
    # c32: +1.258 -> +0.868, with o's +0.989, q/k/v's too +1.329. Past 64 rows not measured.)
    fp8_shrink_fold_groups: frozenset[str] = field(default=frozenset({"gate_up"}), metadata={"help": (
        "over FP8 projections, the groups whose FP8 decode GEMM computes their LoRA shrink in "
        "programs of its own launch while the op after it expands (the others shrink on the "
        "side stream); no FP8 GEMM adds a whole LoRA delta")})
    side_expand_segments: int = field(default=8, metadata={"help": (
        "steps with at most this many distinct adapters also run the LoRA expands on the side "
        "stream (0: never)")})
    side_expand_group_segments: Mapping[str, int] = field(
        default_factory=lambda: _frozen({"down": 32}), metadata={"help": (
            "per group, a higher such bound (down's matmul hides its expand up to 32 "
            "adapters)")})
    norm_split_columns: int = field(default=512, metadata={"help": (
        "columns a program of the LoRA add + norm after the groups of norm_split_groups "
        "covers (0: one program a row)")})
    norm_split_groups: frozenset[str] = field(default=frozenset({"o"}), metadata={"help": (
        "of o and down, those whose LoRA add + norm spreads each row over programs (where the "
        "delta comes unexpanded: one expanded on the side stream takes one program a row)")})
    gate_up_silu: bool = field(default=True, metadata={"help": (
        "in steps without LoRA on gate/up, its decode GEMM (or FP8 GEMM) writes SiLU(gate) * "
        "up itself: no SiLU launch")})
    split_sums_in_norm: bool = field(default=True, metadata={"help": (
        "an o or down GEMM split over K (FP8, or by gemm_split_k) leaves its partials to the "
        "add + norm after it, which sums them (no sum launch), in steps whose LoRA delta that op "
        "adds too")})
    fp8_pdl: bool = field(default=True, metadata={"help": (
        "in decode steps without LoRA, the FP8 GEMMs (and W8A8's row quantizer) launch with "
        "PDL, asking L2 for their first weight columns while the kernel ahead ends; LoRA steps "
        "launch them plainly (their side-stream kernels need the SMs the waiting programs hold)")})
    fp8_trigger: bool = field(default=True, metadata={"help": (
        "the kernel after an FP8 decode GEMM (launched with PDL) may launch once the GEMM's "
        "programs have left their K loop, and waits on the SMs while they store")})
    qkv_rope: bool = field(default=True, metadata={"help": (
        "in steps without LoRA on q/k/v, its decode GEMM rotates queries and keys and writes "
        "keys and values to the KV cache itself: no RoPE launch")})
    # -- elementwise ops --
    silu_row_tile: tuple[int, int] = field(default=(256, 2), metadata={"help": (
        "(columns, warps) of a SiLU program expanding gate/up's LoRA delta")})

    def __post_init__(self) -> None:
        for name in ("gemm_groups", "fold_groups", "shrink_fold_groups", "fold_shrink_spread",
                     "fp8_shrink_fold_groups"):
            object.__setattr__(self, name, frozenset(getattr(self, name)))
            unknown = getattr(self, name) - set(GROUPS)
            if unknown:
                raise ValueError(f"{name} names {sorted(unknown)}: expected some of "
                                 f"{', '.join(GROUPS)}")
        tile = self.attention_decode_key_tile
        if tile < 256 or tile & (tile - 1):
            raise ValueError(f"attention_decode_key_tile {tile}: expected a power of two of at "
                             f"least 256")
        if not set(self.norm_split_groups) <= {"o", "down"}:
            raise ValueError(f"norm_split_groups takes o and down (an add + norm follows "
                             f"them), not {sorted(set(self.norm_split_groups) - {'o', 'down'})}")
        object.__setattr__(self, "norm_split_groups", frozenset(self.norm_split_groups))
        if not set(self.gemm_split_k) <= {"o", "down"} or min(self.gemm_split_k.values(), default=1) < 1:
            raise ValueError(f"gemm_split_k takes o and down (an add + norm sums their splits), "
                             f"each at least 1, not {dict(self.gemm_split_k)}")
        for rows, launch in self.attention_decode_launches.items():
            if not attention_launch_valid(rows, launch):
                raise ValueError(f"attention_decode_launches {rows}={'.'.join(map(str, launch))}: expected "
                                 f"ROWS=TILE.WARPS.STAGES, ROWS a positive integer, TILE a power of two of "
                                 f"at least 256, WARPS 1-16 (a power of two), STAGES 1-8; any of them 0: "
                                 f"the rule's")
        for name in ("gemm_tilings", "gemm_tma_tilings", "fold_tilings", "moe_tilings", "moe_lora_launches",
                     "side_expand_group_segments", "attention_decode_launches", *FP8_TILING_FIELDS):
            object.__setattr__(self, name, _frozen(getattr(self, name)))
        for name in FP8_TILING_FIELDS:
            for group, choice in getattr(self, name).items():
                if group not in GROUPS or not fp8_choice_valid(choice):
                    raise ValueError(f"{name} {group}={'.'.join(map(str, choice))}: expected a group of "
                                     f"{', '.join(GROUPS)} = block_n.block_k.stages.splits, block_n and "
                                     f"block_k powers of two of at least 16, stages 1-8, splits 0 (the "
                                     f"rule) or a power of two")
        for group, (one_launch, width, warps) in self.moe_lora_launches.items():
            if one_launch not in (0, 1, 2) or width < 16 or width & (width - 1) or warps not in (1, 2, 4, 8, 16):
                raise ValueError(f"moe_lora_launches {group}={one_launch}.{width}.{warps}: expected 0, 1 or 2, a "
                                 f"power of two of at least 16 columns, and 1-16 warps (a power of two)")
        bad = set(self.side_expand_group_segments) - set(GROUPS)
        if bad:
            raise ValueError(f"side_expand_group_segments names {sorted(bad)}: expected some "
                             f"of {', '.join(GROUPS)}")

    def __reduce__(self):
        """Pickled with plain dicts (a mapping proxy is not picklable): the engine core and
        the front ends are spawned processes that receive the node's settings."""
        return (_rebuild, (type(self), {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}))

    def replace(self, **changes: Any) -> "Tuning":
        """This tuning with some choices changed (a benchmark's sweep)."""
        return dataclasses.replace(self, **changes)

    def without_folds(self, groups: Collection[str]) -> "Tuning":
        """The LoRA plan where the matmuls of `groups` cannot fold their LoRA in (a bias: the
        fold kernel adds none): their shrinks and expands run beside the matmul. A fold asked
        of a matmul that has none falls back to the fold's reference, a gather of each row's
        adapter."""
        return self.replace(fold_groups=self.fold_groups - set(groups),
                            shrink_fold_groups=self.shrink_fold_groups - set(groups),
                            fold_shrink_spread=self.fold_shrink_spread - set(groups))

    def for_fp8_projections(self) -> "Tuning":
        """The LoRA plan over FP8 projections: the FP8 GEMM adds no delta itself (no whole
        fold) and shrinks only for fp8_shrink_fold_groups (kernels/gemm/fp8_triton_kernel.py),
        in programs over the whole K (no spread)."""
        return self.replace(fold_groups=frozenset(), shrink_fold_groups=self.fp8_shrink_fold_groups,
                            fold_shrink_spread=frozenset())

    def fp8_choices(self, w8a8: bool) -> Mapping[str, Fp8Choice]:
        """The FP8 decode GEMM's launch per group: W8A8's or the weight-only one's."""
        return self.w8a8_tilings if w8a8 else self.fp8_tilings

    # -- what a launch on tensor t's device does --
    def pdl_on(self, t: torch.Tensor) -> bool:
        """Programmatic dependent launch for kernels on t's device: on, and Hopper."""
        return self.pdl and hopper(t)

    def fp8_pdl_on(self) -> bool:
        """Whether steps without LoRA ask their FP8 GEMMs for PDL (kernels/gemm/fp8.py:
        decode_pdl says at which rows, fp8_gemm_triton on which devices)."""
        return self.fp8_pdl and self.pdl

    def attention_decode_launch(self, rows: int) -> tuple[int, int, int] | None:
        """(key tile elements, warps, stages or 0) of a decode attention launch over `rows`
        rows: the entry of the fewest rows at or above them, else of the most; None where
        the table has none (the rule's launch)."""
        if not self.attention_decode_launches:
            return None
        entries = {int(r): launch for r, launch in self.attention_decode_launches.items()}
        return entries[min((r for r in entries if r >= rows), default=max(entries))]

    def attention_early_kv_on(self, t: torch.Tensor) -> bool:
        return self.attention_early_kv and self.pdl_on(t)

    def expand_early_b_on(self, t: torch.Tensor) -> bool:
        return self.expand_early_b and self.pdl_on(t)

    def gemm_tma_on(self, t: torch.Tensor) -> bool:
        return self.gemm_tma and hopper(t)


DEFAULT_TUNING = Tuning()


def fp8_tilings_field(w8a8: bool) -> str:
    """The Tuning table of the FP8 decode GEMM's launches for W8A8 or weight-only projections."""
    return FP8_TILING_FIELDS[w8a8]


def hopper(t: torch.Tensor) -> bool:
    """kernels.host.hopper, bound here at the first launch that asks: this module imports no
    torch, so the node's command line parses --tune into a Tuning without loading it."""
    global hopper
    from .host import hopper
    return hopper(t)


# -- the choices as text: `inference-node serve`'s flags and the benchmarks' sweeps --

def _default(name: str) -> Any:
    f = next(f for f in dataclasses.fields(Tuning) if f.name == name)
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def choice_help(name: str) -> str:
    """What choice `name` means, and the form its text takes."""
    f = next(f for f in dataclasses.fields(Tuning) if f.name == name)
    return f"{f.metadata['help']} [{_form(name, _default(name))}]"


def _form(name: str, value: Any) -> str:
    if isinstance(value, bool):
        return "on or off"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, frozenset):
        return "groups, comma-separated, or all, or none"
    if isinstance(value, tuple):
        return "numbers joined by dots"
    if name == "attention_decode_launches":
        return "ROWS=TILE.WARPS.STAGES, comma-separated, or none"
    if all(isinstance(v, tuple) for v in value.values()):
        splits = ".SPLITS" if any(len(v) == 4 for v in value.values()) else ""
        return f"GROUP=BLOCK_N.BLOCK_K.STAGES{splits}, comma-separated: replaces those groups' entries"
    return "GROUP=N, comma-separated, or none"


def format_choice(name: str, value: Any) -> str:
    """`value` of choice `name` as parse_choice reads it."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, frozenset):
        return ",".join(g for g in GROUPS if g in value) or "none"
    if isinstance(value, tuple):
        return ".".join(map(str, value))
    return ",".join(f"{g}={'.'.join(map(str, v)) if isinstance(v, tuple) else v}"
                    for g, v in value.items()) or "none"


def parse_choice(name: str, text: str) -> Any:
    """The value of choice `name` written as `text` (format_choice's forms); ValueError with
    what was expected otherwise."""
    default = _default(name)
    text = text.strip()
    try:
        if isinstance(default, bool):
            if text.lower() in ("on", "true", "1", "yes"):
                return True
            if text.lower() in ("off", "false", "0", "no"):
                return False
            raise ValueError
        if isinstance(default, int):
            return int(text)
        if isinstance(default, frozenset):
            if text == "all":
                return frozenset(GROUPS)
            return frozenset(g for g in text.split(",") if g and g != "none")
        if isinstance(default, tuple):
            return tuple(int(v) for v in text.split("."))
        entries = {}
        for item in filter(None, text.split(",")):
            if item == "none":
                continue
            group, sep, value = item.partition("=")
            if not sep:
                raise ValueError
            entries[group] = (tuple(int(v) for v in value.split("."))
                              if all(isinstance(v, tuple) for v in default.values())
                              else int(value))
        if default and all(isinstance(v, tuple) for v in default.values()):
            return _frozen({**default, **entries})  # a tiling table: the entries given replaced
        return _frozen(entries)
    except ValueError:
        raise ValueError(f"{name}={text!r}: expected {_form(name, default)}") from None


def tuning_from_text(choices: Mapping[str, str], base: Tuning = DEFAULT_TUNING) -> Tuning:
    """`base` with the named choices replaced, each given as text (parse_choice)."""
    names = {f.name for f in dataclasses.fields(Tuning)}
    unknown = set(choices) - names
    if unknown:
        raise ValueError(f"no tuning choice {sorted(unknown)}: expected some of "
                         f"{', '.join(sorted(names))}")
    return base.replace(**{name: parse_choice(name, text) for name, text in choices.items()})
