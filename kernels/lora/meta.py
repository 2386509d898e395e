"""Per-step LoRA batch metadata: which tokens use which adapter slot, grouped by slot.

Built once per engine step on the host (where the scheduler already knows every token's
slot) and copied to the device in a single transfer, so no layer's LoRA call ever has to
read device memory back to size its launch grid.
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Sequence

import torch

# (slot, start in sorted_token_ids, length, first token if the group's tokens are one
# contiguous run of the batch else -1): lets the CPU path slice instead of gather.
HostSegment = tuple[int, int, int, int]

MAX_SPLIT_K = 16  # the most H_in splits a Triton shrink writes partial sums for

# Columns of LoraBatchMeta.segment_table: slot, first batch row, length, then for each module
# (a caller-defined order) the slot's rank on it and the first arena row of its run of rank
# rows there (kernels/lora/rows.py); a projection passes where its first slice's pair starts.
SEGMENT_TABLE_RANKS = 3
MODULE_COLUMNS = 2  # (rank, first row) per module, in the segment and token tables

_ALIGN_INT32 = 4  # int32 elements in 16 bytes, the alignment Triton specialises pointers on


@dataclass(frozen=True)
class LoraBatchMeta:
    """Per-step metadata, built ONCE per engine step and shared by every layer's LoRA calls."""

    token_slots: torch.Tensor       # [T] int32 on device, adapter slot of each token, -1 = none
    sorted_token_ids: torch.Tensor  # [T_active] int32: tokens with slot >= 0, grouped by slot
    segment_slots: torch.Tensor     # [num_segments] int32: the slot of each group
    segment_starts: torch.Tensor    # [num_segments] int32: start of each group in sorted ids
    segment_lens: torch.Tensor      # [num_segments] int32
    num_segments: int               # host ints, so kernels launch without device sync
    max_segment_len: int
    num_active_tokens: int
    segments: tuple[HostSegment, ...] = ()  # host copy of the groups (the reference loops them)
    # [>= num_segments, SEGMENT_TABLE_RANKS + modules] int32, or None. Present when each
    # segment's rows are one contiguous run of the batch (decode graphs order their rows by
    # slot): a kernel program then learns its segment's slot, rows and ranks from one row,
    # one memory latency, instead of a chain of dependent loads (segment -> slot -> rank,
    # start -> token ids -> activations) that costs more than a decode launch's bytes.
    segment_table: torch.Tensor | None = None
    # [T, MODULE_COLUMNS x modules] int32, or None: each row's adapter's (rank, first arena row)
    # on every module, zeros for rows without one. Present with the segment table: the ops
    # that expand a delta row by row (RoPE, add + norm, SiLU) read a row's B from it in one
    # memory latency, as they read its slot.
    token_table: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.token_slots.shape[0]

    @staticmethod
    def build(token_slots: Sequence[int] | torch.Tensor,
              device: torch.device | str) -> "LoraBatchMeta":
        """Groups tokens by slot on the host (stable: batch order kept inside a group)."""
        device = torch.device(device)
        if isinstance(token_slots, torch.Tensor):
            slots = token_slots.detach().to("cpu", torch.int32).reshape(-1)
        else:
            slots = torch.tensor(list(token_slots), dtype=torch.int32).reshape(-1)
        active = torch.nonzero(slots >= 0).reshape(-1)
        sorted_slots, order = torch.sort(slots[active], stable=True)
        sorted_ids = active[order].to(torch.int32)
        seg_slots, seg_lens = torch.unique_consecutive(sorted_slots, return_counts=True)
        seg_slots = seg_slots.to(torch.int32)
        seg_lens = seg_lens.to(torch.int32)
        seg_starts = (torch.cumsum(seg_lens, 0) - seg_lens).to(torch.int32)

        ids_list = sorted_ids.tolist()
        segments = []
        for slot, start, length in zip(seg_slots.tolist(), seg_starts.tolist(), seg_lens.tolist()):
            first = ids_list[start]
            contiguous = ids_list[start + length - 1] - first == length - 1  # ids increase
            segments.append((slot, start, length, first if contiguous else -1))

        # One packed host tensor, one copy, then views: a single H2D transfer per step. Each
        # part starts on a 16-byte boundary: Triton specialises a kernel on its pointers'
        # alignment, and views at offsets that follow the step's counts would make kernels
        # compile new variants mid-serving.
        parts = [slots, sorted_ids, seg_slots, seg_starts, seg_lens]
        padded = [torch.nn.functional.pad(p, (0, -p.numel() % _ALIGN_INT32)) for p in parts]
        packed = torch.cat(padded)
        if device.type == "cuda":
            packed = packed.pin_memory().to(device, non_blocking=True)
        else:
            packed = packed.to(device)
        offsets = list(itertools.accumulate((p.numel() for p in padded), initial=0))
        views = [packed[o:o + p.numel()] for o, p in zip(offsets, parts)]
        return LoraBatchMeta(
            token_slots=views[0], sorted_token_ids=views[1], segment_slots=views[2],
            segment_starts=views[3], segment_lens=views[4],
            num_segments=len(segments),
            max_segment_len=max((s[2] for s in segments), default=0),
            num_active_tokens=len(ids_list),
            segments=tuple(segments),
        )

    @staticmethod
    def contiguous_table(segments: Sequence[HostSegment], module_rows: Sequence[Sequence[int]],
                         num_rows: int | None = None) -> list[list[int]]:
        """Rows of a segment table (see `segment_table`) for segments whose rows are contiguous;
        module_rows[slot] is the slot's (rank, first arena row) on each module, flattened.
        Padding rows up to num_rows are empty segments (slot 0, length 0)."""
        rows = []
        for slot, _, length, first in segments:
            if first < 0:
                raise ValueError(f"the rows of adapter slot {slot} are not one contiguous run")
            rows.append([slot, first, length, *module_rows[slot]])
        width = SEGMENT_TABLE_RANKS + (len(module_rows[0]) if len(module_rows) else 0)
        rows += [[0] * width for _ in range((num_rows or len(rows)) - len(rows))]
        return rows

    def with_segment_table(self, module_rows: Sequence[Sequence[int]],
                           num_rows: int | None = None) -> "LoraBatchMeta":
        """This metadata plus its segment and token tables (tests and benchmarks; the decode
        graphs fill theirs in static buffers). module_rows as for contiguous_table."""
        rows = self.contiguous_table(self.segments, module_rows, num_rows or self.num_segments)
        width = SEGMENT_TABLE_RANKS + (len(module_rows[0]) if len(module_rows) else 0)
        table = torch.tensor(rows, dtype=torch.int32).reshape(len(rows), width)
        device = self.token_slots.device
        return dataclasses.replace(self, segment_table=table.to(device),
                                   token_table=self.token_rows(self.token_slots.tolist(),
                                                               module_rows).to(device))

    @staticmethod
    def token_rows(token_slots: Sequence[int], module_rows: Sequence[Sequence[int]]) -> torch.Tensor:
        """[T, width] int32 token table (see `token_table`): module_rows[slot] per row, zeros
        for rows without an adapter."""
        width = len(module_rows[0]) if len(module_rows) else 0
        zeros = [0] * width
        return torch.tensor([list(module_rows[s]) if s >= 0 else zeros for s in token_slots],
                            dtype=torch.int32).reshape(len(token_slots), width)

    def padded_for_graph(self, num_segments: int, max_segment_len: int) -> "LoraBatchMeta":
        """This metadata as a decode CUDA graph sees it (DecodeGraphs._fill_lora): the real
        segments, then empty ones up to `num_segments`, each sized for `max_segment_len` rows.
        Tests and the LoRA tiling sweep (inference_node/tuner/lora_sweep.py) use it to give the kernels a graph's launch shapes."""
        empty = num_segments - self.num_segments
        assert empty >= 0, f"{self.num_segments} segments do not fit in {num_segments}"

        def pad(t: torch.Tensor, value: int) -> torch.Tensor:
            return torch.cat([t, torch.full((empty,), value, dtype=t.dtype, device=t.device)])

        return LoraBatchMeta(
            token_slots=self.token_slots, sorted_token_ids=self.sorted_token_ids,
            segment_slots=pad(self.segment_slots, 0),
            segment_starts=pad(self.segment_starts, self.num_active_tokens),
            segment_lens=pad(self.segment_lens, 0), num_segments=num_segments,
            max_segment_len=max_segment_len, num_active_tokens=self.num_active_tokens,
            segments=self.segments, segment_table=self._padded_table(num_segments),
            token_table=self.token_table)

    def _padded_table(self, num_segments: int) -> torch.Tensor | None:
        table = self.segment_table
        if table is None or table.shape[0] >= num_segments:
            return table
        empty = torch.zeros(num_segments - table.shape[0], table.shape[1], dtype=table.dtype,
                            device=table.device)
        return torch.cat([table, empty])
