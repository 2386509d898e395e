"""The GPU slot pool's memory: per layer and fused projection group, stacked A and B buffers
with `max_loras` slots, ranks zero-padded to `max_lora_rank`, and a scaling per slot.

Writing a slot copies host tensors on a side stream (CUDA), recording an event that tells
the engine when the slot is ready, so the running batch is not stalled by the copy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np
import torch

from ..model.config import ModelConfig
from ..model.llama import FUSED_MODULES, LORA_MODULES
from ..parallel.shard import Shard
from .weights import AdapterWeights


@dataclass
class GroupBuffers:
    """A fused group's slots. Each slot's slices lie side by side (`a_all`, `b_all`), as the
    fused projection's weights do, so a kernel that folds LoRA into the projection's matmul
    (kernels/gemm/fold_triton_kernel.py) reads a slot's A as one [slices x R, in] matrix
    and the B rows of any output column at that column's index; `a` and `b` are per-slice
    views of the same memory."""

    a: list[torch.Tensor]       # one per slice: [S, R, in] (views of a_all)
    b: list[torch.Tensor]       # one per slice: [S, out, R] (views of b_all)
    offsets: list[int]          # column offset of each slice in the fused output
    a_all: torch.Tensor         # [S, slices x R, in]: slice i's A in rows i*R .. i*R+R-1
    b_all: torch.Tensor         # [S, sum(out), R]: slice i's B at its columns' offsets


# What a slot holds, as every tensor-parallel rank must agree: (name, version, rank, scaling,
# targeted modules), or None for an empty slot.
SlotRecord = tuple[str, str, int, float, tuple[str, ...]] | None


class SlotBuffers:
    def __init__(self, config: ModelConfig, max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device, shard: Shard = Shard()) -> None:
        """config: the shapes this process computes with (its shard's, under tensor
        parallelism); adapters arrive whole and `shard` keeps this rank's part of each."""
        self.shard = shard
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.device = device
        shapes = config.module_shapes()
        self.layers: list[dict[str, GroupBuffers]] = []
        for _ in range(config.num_layers):
            groups = {}
            for group, modules in FUSED_MODULES.items():
                fan_in = shapes[modules[0]][0]
                assert all(shapes[m][0] == fan_in for m in modules), "a group's slices share x"
                offsets = [0]
                for m in modules[:-1]:
                    offsets.append(offsets[-1] + shapes[m][1])
                total_out = offsets[-1] + shapes[modules[-1]][1]
                a_all = torch.zeros(max_loras, len(modules) * max_rank, fan_in, dtype=dtype,
                                    device=device)
                b_all = torch.zeros(max_loras, total_out, max_rank, dtype=dtype, device=device)
                a = [a_all[:, i * max_rank:(i + 1) * max_rank] for i in range(len(modules))]
                b = [b_all[:, off:off + shapes[m][1]] for off, m in zip(offsets, modules)]
                groups[group] = GroupBuffers(a, b, offsets, a_all, b_all)
            self.layers.append(groups)
        self.scaling = torch.zeros(max_loras, dtype=torch.float32, device=device)
        # Per fused group, [slices, slots]: the slot's rank on each module its adapter targets,
        # else 0, so the kernels skip what an adapter leaves alone (a q/v adapter does no k,
        # o or MLP work).
        self.slice_ranks = {group: torch.zeros(len(modules), max_loras, dtype=torch.int32, device=device)
                            for group, modules in FUSED_MODULES.items()}
        # Host mirror: the fused groups each slot's adapter targets, so a step whose adapters
        # all leave a group alone launches nothing for it (groups_of).
        self.slot_groups: list[frozenset[str]] = [frozenset()] * max_loras
        # Host mirror of the ranks, [slot, module in LORA_MODULES order]: decode graphs copy a
        # step's rows of it into their segment table (kernels/lora/meta.py).
        self.module_ranks = np.zeros((max_loras, len(LORA_MODULES)), dtype=np.int32)
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.table: list[SlotRecord] = [None] * max_loras
        # Called after every write and clear: a tensor-parallel node's rank 0 sends them on to
        # the other ranks (parallel/workers.py), so every rank's slots hold the same adapters.
        self.on_write: Callable[[int, AdapterWeights], None] | None = None
        self.on_clear: Callable[[int], None] | None = None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for g in layer.values()
                   for t in (g.a_all, g.b_all))

    def write(self, slot: int, weights: AdapterWeights) -> torch.cuda.Event | None:
        """Copies an adapter into a slot (zeroing modules it does not target)."""
        r = weights.rank
        stream_ctx = torch.cuda.stream(self._stream) if self._stream is not None else _nullcontext()
        with stream_ctx:
            for layer_idx, groups in enumerate(self.layers):
                for group, modules in FUSED_MODULES.items():
                    buf = groups[group]
                    for i, module in enumerate(modules):
                        pair = weights.tensors.get((layer_idx, module))
                        buf.a[i][slot].zero_()
                        buf.b[i][slot].zero_()
                        if pair is not None:
                            a, b = self.shard.lora_pair(module, *pair)
                            buf.a[i][slot, :r].copy_(a, non_blocking=True)
                            buf.b[i][slot, :, :r].copy_(b, non_blocking=True)
            self.scaling[slot] = weights.scaling
            self.set_ranks(slot, r, {module for _, module in weights.tensors})
            self.table[slot] = (weights.name, weights.version, r, float(weights.scaling),
                                tuple(weights.target_modules))
            if self.on_write is not None:
                self.on_write(slot, weights)
            if self._stream is None:
                return None
            event = torch.cuda.Event()
            event.record(self._stream)
            return event

    def set_ranks(self, slot: int, rank: int, targeted: set[str]) -> None:
        """The slot's rank on every module its adapter targets, 0 on the others."""
        for group, modules in FUSED_MODULES.items():
            values = [rank if m in targeted else 0 for m in modules]
            self.slice_ranks[group][:, slot] = torch.tensor(values, dtype=torch.int32)
        self.slot_groups[slot] = frozenset(
            g for g, modules in FUSED_MODULES.items() if rank > 0 and any(m in targeted for m in modules))
        self.module_ranks[slot] = [rank if m in targeted else 0 for m in LORA_MODULES]

    def clear(self, slot: int) -> None:
        self.scaling[slot] = 0.0
        for ranks in self.slice_ranks.values():
            ranks[:, slot] = 0
        self.slot_groups[slot] = frozenset()
        self.module_ranks[slot] = 0
        self.table[slot] = None
        if self.on_clear is not None:
            self.on_clear(slot)

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
