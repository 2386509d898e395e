"""Decode steps replayed from CUDA graphs, one per padded batch size, with and without LoRA.

A decode step launches a few hundred small kernels; at serving batch sizes their launch cost,
not the bytes they move, would set the step time. A graph records one step per batch size
over static input buffers; each later step writes its inputs into those buffers (three host-
to-device copies) and replays the whole forward with one launch.

What makes a step capturable: every shape is fixed by the padded batch size (rows past the
real ones write their K/V into a scratch block and are never read), the attention kernel is
sized for the longest context the node allows, and the LoRA kernels are sized for a bucket of
distinct adapters (one graph per bucket), reading the real segments' lengths from device memory.
A LoRA step's rows are ordered by adapter slot (`ordered`), so each adapter's rows are one
contiguous run and the kernels read a segment's slot, rows and ranks from one row of a
segment table (kernels/lora/meta.py) rather than through chains of dependent loads.
LoRA graphs also come in variants by the fused projection groups they apply (LORA_GROUP_
VARIANTS): a step whose adapters only target q/k/v (PEFT's default for Llama is q and v)
replays a graph with no o or MLP launches.

On a CPU the same static-buffer path runs eagerly (no capture), so CI tests the padding and
the metadata that the GPU graphs replay.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from kernels.lora import MODULE_COLUMNS, SEGMENT_TABLE_RANKS, LoraBatchMeta

from ..model.forward import Decoder, ForwardBatch, LoraApplier
from ..model.llama import FUSED_MODULES, LORA_MODULES
from ..engine.kv_cache import KVCache
from ..engine.request import PENDING_TOKEN
from .launches import StepLaunches
from .sampler import checked_greedy
from .staging import HostInputs, HostTurns
from ..engine.scheduler import ScheduledChunk

log = logging.getLogger(__name__)

ApplierFactory = Callable[[LoraBatchMeta, frozenset[str]], LoraApplier]
GroupsOf = Callable[[list[int]], frozenset[str]]


@dataclass(frozen=True)
class StagedDecode:
    """A decode step's packed inputs as rank 0 staged them: what another tensor-parallel rank
    needs to replay the same graph (its token ids come from rank 0 inside the graph)."""

    key: tuple[int, int, int]          # (padded size, LoRA segments, group variant)
    rows: int                          # the real rows
    width: int                         # block-table entries per row
    int64: np.ndarray                  # HostInputs.np64
    int32: np.ndarray                  # HostInputs.np32
    table: np.ndarray                  # the packed block tables, rows x width
    segments: tuple[tuple[int, int, int, int], ...]  # the CPU reference kernels' host segments


@dataclass(frozen=True)
class GraphLora:
    """What the decode graphs need of the LoRA step plan (inference_node/runner/lora)."""

    applier: ApplierFactory   # (metadata in static buffers, groups) -> the step's applier
    max_loras: int            # adapter slots: a step's most distinct adapters
    groups_of: GroupsOf       # the fused groups the adapters in these slots target (EXPERTS too)
    # Host mirror of each slot's (rank, first arena row) per module ([slot, (rank, row) x
    # LORA_MODULES], kept current by the adapter manager): the LoRA kernels read a step's
    # segments and each row's adapter rows from tables built from it.
    module_rows: np.ndarray

# Which fused groups a LoRA graph applies, smallest first; a step replays the first variant
# that covers every group its adapters target. The last one is all of them. On a mixture of
# experts with expert arenas, one more applies the experts' LoRA too (EXPERTS: its steps'
# routed experts give up their fused epilogues, so the other steps keep graphs without it).
ALL_GROUPS = frozenset(FUSED_MODULES)
EXPERTS = "experts"
LORA_GROUP_VARIANTS: tuple[frozenset[str], ...] = (
    frozenset({"qkv"}), frozenset({"qkv", "o"}), ALL_GROUPS)
EXPERT_VARIANTS = LORA_GROUP_VARIANTS + (ALL_GROUPS | {EXPERTS},)

# The graphs' main branch (base matmuls, attention, norms) is captured on a high-priority
# stream, so when LoRA runs beside it on a side stream (adapters/overlap.py) the GPU serves
# the critical path first and LoRA fills in (equal priorities measured slower:
# docs/PERFORMANCE.md). The graphs keep capture-time priorities.
MAIN_STREAM_PRIORITY = -1

# The LoRA segment table's width (slot, first row, length, a rank and first arena row per
# module), the token table's (a rank and first arena row per module), and the int32 inputs of
# a step per batch row: sequence length, then the LoRA metadata (token slots, sorted ids,
# segment slots, starts, lengths), then the segment table, then the token table.
TOKEN_TABLE_WIDTH = MODULE_COLUMNS * len(LORA_MODULES)
SEGMENT_TABLE_WIDTH = SEGMENT_TABLE_RANKS + TOKEN_TABLE_WIDTH
INT32_ROWS = 6 + SEGMENT_TABLE_WIDTH + TOKEN_TABLE_WIDTH


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64, every 16 up to 128, every 32 beyond: a decode step
    pads to the next size up (a padded row costs compute, not another read of the weights)."""
    sizes = ([s for s in (1, 2, 4) if s < max_batch] + list(range(8, min(max_batch, 64), 8))
             + list(range(64, min(max_batch, 128), 16)) + list(range(128, max_batch, 32)))
    return sorted(set(sizes + [max_batch]))


def is_decode_step(chunks: list[ScheduledChunk]) -> bool:
    return all(c.num_new_tokens == 1 and c.completes_prompt for c in chunks)


def ordered(chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
    """A decode step's rows grouped by adapter slot (base-model rows first, then each slot's
    rows in their order): the order `DecodeGraphs.stage` takes them in."""
    return sorted(chunks, key=lambda c: c.request.lora_slot)


class DecodeGraphs:
    def __init__(self, model: Decoder, launches: StepLaunches, kv: KVCache, scratch_block: int,
                 max_model_len: int, max_batch: int, lora: GraphLora | None = None,
                 feedback: torch.Tensor | None = None,
                 group_variants: tuple[frozenset[str], ...] = LORA_GROUP_VARIANTS) -> None:
        """lora: None for a node without LoRA (base graphs only). group_variants: the LoRA
        graphs' group variants, the last one all groups."""
        self.model, self.launches, self.kv = model, launches, kv
        self.block_size = kv.block_size
        self.max_blocks = -(-max_model_len // self.block_size)
        self.max_seq_len = self.max_blocks * self.block_size
        self.scratch_slot = scratch_block * self.block_size
        self.sizes = graph_batch_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.lora = lora
        self.max_loras = lora.max_loras if lora is not None else 0
        self.group_variants = group_variants if lora is not None else (ALL_GROUPS,)
        assert ALL_GROUPS <= self.group_variants[-1], "the last variant must apply every group"
        self.replays: dict[tuple[int, int, int], int] = {}  # (size, segments, variant): count
        self.capture = model.device.type == "cuda"
        device, B = model.device, self.max_batch
        # The tokens the previous step sampled (token_feedback.py); a row whose token is
        # still on the device reads it from there inside the graph.
        self.feedback = feedback if feedback is not None else torch.zeros(1, dtype=torch.long, device=device)
        # Packed inputs: one host->device copy per dtype per step.
        self._dev64 = torch.zeros(4 * B, dtype=torch.int64, device=device)
        self._dev32 = torch.zeros(INT32_ROWS * B, dtype=torch.int32, device=device)
        self.input_ids, self.positions, self.slot_mapping, self.feedback_rows = self._dev64.split(B)
        (self.seq_lens, self.token_slots, self.sorted_ids, self.seg_slots, self.seg_starts,
         self.seg_lens) = self._dev32[:6 * B].split(B)
        tables = 6 * B + SEGMENT_TABLE_WIDTH * B
        self.seg_table = self._dev32[6 * B:tables].view(B, SEGMENT_TABLE_WIDTH)
        self.token_table = self._dev32[tables:].view(B, TOKEN_TABLE_WIDTH)
        self.block_tables = torch.zeros(B, self.max_blocks, dtype=torch.int32, device=device)
        self._host = HostTurns(4 * B, INT32_ROWS * B, B * self.max_blocks, self.capture)
        self.query_start_loc = torch.arange(B + 1, dtype=torch.int32, device=device)
        self._graphs: dict[tuple[int, int, int],
                           tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._host_segments: tuple[tuple[int, int, int, int], ...] = ()

    # -- the step ------------------------------------------------------------------------------
    def fits(self, chunks: list[ScheduledChunk]) -> bool:
        return 0 < len(chunks) <= self.max_batch and is_decode_step(chunks)

    def stage(self, chunks: list[ScheduledChunk]) -> StagedDecode:
        """Writes the inputs of a decode step whose rows are `ordered` into the graph's
        buffers (their copies queued) and picks its graph."""
        n = len(chunks)
        size = next(s for s in self.sizes if s >= n)
        slots = {c.request.lora_slot for c in chunks if c.request.lora_slot >= 0}
        segments = variant = 0
        if slots and self.lora is not None:
            segments = next(b for b in self.segment_buckets(size) if b >= len(slots))
            variant = self.variant_for(slots)
        host, width = self._fill(chunks, size, segments)
        return StagedDecode((size, segments, variant), n, width, host.np64, host.np32,
                            host.np_table[:n * width], self._host_segments)

    def load(self, step: StagedDecode) -> None:
        """Writes the inputs another rank staged into the graph's buffers (a tensor-parallel
        rank: rank 0 scheduled the step and sent its packed inputs)."""
        host = self._host.next()
        host.load(step.int64, step.int32, step.table)
        self._host_segments = step.segments
        host.copy_packed(step.rows, step.width, self._dev64, self._dev32, self.block_tables)

    def run(self, step: StagedDecode) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Replays the staged step's graph: its logits [rows, vocab], each row's greedy token
        and whether its logits are finite (sampler.checked_greedy, computed inside the graph:
        no launches of their own). Under tensor parallelism every rank's replay meets the
        others' at the graph's collectives."""
        key, n = step.key, step.rows
        self.replays[key] = self.replays.get(key, 0) + 1
        if not self.capture:
            logits = self._forward(*key)[:n]
            return (logits, *checked_greedy(logits))
        graph, logits, greedy, finite = self._graphs[key]
        graph.replay()
        return logits[:n], greedy[:n], finite[:n]

    def variant_for(self, slots: set[int]) -> int:
        """Index of the smallest group variant that covers what these adapter slots target."""
        groups = self.lora.groups_of(list(slots))
        return next(i for i, v in enumerate(self.group_variants) if groups <= v)

    def _fill(self, chunks: list[ScheduledChunk], size: int, segments: int) -> tuple[HostInputs, int]:
        """Writes the step's inputs and queues their copy; (the host buffers, block-table width)."""
        B, n, bs = self.max_batch, len(chunks), self.block_size
        host = self._host.next()
        reqs = [c.request for c in chunks]
        pos = [r.num_computed for r in reqs]
        tables = [r.block_ids for r in reqs]
        h64, h32 = host.np64, host.np32
        tokens = [r.token_at(p) for r, p in zip(reqs, pos)]
        h64[0:n] = tokens
        h64[B:B + n] = pos
        h64[2 * B:2 * B + n] = [t[p // bs] * bs + p % bs for t, p in zip(tables, pos)]
        # A row whose token the previous step sampled reads it on the device (-1: from input_ids).
        h64[3 * B:3 * B + n] = [-1 if t != PENDING_TOKEN else r.feedback_row for t, r in zip(tokens, reqs)]
        if size > n:  # padding rows: token 0 at position 0, K/V written into the scratch block
            h64[n:size] = 0
            h64[B + n:B + size] = 0
            h64[2 * B + n:2 * B + size] = self.scratch_slot
            h64[3 * B + n:3 * B + size] = -1
        h32[0:n] = [p + 1 for p in pos]
        h32[n:size] = 1
        if segments:
            self._fill_lora(h32[B:], [r.lora_slot for r in reqs], size, segments)
        return host, host.upload(tables, self._dev64, self._dev32, self.block_tables)

    def _fill_lora(self, h32: np.ndarray, token_slots: list[int], size: int, segments: int) -> None:
        """Token slots, the per-slot segments (real ones first, then empty ones) and each
        row's adapter's rows (the token table; zeros for rows without one and padding)."""
        B = self.max_batch
        groups: dict[int, list[int]] = {}
        for row, slot in enumerate(token_slots):
            if slot >= 0:
                groups.setdefault(slot, []).append(row)
        order = sorted(groups)
        sorted_ids = [row for slot in order for row in groups[slot]]
        starts, start = [], 0
        for slot in order:
            starts.append(start)
            start += len(groups[slot])
        # The reference kernels (CPU) walk host copies of the groups (slicing a contiguous
        # group's rows instead of gathering them); Triton reads the buffers.
        firsts = [rows[0] if rows[-1] - rows[0] == len(rows) - 1 else -1
                  for rows in (groups[slot] for slot in order)]
        self._host_segments = tuple((slot, st, len(groups[slot]), first)
                                    for slot, st, first in zip(order, starts, firsts))
        n, real = len(token_slots), len(order)
        h32[0:n] = token_slots
        h32[n:size] = -1
        h32[B:B + len(sorted_ids)] = sorted_ids
        h32[B + len(sorted_ids):B + size] = 0
        h32[2 * B:2 * B + real] = order
        h32[2 * B + real:2 * B + segments] = 0
        h32[3 * B:3 * B + real] = starts
        h32[3 * B + real:3 * B + segments] = len(sorted_ids)
        h32[4 * B:4 * B + real] = [len(groups[s]) for s in order]
        h32[4 * B + real:4 * B + segments] = 0
        # The segment table: each slot's rows must be one run (ordered() sorts them).
        table = h32[5 * B:5 * B + segments * SEGMENT_TABLE_WIDTH].reshape(segments,
                                                                          SEGMENT_TABLE_WIDTH)
        for i, (slot, first) in enumerate(zip(order, firsts)):
            if first < 0:
                raise ValueError("a LoRA decode step's rows must be grouped by adapter slot "
                                 "(DecodeGraphs.ordered)")
            table[i, :SEGMENT_TABLE_RANKS] = (slot, first, len(groups[slot]))
            table[i, SEGMENT_TABLE_RANKS:] = self.lora.module_rows[slot]
        table[real:] = 0
        start = 5 * B + B * SEGMENT_TABLE_WIDTH
        rows = h32[start:start + size * TOKEN_TABLE_WIDTH].reshape(size, TOKEN_TABLE_WIDTH)
        slots = np.asarray(token_slots, dtype=np.int64)
        rows[:n] = self.lora.module_rows[np.maximum(slots, 0)]
        rows[:n][slots < 0] = 0
        rows[n:] = 0

    def segment_buckets(self, size: int) -> list[int]:
        """LoRA graphs per batch size, by distinct adapters in the step (1, 2, 4, ... up to
        the most a step of this size can hold): launches sized to the step, not the worst case."""
        cap = max(1, min(size, self.max_loras))
        return sorted({b for b in (1 << i for i in range(cap.bit_length())) if b < cap} | {cap})

    def _forward(self, size: int, segments: int, variant: int = 0) -> torch.Tensor:
        """One padded decode forward; `segments` LoRA segments (0: the base path), applying
        the fused groups of group_variants[variant]."""
        batch = ForwardBatch(
            input_ids=self.input_ids[:size], feedback=self.feedback,
            feedback_rows=self.feedback_rows[:size], positions=self.positions[:size],
            slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:size],
            query_start_loc=self.query_start_loc[:size + 1], seq_lens=self.seq_lens[:size],
            logits_indices=None, max_query_len=1, max_seq_len=self.max_seq_len)  # every row samples
        applier = None
        if segments:
            # Sized for its bucket: every row active, `segments` groups of up to `size`
            # rows; the kernels read the real lengths (empty groups exit at once).
            meta = LoraBatchMeta(
                token_slots=self.token_slots[:size], sorted_token_ids=self.sorted_ids[:size],
                segment_slots=self.seg_slots[:segments], segment_starts=self.seg_starts[:segments],
                segment_lens=self.seg_lens[:segments], num_segments=segments, max_segment_len=size,
                num_active_tokens=size, segments=() if self.capture else self._host_segments,
                segment_table=self.seg_table[:segments], token_table=self.token_table[:size])
            applier = self.lora.applier(meta, self.group_variants[variant])
        # The launch choices of this bucket (the node's tuning table), fixed at capture.
        launch = self.launches.for_step(size, segments)
        return self.model.forward(batch, self.kv.k, self.kv.v, launch, applier)

    # -- capture ---------------------------------------------------------------------------------
    def capture_all(self) -> None:
        """Records every (size, LoRA or not) graph, largest first, sharing one memory pool."""
        if not self.capture:
            return
        started = time.monotonic()
        B = self.max_batch
        self._dev64.zero_()
        self._dev64[2 * B:3 * B] = self.scratch_slot
        self._dev64[3 * B:] = -1
        self._dev32.zero_()
        self._dev32[:B] = 1  # every segment empty: captured LoRA launches do nothing
        self.block_tables.zero_()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.model.device, priority=MAIN_STREAM_PRIORITY)
        # Under tensor parallelism the collectives' library has threads of its own (NCCL's
        # watchdog polls events): only this thread's calls may invalidate the capture.
        mode = "thread_local" if self.model.tp is not None else "global"
        for size in reversed(self.sizes):
            keys = [(size, 0, 0)]
            if self.lora is not None:
                keys += [(size, b, v) for b in self.segment_buckets(size) for v in range(len(self.group_variants))]
            for key in keys:
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):  # warm-up: Triton compiles outside the capture
                    self._forward(*key)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode=mode):
                    logits = self._forward(*key)
                    greedy, finite = checked_greedy(logits)
                self._graphs[key] = (graph, logits, greedy, finite)
        torch.cuda.synchronize()
        log.info("captured %d decode CUDA graphs (batch sizes %s%s) in %.1fs", len(self._graphs),
                 ",".join(map(str, self.sizes)),
                 ", without LoRA and by distinct adapters and targeted groups"
                 if self.lora is not None else "",
                 time.monotonic() - started)
