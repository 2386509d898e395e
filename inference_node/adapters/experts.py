"""The experts' LoRA of resident adapters on a mixture-of-experts base model, on the device:
per MoE layer and expert parameter, an arena of rank rows shared by every resident adapter,
A [experts, rows, in] and B [experts, rows, out] (model/moe.py adds each row's adapter's
delta beside each expert's matmul).

Paged like the projections' arenas (slots.py), and from the same --lora-memory-mb: an
adapter of expert rank r holds r consecutive rows of every expert in each parameter's arena,
the same rows in every MoE layer, placed and evicted with the rest of its slot. All of it is
allocated when the node starts, so no adapter allocates device memory while serving. Under
tensor parallelism each rank keeps the experts' block of intermediate columns its base
experts hold: gate/up's B columns (gate's block, then up's), down's A columns.
"""
from __future__ import annotations

import torch

from kernels.moe import PairLora

from ..model.config import ModelConfig
from ..model.families import EXPERT_PARAMETERS
from ..parallel.shard import Shard

# Rows an arena holds per rank row of the others: PEFT gives gate_up_proj, which holds gate
# and up, twice the adapter's rank (and --max-lora-rank allows twice there).
EXPERT_ROW_FACTOR: dict[str, int] = {"experts.gate_up_proj": 2, "experts.down_proj": 1}

# (A [experts, r, in], B [experts, r, out], scaling) by (layer, expert parameter): an
# adapter's expert LoRA (AdapterWeights.experts), or views of one slot's rows in the arenas.
ExpertPairs = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]]


def expert_row_nbytes(config: ModelConfig, itemsize: int) -> dict[str, int]:
    """Bytes of one rank row of each expert parameter's arena over all MoE layers and every
    expert (none for a dense model)."""
    layers = sum(1 for layer in range(config.num_layers) if config.is_moe_layer(layer))
    if not layers:
        return {}
    shapes = config.expert_shapes()
    return {f"experts.{p}": layers * config.num_experts * sum(shapes[p]) * itemsize for p in EXPERT_PARAMETERS}


def expert_ranks(experts: ExpertPairs) -> dict[str, int]:
    """The rank rows an adapter's expert LoRA (AdapterWeights.experts) needs per expert arena."""
    return {f"experts.{parameter}": a.shape[1] for (_, parameter), (a, _, _) in experts.items()}


class ExpertArenas:
    def __init__(self, config: ModelConfig, rows: dict[str, int], dtype: torch.dtype, device: torch.device,
                 shard: Shard = Shard(), num_slots: int = 1, max_rank: int = 0) -> None:
        """config: the shapes this rank computes with; rows: each expert arena's rank rows
        (the arenas' names: model/families.py's EXPERT_MODULES); num_slots: the adapter slots
        the per-slot tables track (SlotBuffers.num_slots); max_rank: the largest rank served
        (0: an arena's depth), which bounds one slot's rows in each arena (EXPERT_ROW_FACTOR
        times it): the LoRA kernels' rank tile, not the arena's depth of every adapter's rows."""
        self.inter, self.device, self.shard = config.moe_intermediate_size, device, shard
        self.layers = [layer for layer in range(config.num_layers) if config.is_moe_layer(layer)]
        self.rows = dict(rows) if self.layers else {}
        self.slot_max = {m: min(r, max_rank * EXPERT_ROW_FACTOR[m]) if max_rank else r for m, r in rows.items()}
        shapes = config.expert_shapes()
        # Zeros: no row ever holds anything but an adapter's validated weights or zero.
        self.a = {(layer, p): torch.zeros(config.num_experts, rows[f"experts.{p}"], shapes[p][0], dtype=dtype,
                                          device=device)
                  for layer in self.layers for p in EXPERT_PARAMETERS}
        self.b = {(layer, p): torch.zeros(config.num_experts, rows[f"experts.{p}"], shapes[p][1], dtype=dtype,
                                          device=device)
                  for layer in self.layers for p in EXPERT_PARAMETERS}
        self.held: dict[int, ExpertPairs] = {}
        # Per slot, on the device (what the fused experts' LoRA kernels read by each token's
        # slot): its first row and rank in each parameter's arenas (rows 2p, 2p + 1; rank 0:
        # none), and its scaling per (layer, parameter) (row key_index[key]).
        self.key_index = {key: k for k, key in enumerate(sorted(self.a))}
        self.slot_rows = torch.zeros(2 * len(EXPERT_PARAMETERS), num_slots, dtype=torch.int32, device=device)
        self.slot_scales = torch.zeros(max(len(self.key_index), 1), num_slots, dtype=torch.float32, device=device)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in list(self.a.values()) + list(self.b.values()))

    def write(self, slot: int, experts: ExpertPairs, firsts: dict[str, int]) -> None:
        """Copies an adapter's expert LoRA (AdapterWeights.experts, this rank's part) into the
        rows placed for it (first row per expert arena; in the caller's stream), zeroing those
        of a layer it leaves alone."""
        self.free(slot)
        ranks = expert_ranks(experts)
        pairs: ExpertPairs = {}
        rows = torch.zeros(self.slot_rows.shape[0], dtype=torch.int32)
        scales = torch.zeros(self.slot_scales.shape[0], dtype=torch.float32)
        for (layer, parameter), a_arena in self.a.items():
            module = f"experts.{parameter}"
            if module not in ranks:
                continue
            first, r = firsts[module], ranks[module]
            if r > self.slot_max[module]:
                raise ValueError(f"{module}: rank {r} is more than the {self.slot_max[module]} rows a slot may hold")
            a_rows, b_rows = a_arena[:, first:first + r], self.b[(layer, parameter)][:, first:first + r]
            pair = experts.get((layer, parameter))
            if pair is None:
                a_rows.zero_()
                b_rows.zero_()
                continue
            p = EXPERT_PARAMETERS.index(parameter)
            rows[2 * p], rows[2 * p + 1] = first, r
            scales[self.key_index[(layer, parameter)]] = pair[2]
            a, b = self._part(parameter, *pair[:2])
            a_rows.copy_(a, non_blocking=True)
            # B [experts, out, r] arrives as it is stored and is turned into rank rows on the
            # device (a transposed copy there, not on the host).
            b_rows.copy_(b.to(self.device, non_blocking=True).transpose(1, 2))
            pairs[(layer, parameter)] = (a_rows, b_rows, pair[2])
        if pairs:
            self.held[slot] = pairs
            self.slot_rows[:, slot].copy_(rows)
            self.slot_scales[:, slot].copy_(scales)

    def _part(self, parameter: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.shard.size > 1:
            lo, hi = self.shard.block(self.inter * self.shard.size)
            if parameter == "gate_up_proj":
                full = self.inter * self.shard.size
                b = torch.cat([b[:, lo:hi], b[:, full + lo:full + hi]], dim=1)
            else:
                a = a[:, :, lo:hi]
        return a, b

    def free(self, slot: int) -> None:
        if self.held.pop(slot, None) is not None:
            self.slot_rows[:, slot].zero_()
            self.slot_scales[:, slot].zero_()

    def pair_lora(self, layer: int, parameter: str, token_slots: torch.Tensor) -> PairLora:
        """`parameter`'s LoRA of `layer` for tokens on the adapter slots token_slots [T] (int32
        on the device, -1: none), as the fused experts take it."""
        p = EXPERT_PARAMETERS.index(parameter)
        key = (layer, parameter)
        return PairLora(self.a[key], self.b[key], token_slots, self.slot_rows[2 * p], self.slot_rows[2 * p + 1],
                        self.slot_scales[self.key_index[key]], self.slot_max[f"experts.{parameter}"])

    def of(self, slot: int) -> ExpertPairs | None:
        """The slot's expert LoRA (None: its adapter has none)."""
        return self.held.get(slot)
