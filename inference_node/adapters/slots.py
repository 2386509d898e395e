"""The GPU adapter memory: per layer and fused projection group, arenas of rank rows shared by
every resident adapter, and small per-slot tables that say where each adapter's rows lie.

Memory is paged by rank, not by slot: an adapter of rank r holds r consecutive rows in the
arena of each module it targets (kernels/lora/rows.py), the same rows in every layer, so a
rank-8 adapter costs an eighth of a rank-64 one and an adapter of q and v costs nothing in
k, o or the MLP. A slot is only a small index into the tables (scaling, per-module rank and
first row) that the kernels read beside the step's rows; `num_slots` of them exist, far more
than the distinct adapters one step holds (`max_loras`). Which slot's rows go where is the
RowArena's (arena.py); which adapters stay is the adapter manager's.

The embedding and the LM head (an adapter's embed_tokens and lm_head LoRA) have arenas of their
own, one per model rather than per layer (`edges`), filled and freed with the rest; their
slot tables live on the host (`edge_rows`), read by the eager steps that apply them. So do a
mixture-of-experts model's expert parameters (`experts`, experts.py): every arena, the
experts' included, is cut from the one --lora-memory-mb and allocated at start, so the
adapter manager's placement and eviction see every byte an adapter holds on the GPU.

Writing an adapter copies its host tensors on a side stream (CUDA), recording an event that
tells the engine when it is ready, so the running batch is not stalled by the copy.

Under tensor parallelism every rank has its own arenas over its shard's shapes (the same rank
rows: ranks are not split) and keeps its part of each adapter (`shard`); rank 0's adapter
manager decides placements, and `on_write` / `on_free` send each write (with its rows) and
free on to the other ranks (parallel/workers.py), which place the adapter at the same rows:
every rank's `table` reads the same.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Collection, Iterable

import numpy as np
import torch

from kernels.lora import MODULE_COLUMNS, SlotRows

from ..model.config import ModelConfig
from ..model.families import EDGE_MODULES, EXPERT_MODULES
from ..model.llama import FUSED_MODULES, LORA_MODULES, MLP_GROUPS, MLP_MODULES
from ..parallel.shard import Shard
from .arena import Cost, RowArena
from .experts import EXPERT_ROW_FACTOR, ExpertArenas, expert_ranks, expert_row_nbytes
from .weights import EDGE_LAYER, AdapterWeights

# Every module with an arena: the decoder layers' (per layer) and the embedding's and LM head's.
ADAPTER_MODULES: tuple[str, ...] = LORA_MODULES + EDGE_MODULES
MAX_SLOTS = 4096  # per-slot tables: a few KB; more resident adapters than that are not kept

# What a slot holds, as every tensor-parallel rank must agree: (name, version, rank, scaling,
# targeted modules, (module, first arena row) of each run), or None for an empty slot.
SlotRecord = tuple[str, str, int, float, tuple[str, ...], tuple[tuple[str, int], ...]] | None


@dataclass
class GroupBuffers:
    """A fused group's arenas in one layer. Slice i's A rows are `a_all[i]`; B rows hold every
    slice's output columns side by side (each slice's at its offset), as the fused
    projection's weights do, so a kernel that folds LoRA into the projection's matmul
    (kernels/gemm/fold_triton_kernel.py) reads the B rows of any output column at that
    column's index; `a` and `b` are per-slice views of the same memory. Each slice has its own
    allocation (an adapter's run on q need not be at the same rows as its run on v)."""

    a: list[torch.Tensor]       # one per slice: [rows, in] (views of a_all)
    b: list[torch.Tensor]       # one per slice: [rows, out_i] (views of b_all)
    offsets: list[int]          # column offset of each slice in the fused output
    a_all: torch.Tensor         # [slices, rows, in]
    b_all: torch.Tensor         # [rows, sum(out)]


def row_nbytes(config: ModelConfig, dtype: torch.dtype) -> dict[str, int]:
    """Bytes of one rank row of each module's arena over all layers (the embedding's and the
    LM head's: once; an expert parameter's: over every MoE layer and expert): A's row and
    B's column."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    sizes = {m: layers_with_arena(config, m) * (fan_in + fan_out) * itemsize
             for m, (fan_in, fan_out) in config.module_shapes().items() if m in LORA_MODULES}
    sizes.update({m: (fan_in + fan_out) * itemsize for m, (fan_in, fan_out) in config.edge_shapes().items()})
    sizes.update(expert_row_nbytes(config, itemsize))
    return sizes


def layers_with_arena(config: ModelConfig, module: str) -> int:
    """Layers whose arena of `module` holds rows: every one, but a dense MLP module's only
    in the layers with a dense MLP (a mixture of experts' routed layers get empty arenas:
    its family's adapters have no dense MLP LoRA, model/families.py)."""
    if module not in MLP_MODULES:
        return config.num_layers
    return sum(1 for layer in range(config.num_layers) if not config.is_moe_layer(layer))


def held_modules(modules: Collection[str]) -> tuple[str, ...]:
    """The modules adapter memory holds rows for when adapters are expected to target
    `modules` (--lora-modules): every module of a fused group holding one of them, the edge
    modules named, and the expert parameters of the MLP modules named (on a
    mixture-of-experts model)."""
    return (tuple(m for fused in FUSED_MODULES.values() if set(fused) & set(modules) for m in fused)
            + tuple(m for m in EDGE_MODULES if m in modules)
            + tuple(m for m, mlp in EXPERT_MODULES.items() if set(mlp) & set(modules)))


def arena_rows(module: str, rows: int) -> int:
    """Rows of a held module's arena when every module holds `rows` rank rows of adapters:
    the experts' gate_up_proj holds twice as many (PEFT doubles an adapter's rank there)."""
    return rows * EXPERT_ROW_FACTOR.get(module, 1)


def budget_row_nbytes(config: ModelConfig, dtype: torch.dtype, modules: Collection[str] = ADAPTER_MODULES) -> int:
    """Bytes of adapter memory per rank row of every held module's arena (`rows` in
    SlotBuffers): what --lora-memory-mb is divided by."""
    sizes = row_nbytes(config, dtype)
    return sum(arena_rows(m, sizes[m]) for m in held_modules(modules) if m in sizes)


def rows_for_budget(config: ModelConfig, dtype: torch.dtype, budget_bytes: int,
                    modules: Collection[str] = ADAPTER_MODULES) -> int:
    """Rank rows per module arena that `budget_bytes` of adapter memory holds (every arena of
    a fused group holding one of `modules`, of an edge module named, and of an expert
    parameter of an MLP module named gets the same number of rows, arena_rows; SlotBuffers)."""
    return max(1, budget_bytes // budget_row_nbytes(config, dtype, modules))


class SlotBuffers:
    def __init__(self, config: ModelConfig, max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device, rows: int | None = None,
                 num_slots: int | None = None, modules: Collection[str] = ADAPTER_MODULES,
                 shard: Shard = Shard()) -> None:
        """config: the shapes this process computes with (its shard's, under tensor
        parallelism; adapters arrive whole and `shard` keeps this rank's part of each).
        max_loras: the most distinct adapters in one step; max_rank: the largest rank
        served. rows: rank rows per module arena (default: max_loras adapters of max_rank);
        num_slots: resident adapters the tables track (default: one per row, at least
        max_loras, at most MAX_SLOTS). modules: those adapters are expected to target; a
        fused group holding none of them gets a one-row arena (its kernels then always
        have rows to point at), so a fleet of q/v adapters spends no memory on o or the MLP;
        likewise the embedding's and the LM head's arenas (EDGE_MODULES); an expert
        parameter whose MLP modules are not named gets none (only its steps read it)."""
        self.shard = shard
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.rows = rows if rows is not None else max_loras * max_rank
        self.num_slots = num_slots or max(max_loras, min(self.rows, MAX_SLOTS))
        self.device = device
        self.row_nbytes = row_nbytes(config, dtype)
        self.group_rows = {group: self.rows if set(fused) & set(modules) else 1
                           for group, fused in FUSED_MODULES.items()}
        # The embedding's and LM head's arenas, whole on every tensor-parallel rank (the LM
        # head's delta takes the rank's block of vocabulary columns of B).
        self.edge_rows_held = {m: self.rows if m in modules else 1 for m in EDGE_MODULES}
        self.held = held = held_modules(modules)  # the modules whose arenas --lora-memory-mb sizes
        self.experts = ExpertArenas(config, {m: arena_rows(m, self.rows) if m in held else 0
                                             for m in EXPERT_MODULES}, dtype, device, shard, self.num_slots, max_rank)
        shapes = config.module_shapes()
        self.layers: list[dict[str, GroupBuffers]] = []
        for layer in range(config.num_layers):
            groups = {}
            for group, modules in FUSED_MODULES.items():
                fan_in = shapes[modules[0]][0]
                assert all(shapes[m][0] == fan_in for m in modules), "a group's slices share x"
                offsets = [0]
                for m in modules[:-1]:
                    offsets.append(offsets[-1] + shapes[m][1])
                total_out = offsets[-1] + shapes[modules[-1]][1]
                # Zeros: no row ever holds anything but an adapter's validated weights or zero.
                rows_here = (0 if group in MLP_GROUPS and config.is_moe_layer(layer)
                             else self.group_rows[group])
                a_all = torch.zeros(len(modules), rows_here, fan_in, dtype=dtype, device=device)
                b_all = torch.zeros(rows_here, total_out, dtype=dtype, device=device)
                a = [a_all[i] for i in range(len(modules))]
                b = [b_all[:, off:off + shapes[m][1]] for off, m in zip(offsets, modules)]
                groups[group] = GroupBuffers(a, b, offsets, a_all, b_all)
            self.layers.append(groups)
        self.edges: dict[str, tuple[torch.Tensor, torch.Tensor]] = {
            m: (torch.zeros(self.edge_rows_held[m], fan_in, dtype=dtype, device=device),
                torch.zeros(self.edge_rows_held[m], fan_out, dtype=dtype, device=device))
            for m, (fan_in, fan_out) in config.edge_shapes().items()}
        S = self.num_slots
        self.arenas = {m: RowArena(self.group_rows[group])
                       for group, fused in FUSED_MODULES.items() for m in fused}
        self.arenas.update({m: RowArena(self.edge_rows_held[m]) for m in EDGE_MODULES})
        self.arenas.update({m: RowArena(rows) for m, rows in self.experts.rows.items()})
        self.scaling = torch.zeros(S, dtype=torch.float32, device=device)
        # Per fused group, [slices, slots]: the slot's rank on each module its adapter targets,
        # else 0, so the kernels skip what an adapter leaves alone (a q/v adapter does no k,
        # o or MLP work), and the first arena row of its run there.
        self.slice_ranks = {group: torch.zeros(len(modules), S, dtype=torch.int32, device=device)
                            for group, modules in FUSED_MODULES.items()}
        self.slice_rows = {group: torch.zeros(len(modules), S, dtype=torch.int32, device=device)
                           for group, modules in FUSED_MODULES.items()}
        self._slot_rows = {group: SlotRows(self.slice_ranks[group], self.slice_rows[group], max_rank)
                           for group in FUSED_MODULES}
        # Host mirror: the fused groups each slot's adapter targets, so a step whose adapters
        # all leave a group alone launches nothing for it (groups_of).
        self.slot_groups: list[frozenset[str]] = [frozenset()] * S
        # Host mirror of the tables, [slot, (rank, first row) per module in LORA_MODULES
        # order]: decode graphs copy a step's rows of it into their segment and token tables
        # (kernels/lora/meta.py).
        self.module_rows = np.zeros((S, MODULE_COLUMNS * len(LORA_MODULES)), dtype=np.int32)
        # Per edge module, [slot, (rank, first row)] on the host (0 rank: not targeted).
        self.edge_rows = {m: np.zeros((S, 2), dtype=np.int64) for m in EDGE_MODULES}
        self.slot_edges: list[frozenset[str]] = [frozenset()] * S
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.table: list[SlotRecord] = [None] * S
        # Called after every write and free: a tensor-parallel node's rank 0 sends them on to
        # the other ranks (parallel/workers.py), so every rank's arenas hold the same adapters
        # at the same rows. on_write gets the first arena row of each module's run.
        self.on_write: Callable[[int, AdapterWeights, dict[str, int]], None] | None = None
        self.on_free: Callable[[int], None] | None = None

    # -- memory ------------------------------------------------------------------------------
    def nbytes(self) -> int:
        """The arenas' bytes (the adapter memory allocated)."""
        return (sum(t.numel() * t.element_size() for layer in self.layers for g in layer.values()
                    for t in (g.a_all, g.b_all))
                + sum(t.numel() * t.element_size() for pair in self.edges.values() for t in pair)
                + self.experts.nbytes())

    def used_nbytes(self) -> int:
        """Bytes of the rows resident adapters hold: the sum of their own sizes."""
        return sum(arena.used * self.row_nbytes[m] for m, arena in self.arenas.items())

    @staticmethod
    def ranks_of(weights: AdapterWeights) -> dict[str, int]:
        """The rank rows an adapter needs per module: its rank on every module it targets,
        its own rank on each expert parameter."""
        return {**{m: weights.rank for m in ADAPTER_MODULES if m in weights.target_modules},
                **expert_ranks(weights.experts)}

    def adapter_nbytes(self, ranks: dict[str, int]) -> int:
        """Bytes an adapter of these per-module ranks holds on the GPU."""
        return sum(r * self.row_nbytes[m] for m, r in ranks.items())

    def place(self, slot: int, ranks: dict[str, int]) -> bool:
        """Gives the slot a run of rows in each module's arena, if every one has a free run
        long enough (nothing taken otherwise)."""
        firsts = {}
        for module, r in ranks.items():
            first = self.arenas[module].fit(r)
            if first is None:
                return False
            firsts[module] = first
        for module, r in ranks.items():
            self.arenas[module].take(slot, firsts[module], r)
        return True

    def place_at(self, slot: int, ranks: dict[str, int], firsts: dict[str, int]) -> None:
        """Gives the slot the runs another rank's placement chose (first row per module):
        a tensor-parallel rank mirroring rank 0's arenas."""
        assert set(firsts) == set(ranks), f"runs for {sorted(firsts)}, ranks for {sorted(ranks)}"
        self.free(slot)
        for module, r in ranks.items():
            self.arenas[module].take(slot, firsts[module], r)

    def plan(self, ranks: dict[str, int], cost: Cost) -> list[int] | None:
        """The slots to evict so that an adapter of these ranks fits (empty: it fits now), the
        cheapest run per module by `cost`; None when no run can be made."""
        victims: list[int] = []
        for module, r in sorted(ranks.items(), key=lambda mr: -mr[1]):
            chosen = set(victims)
            found = self.arenas[module].window(r, lambda s: 0.0 if s in chosen else cost(s))
            if found is None:
                return None
            victims += [s for s in found[1] if s not in chosen]
        return victims

    def free(self, slot: int) -> None:
        """Returns the slot's rows to the arenas and clears its tables."""
        for arena in self.arenas.values():
            arena.free(slot)
        self.scaling[slot] = 0.0
        for group in FUSED_MODULES:
            self.slice_ranks[group][:, slot] = 0
            self.slice_rows[group][:, slot] = 0
        self.slot_groups[slot] = frozenset()
        self.module_rows[slot] = 0
        for rows in self.edge_rows.values():
            rows[slot] = 0
        self.slot_edges[slot] = frozenset()
        self.experts.free(slot)
        held, self.table[slot] = self.table[slot], None
        if held is not None and self.on_free is not None:
            self.on_free(slot)

    # -- weights -----------------------------------------------------------------------------
    def write(self, slot: int, weights: AdapterWeights) -> torch.cuda.Event | None:
        """Copies an adapter into the rows placed for its slot (`place`), zeroing those of a
        layer it leaves alone, and fills the slot's tables."""
        r = weights.rank
        stream_ctx = torch.cuda.stream(self._stream) if self._stream is not None else _nullcontext()
        ranks = self.ranks_of(weights)
        runs = {m: self.arenas[m].run_of(slot) for m in ranks}
        assert all(run is not None and run[1] == ranks[m] for m, run in runs.items()), \
            f"slot {slot} has no rows placed for ranks {ranks}"
        with stream_ctx:
            for layer_idx, groups in enumerate(self.layers):
                for group, modules in FUSED_MODULES.items():
                    buf = groups[group]
                    if buf.b_all.shape[0] == 0:  # a routed layer's dense MLP: there is none
                        continue
                    for i, module in enumerate(modules):
                        if module not in runs:
                            continue
                        first = runs[module][0]
                        a_rows, b_rows = buf.a[i][first:first + r], buf.b[i][first:first + r]
                        pair = weights.tensors.get((layer_idx, module))
                        if pair is None:
                            a_rows.zero_()
                            b_rows.zero_()
                            continue
                        a, b = self.shard.lora_pair(module, *pair)
                        a_rows.copy_(a, non_blocking=True)
                        # B [out, r] arrives as it is stored and is turned into rank rows on
                        # the device (a transposed copy there, not on the host).
                        b_rows.copy_(b.to(self.device, non_blocking=True).t())
            for module, (a_arena, b_arena) in self.edges.items():
                if module in runs:
                    first = runs[module][0]
                    a, b = weights.tensors[(EDGE_LAYER, module)]
                    a_arena[first:first + r].copy_(a, non_blocking=True)
                    b_arena[first:first + r].copy_(b.to(self.device, non_blocking=True).t())
            self.experts.write(slot, weights.experts, {m: runs[m][0] for m in EXPERT_MODULES if m in runs})
            self.scaling[slot] = weights.scaling
            firsts = {m: run[0] for m, run in runs.items()}
            self._set_tables(slot, r, firsts)
            self.table[slot] = (weights.name, weights.version, r, float(weights.scaling),
                                tuple(weights.target_modules), tuple(sorted(firsts.items())))
            if self.on_write is not None:
                self.on_write(slot, weights, firsts)
            if self._stream is None:
                return None
            event = torch.cuda.Event()
            event.record(self._stream)
            return event

    def _set_tables(self, slot: int, rank: int, firsts: dict[str, int]) -> None:
        """The slot's rank and first row on every module it targets, 0 on the others."""
        for group, modules in FUSED_MODULES.items():
            self.slice_ranks[group][:, slot] = torch.tensor(
                [rank if m in firsts else 0 for m in modules], dtype=torch.int32)
            self.slice_rows[group][:, slot] = torch.tensor(
                [firsts.get(m, 0) for m in modules], dtype=torch.int32)
        self.slot_groups[slot] = frozenset(
            g for g, modules in FUSED_MODULES.items() if rank > 0 and any(m in firsts for m in modules))
        self.module_rows[slot] = [v for m in LORA_MODULES
                                  for v in ((rank, firsts[m]) if m in firsts else (0, 0))]
        for m, rows in self.edge_rows.items():
            rows[slot] = (rank, firsts[m]) if m in firsts else (0, 0)
        self.slot_edges[slot] = frozenset(m for m in EDGE_MODULES if m in firsts and rank > 0)

    def slot_rows(self, group: str) -> SlotRows:
        """Where every slot's rows of a fused group lie (what the LoRA kernels take)."""
        return self._slot_rows[group]

    def edges_of(self, slots: Iterable[int]) -> frozenset[str]:
        """The edge modules (embed_tokens, lm_head) any of these slots targets."""
        edges: frozenset[str] = frozenset()
        for slot in set(slots):
            if slot >= 0:
                edges |= self.slot_edges[slot]
        return edges

    def has_experts(self, slots: Iterable[int]) -> bool:
        """Whether any of these slots' adapters has expert LoRA."""
        return bool(self.expert_parameters(slots))

    def expert_parameters(self, slots: Iterable[int]) -> frozenset[str]:
        """The expert parameters (gate_up_proj, down_proj) any of these slots' adapters has
        LoRA on."""
        held = [self.experts.of(slot) for slot in set(slots) if slot >= 0]
        return frozenset(parameter for pairs in held if pairs for (_, parameter) in pairs)

    def groups_of(self, slots: Iterable[int]) -> frozenset[str]:
        """The fused groups any of these slots targets (slot -1: none)."""
        groups: frozenset[str] = frozenset()
        for slot in set(slots):
            if slot >= 0:
                groups |= self.slot_groups[slot]
        return groups


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
