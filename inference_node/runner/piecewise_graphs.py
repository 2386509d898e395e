"""Prefill and mixed steps replayed from CUDA graphs piece by piece, attention run between.

A step that carries prompt tokens (prefill chunks, maybe beside decodes) cannot replay a
decode graph: its attention depends on how its tokens split into sequences. Run eagerly, its
forward is a few hundred launches from Python, most of them Triton's (tens of microseconds of
host each), and under a stream of arrivals such steps are many. Here, as in vLLM's V1, the
forward is cut at attention: everything between two attentions (o with its LoRA, the residual
add and norm, the MLP with its LoRA, the next layer's q/k/v with its LoRA, RoPE and the KV
write) is one CUDA graph, captured once per token bucket and LoRA variant, and attention runs
eagerly between the replays with the step's exact sequences, reading and writing static
buffers. A step costs its layers' count of graph replays and attention launches.

What makes a piece capturable: its token count is fixed by the bucket the step pads to
(padding tokens write their K/V into the scratch block and are never read), the rows that
sample are gathered through a static index buffer padded to a rows bucket, and the LoRA
kernels are sized for the bucket: every adapter's tokens are cut into segments of at most
`lora_rows(bucket)` rows (several segments may share an adapter), at most `lora_segments`
of them, each walked by one row of programs that reads its real length from device memory.
So the LoRA launches keep a bucket's worth of programs that work whatever the step's mix of
adapters, instead of a grid of segments x row tiles that mostly exit.

On a CPU the same static-buffer path runs without capture, so CI tests its padding and
metadata.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from kernels.dispatch import use_triton
from kernels.lora import LoraBatchMeta

from ..model.forward import Decoder, ForwardBatch, LoraApplier
from ..engine.kv_cache import KVCache
from ..engine.request import PENDING_TOKEN
from .launches import StepLaunches
from .sampler import checked_greedy
from .staging import HostInputs, HostTurns
from ..engine.scheduler import ScheduledChunk

log = logging.getLogger(__name__)

MIN_BUCKET = 16      # the smallest token bucket (and rows bucket)
ROWS_GROWTH = 4      # rows buckets: 16, 64, 256, ... up to the bucket's own size
_ALIGN_BYTES = 16    # each packed input starts on a 16-byte boundary (Triton specialises on it)


# The pieces' variants: no LoRA, the projections' LoRA, and (a node with expert arenas) the
# experts' LoRA too: its routed experts give up their fused epilogues for it, so steps whose
# adapters have none keep the LORA variant.
BASE, LORA, EXPERTS = 0, 1, 2


@dataclass(frozen=True)
class PiecewiseLora:
    """What the piecewise graphs need of the LoRA step plan (inference_node/runner/lora)."""

    applier: Callable[[LoraBatchMeta, bool], LoraApplier]  # adds each delta after its matmul (and the experts')
    max_loras: int                                         # adapter slots: a step's most adapters
    has_experts: Callable[[list[int]], bool] | None = None  # whether slots' adapters have expert LoRA (None: no arenas)


def token_buckets(max_tokens: int) -> list[int]:
    """16, 32, 64, ... doubling below max_tokens, then max_tokens: a step pads to the next
    one up (at most twice its tokens: a padded token costs compute, and tokens are few next
    to the weights' bytes in the small buckets)."""
    sizes, size = [], MIN_BUCKET
    while size < max_tokens:
        sizes.append(size)
        size *= 2
    return sizes + [max_tokens]


def rows_buckets(bucket: int, max_seqs: int) -> list[int]:
    """Sampled-row counts a bucket's last piece is captured for: 16, 64, 256, ... up to the
    most rows a step of `bucket` tokens can sample. The LM head's cost grows with its rows;
    a prefill step samples few, a mixed step one per decode."""
    cap = min(bucket, max_seqs)
    sizes, size = [], MIN_BUCKET
    while size < cap:
        sizes.append(size)
        size *= ROWS_GROWTH
    return sizes + [cap]


def lora_rows(bucket: int) -> int:
    """Rows of a LoRA segment in this bucket: 16 up to 512 tokens (about 32 segments of
    programs for the bucket's tokens), then 32 and 64 (tiles the kernels take)."""
    return 16 if bucket <= 512 else 32 if bucket <= 1024 else 64


def lora_segments(bucket: int, max_loras: int) -> int:
    """The most segments a step of `bucket` tokens cuts into: each adapter's tokens in runs
    of lora_rows, the last run of each partial."""
    rows = lora_rows(bucket)
    return min(bucket, -(-bucket // rows) + max_loras)


def _aligned(sizes: list[int], itemsize: int) -> list[int]:
    """Offsets (in elements) of parts of these sizes packed one after another, each aligned."""
    unit = _ALIGN_BYTES // itemsize
    offsets, at = [], 0
    for size in sizes:
        offsets.append(at)
        at += -(-size // unit) * unit
    return offsets + [at]


@dataclass
class StepShape:
    """What a filled step replays: its bucket and rows bucket, its variant (BASE, LORA,
    EXPERTS), and what its attention needs on the host."""

    bucket: int
    rows: int
    variant: int
    tokens: int
    seqs: int
    sampled: int
    max_query_len: int
    max_seq_len: int


@dataclass(frozen=True)
class StagedPieces:
    """A step's packed inputs as rank 0 staged them: what another tensor-parallel rank needs
    to run the same pieces (its token ids come from rank 0 inside piece 0)."""

    shape: StepShape
    width: int                         # block-table entries per sequence
    int64: np.ndarray                  # HostInputs.np64
    int32: np.ndarray                  # HostInputs.np32
    table: np.ndarray                  # the packed block tables, sequences x width
    segments: tuple[tuple[int, int, int, int], ...]  # the CPU reference kernels' host segments


class PiecewiseGraphs:
    def __init__(self, model: Decoder, launches: StepLaunches, kv: KVCache, scratch_block: int,
                 max_model_len: int, max_tokens: int, max_seqs: int, feedback: torch.Tensor | None = None,
                 lora: PiecewiseLora | None = None) -> None:
        """max_tokens / max_seqs: the most tokens and sequences a step holds (the engine's
        max_num_batched_tokens and max_num_seqs). lora: None for a node without LoRA."""
        self.model, self.launches, self.kv, self.lora = model, launches, kv, lora
        self.block_size = kv.block_size
        self.max_blocks = -(-max_model_len // self.block_size)
        self.scratch_slot = scratch_block * self.block_size
        self.buckets = token_buckets(max_tokens)
        self.max_tokens, self.max_seqs = self.buckets[-1], max_seqs
        self.num_layers = model.config.num_layers
        self.max_loras = lora.max_loras if lora is not None else 0
        self.capture = model.device.type == "cuda"
        self.replays: dict[tuple[int, int, int], int] = {}  # (bucket, variant, rows): count
        device, cfg = model.device, model.config
        T, B = self.max_tokens, max_seqs
        S = max((lora_segments(b, self.max_loras) for b in self.buckets), default=0) if lora else 0
        self.feedback = feedback if feedback is not None else torch.zeros(1, dtype=torch.long, device=device)
        # Packed inputs: one host->device copy per dtype per step. int64: input ids,
        # positions, KV slots, feedback rows (per token), the sampled rows (per sequence).
        o64 = _aligned([T, T, T, T, B], 8)
        # int32: query starts, sequence lengths (per sequence), then the LoRA metadata: token
        # slots, sorted token ids (per token), segment slots, starts and lengths.
        o32 = _aligned([B + 1, B, T, T, S, S, S], 4)
        self._dev64 = torch.zeros(o64[-1], dtype=torch.int64, device=device)
        self._dev32 = torch.zeros(o32[-1], dtype=torch.int32, device=device)
        self._o64, self._o32 = o64, o32
        (self.input_ids, self.positions, self.slot_mapping, self.feedback_rows,
         self.logits_indices) = (self._dev64[o64[i]:o64[i] + n] for i, n in enumerate([T, T, T, T, B]))
        (self.query_start_loc, self.seq_lens, self.token_slots, self.sorted_ids, self.seg_slots,
         self.seg_starts, self.seg_lens) = (self._dev32[o32[i]:o32[i] + n]
                                            for i, n in enumerate([B + 1, B, T, T, S, S, S]))
        self.block_tables = torch.zeros(B, self.max_blocks, dtype=torch.int32, device=device)
        # What flows between the pieces: the residual stream, the queries attention reads and
        # the output it writes; and what the last piece leaves for the sampler.
        self.hidden = torch.zeros(T, cfg.hidden_size, dtype=model.dtype, device=device)
        self.q = torch.zeros(T, cfg.num_heads, cfg.head_dim, dtype=model.dtype, device=device)
        self.attn = torch.zeros(T, cfg.num_heads, cfg.head_dim, dtype=model.dtype, device=device)
        max_rows = rows_buckets(T, B)[-1]
        self.logits = torch.zeros(max_rows, cfg.vocab_size, dtype=model.dtype, device=device)  # all ranks' blocks
        self.greedy = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.finite = torch.zeros(max_rows, dtype=torch.bool, device=device)
        self._host = HostTurns(o64[-1], o32[-1], B * self.max_blocks, self.capture)
        self._host_segments: tuple[tuple[int, int, int, int], ...] = ()
        self._graphs: dict[tuple[int, int, int, int], torch.cuda.CUDAGraph] = {}

    # -- the step ------------------------------------------------------------------------------
    def fits(self, chunks: list[ScheduledChunk]) -> bool:
        return (0 < len(chunks) <= self.max_seqs
                and sum(c.num_new_tokens for c in chunks) <= self.max_tokens)

    def stage(self, chunks: list[ScheduledChunk]) -> StagedPieces:
        """Writes the step's inputs into the pieces' buffers (their copies queued) and picks
        its bucket and rows bucket."""
        shape, host, width = self._fill(chunks)
        return StagedPieces(shape, width, host.np64, host.np32, host.np_table[:shape.seqs * width],
                            self._host_segments if shape.variant else ())

    def load(self, staged: StagedPieces) -> None:
        """Writes the inputs another rank staged into the pieces' buffers (a tensor-parallel
        rank: rank 0 scheduled the step and sent its packed inputs)."""
        host = self._host.next()
        host.load(staged.int64, staged.int32, staged.table)
        self._host_segments = staged.segments
        host.copy_packed(staged.shape.seqs, staged.width, self._dev64, self._dev32, self.block_tables)

    def run(self, staged: StagedPieces) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The staged step's pieces, with attention between them: logits [sampled rows, vocab]
        (rows in chunk order, of the chunks that complete their prompt), each row's greedy
        token and whether its logits are finite (sampler.checked_greedy, inside the last
        piece). Under tensor parallelism every rank's pieces meet the others' at their
        collectives."""
        step = staged.shape
        key = (step.bucket, step.variant, step.rows)
        self.replays[key] = self.replays.get(key, 0) + 1
        n, t = step.seqs, step.tokens
        attention = ForwardBatch(
            input_ids=self.input_ids[:t], positions=self.positions[:t],
            slot_mapping=self.slot_mapping[:t], block_tables=self.block_tables[:n],
            query_start_loc=self.query_start_loc[:n + 1], seq_lens=self.seq_lens[:n],
            logits_indices=None, max_query_len=step.max_query_len, max_seq_len=step.max_seq_len)
        # The bucket's launch choices, as captured (a LoRA graph serves any count of adapters:
        # it takes the tuning table's bucket for one).
        launch = self.launches.for_step(step.bucket, min(step.variant, LORA))
        with torch.inference_mode():
            for layer in range(self.num_layers):
                self._replay(step.bucket, step.variant, layer, 0)
                self.model.attend(layer, self.q[:t], attention, self.kv.k, self.kv.v, launch, out=self.attn[:t])
            self._replay(step.bucket, step.variant, self.num_layers, step.rows)
        k = step.sampled
        return self.logits[:k], self.greedy[:k], self.finite[:k]

    def _replay(self, bucket: int, lora: int, piece: int, rows: int) -> None:
        if self.capture:
            self._graphs[(bucket, lora, piece, rows)].replay()
        else:
            self._piece(bucket, lora, piece, rows)

    def _fill(self, chunks: list[ScheduledChunk]) -> tuple[StepShape, HostInputs, int]:
        """Writes the step's inputs into the next pinned buffers and queues their copies;
        (the step's shape, the host buffers, the block tables' width)."""
        bs = self.block_size
        host = self._host.next()
        ids: list[int] = []
        feedback_rows: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        sampled: list[int] = []
        tables: list[list[int]] = []
        for c in chunks:
            req, start, k = c.request, c.request.num_computed, c.num_new_tokens
            end = start + k
            blocks = req.block_ids
            tables.append(blocks)
            if k == 1:  # a decode row (or a prompt's last token)
                token = req.token_at(start)
                pending = token == PENDING_TOKEN
                ids.append(0 if pending else token)
                feedback_rows.append(req.feedback_row if pending else -1)
                positions.append(start)
                slots.append(blocks[start // bs] * bs + start % bs)
            else:
                prompt = req.prompt_token_ids
                known = prompt[start:end] if end <= len(prompt) else req.all_token_ids[start:end]
                ids += known
                feedback_rows += [-1] * len(known)
                if len(known) < k:  # the last token: sampled by the step still in flight
                    if k - len(known) > 1:
                        raise RuntimeError(f"request {req.id}: its input token is still on the device")
                    ids.append(0)
                    feedback_rows.append(req.feedback_row)
                positions += range(start, end)
                slots += [blocks[p // bs] * bs + p % bs for p in range(start, end)]
            query_start.append(query_start[-1] + k)
            seq_lens.append(end)
            if c.completes_prompt:
                sampled.append(query_start[-1] - 1)
        n, tokens = len(chunks), query_start[-1]
        bucket = next(b for b in self.buckets if b >= tokens)
        rows = next(r for r in rows_buckets(bucket, self.max_seqs) if r >= len(sampled))
        o64, o32, h64, h32 = self._o64, self._o32, host.np64, host.np32
        for part, values in enumerate((ids, positions, slots, feedback_rows)):
            at = o64[part]
            h64[at:at + tokens] = values
        # Padding tokens: token 0 at position 0, K/V written into the scratch block.
        h64[o64[0] + tokens:o64[0] + bucket] = 0
        h64[o64[1] + tokens:o64[1] + bucket] = 0
        h64[o64[2] + tokens:o64[2] + bucket] = self.scratch_slot
        h64[o64[3] + tokens:o64[3] + bucket] = -1
        h64[o64[4]:o64[4] + len(sampled)] = sampled
        h64[o64[4] + len(sampled):o64[4] + rows] = 0  # padding rows: any valid row
        h32[o32[0]:o32[0] + n + 1] = query_start
        h32[o32[1]:o32[1] + n] = seq_lens
        variant = BASE
        if self.lora is not None and any(c.request.lora_slot >= 0 for c in chunks):
            has_experts = self.lora.has_experts
            variant = EXPERTS if has_experts and has_experts([c.request.lora_slot for c in chunks]) else LORA
            token_slots: list[int] = []
            for c in chunks:
                token_slots += [c.request.lora_slot] * c.num_new_tokens
            self._fill_lora(h32, np.asarray(token_slots, dtype=np.int32), bucket)
        width = host.upload(tables, self._dev64, self._dev32, self.block_tables)
        return StepShape(bucket, rows, variant, tokens, n, len(sampled),
                         max(c.num_new_tokens for c in chunks), max(seq_lens)), host, width

    def _fill_lora(self, h32: np.ndarray, token_slots: np.ndarray, bucket: int) -> None:
        """Token slots, and each adapter's tokens (batch order kept) cut into segments of at
        most lora_rows(bucket) rows; empty segments up to the bucket's count."""
        o32, tokens = self._o32, len(token_slots)
        active = np.flatnonzero(token_slots >= 0)
        order = np.argsort(token_slots[active], kind="stable")
        sorted_ids = active[order]
        sorted_slots = token_slots[sorted_ids]
        rows = lora_rows(bucket)
        segments: list[tuple[int, int, int, int]] = []
        bounds = np.flatnonzero(np.diff(sorted_slots)) + 1
        runs = zip([0, *bounds.tolist()], [*bounds.tolist(), len(sorted_ids)]) if len(sorted_ids) else ()
        for lo, hi in runs:
            slot = int(sorted_slots[lo])
            for start in range(lo, hi, rows):
                length = min(rows, hi - start)
                first = int(sorted_ids[start])
                contiguous = int(sorted_ids[start + length - 1]) - first == length - 1
                segments.append((slot, start, length, first if contiguous else -1))
        count = lora_segments(bucket, self.max_loras)
        assert len(segments) <= count, f"{len(segments)} LoRA segments, the bucket holds {count}"
        h32[o32[2]:o32[2] + tokens] = token_slots
        h32[o32[2] + tokens:o32[2] + bucket] = -1
        h32[o32[3]:o32[3] + len(sorted_ids)] = sorted_ids
        real = len(segments)
        h32[o32[4]:o32[4] + real] = [s[0] for s in segments]
        h32[o32[4] + real:o32[4] + count] = 0
        h32[o32[5]:o32[5] + real] = [s[1] for s in segments]
        h32[o32[5] + real:o32[5] + count] = len(sorted_ids)
        h32[o32[6]:o32[6] + real] = [s[2] for s in segments]
        h32[o32[6] + real:o32[6] + count] = 0
        # The reference kernels (CPU) walk host copies of the segments; Triton reads the buffers.
        self._host_segments = tuple(segments)

    # -- the pieces ----------------------------------------------------------------------------
    def _piece(self, bucket: int, lora: int, piece: int, rows: int) -> None:
        """Piece 0: the embedding and layer 0's q/k/v. Piece i (1..layers-1): layer i-1 after
        its attention, then layer i's q/k/v. The last: the last layer after its attention,
        the final norm, the sampled rows' logits and their greedy tokens."""
        model, launch, b = self.model, self.launches.for_step(bucket, min(lora, LORA)), bucket
        batch = ForwardBatch(
            input_ids=self.input_ids[:b], positions=self.positions[:b],
            slot_mapping=self.slot_mapping[:b], block_tables=self.block_tables,
            query_start_loc=self.query_start_loc, seq_lens=self.seq_lens,
            logits_indices=self.logits_indices[:rows], max_query_len=0, max_seq_len=0,
            feedback=self.feedback, feedback_rows=self.feedback_rows[:b])
        applier = self._applier(b, lora == EXPERTS) if lora else None
        if piece == 0:
            hidden, x = model.embed_inputs(batch, launch)
        else:
            attn = self.attn[:b].view(b, -1)
            hidden, x = model.after_attention(piece - 1, attn, self.hidden[:b], launch, applier)
        if piece < self.num_layers:
            model.attention_inputs(piece, x, batch, self.kv.k, self.kv.v, launch, applier, q_out=self.q[:b])
            self.hidden[:b].copy_(hidden)
            return
        logits = model.logits(x, batch.logits_indices, out=self.logits[:rows])
        greedy, finite = checked_greedy(logits)
        self.greedy[:rows].copy_(greedy)
        self.finite[:rows].copy_(finite)

    def _applier(self, bucket: int, experts: bool) -> LoraApplier:
        """The eager applier over the bucket's static metadata: every token a LoRA row, the
        bucket's count of segments of at most lora_rows rows (the kernels read their real
        lengths; empty ones exit at once); with the experts' LoRA where `experts`."""
        segments = lora_segments(bucket, self.max_loras)
        meta = LoraBatchMeta(
            token_slots=self.token_slots[:bucket], sorted_token_ids=self.sorted_ids[:bucket],
            segment_slots=self.seg_slots[:segments], segment_starts=self.seg_starts[:segments],
            segment_lens=self.seg_lens[:segments], num_segments=segments,
            max_segment_len=lora_rows(bucket), num_active_tokens=bucket,
            segments=() if self.capture else self._host_segments)
        return self.lora.applier(meta, experts)

    # -- capture ---------------------------------------------------------------------------------
    def variants(self) -> list[int]:
        if self.lora is None:
            return [BASE]
        return [BASE, LORA] + ([EXPERTS] if self.lora.has_experts is not None else [])

    def keys(self) -> list[tuple[int, int, int, int]]:
        """Every graph: (bucket, variant, piece, rows; rows 0 but for the last piece), largest
        bucket first."""
        variants = self.variants()
        out = []
        for bucket in reversed(self.buckets):
            for lora in variants:
                out += [(bucket, lora, piece, 0) for piece in range(self.num_layers)]
                out += [(bucket, lora, self.num_layers, rows)
                        for rows in rows_buckets(bucket, self.max_seqs)]
        return out

    def capture_all(self) -> None:
        """Records every piece's graph, sharing one memory pool (a piece's activations are
        freed when its capture ends, so the pool holds about one piece's worth). Where Triton
        runs the pieces without capture (its interpreter), runs each once instead: their
        kernels' variants are then launched at start, as a GPU's capture launches them."""
        if not self.capture:
            if use_triton(self.hidden):
                with torch.inference_mode():
                    for key in self.keys():
                        self._piece(*key)
            return
        started = time.monotonic()
        self._dev64.zero_()
        T = self.max_tokens
        o64 = self._o64
        self._dev64[o64[2]:o64[2] + T] = self.scratch_slot
        self._dev64[o64[3]:o64[3] + T] = -1
        self._dev32.zero_()  # every LoRA segment empty: captured launches do nothing
        self.block_tables.zero_()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.model.device)
        # Under tensor parallelism NCCL's watchdog thread polls events during a capture.
        mode = "thread_local" if self.model.tp is not None else "global"
        with torch.inference_mode():
            for key in self.keys():
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):  # warm-up: Triton compiles outside the capture
                    self._piece(*key)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode=mode):
                    self._piece(*key)
                self._graphs[key] = graph
        torch.cuda.synchronize()
        log.info("captured %d piecewise CUDA graphs for prefill and mixed steps (token buckets %s%s) "
                 "in %.1fs", len(self._graphs), ",".join(map(str, self.buckets)),
                 ", with and without LoRA" + (" (and the experts')" if len(self.variants()) > 2 else "")
                 if self.lora is not None else "", time.monotonic() - started)
