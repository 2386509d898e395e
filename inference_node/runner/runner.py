"""The model runner: everything between a scheduled step and its sampled tokens.

The engine hands it each step's chunks (engine/scheduler.py) and gets back the step's sampled
tokens, still on their way to the host (token_feedback.py). In between, the runner picks how
the step runs, stages its inputs that way, tells a tensor-parallel node's other ranks to run
the same (rank.py runs it there), runs the forward with the launch choices of the step's
bucket (launches.py) and samples. Three ways, tried in order:

- decode graphs (decode_graphs.py): decode-only steps up to the largest graph batch, one
  CUDA graph replay each;
- piecewise graphs (piecewise_graphs.py): other steps up to the token budget, CUDA graphs
  between attentions;
- eager (eager.py): what neither takes, or everything when both are off, and every step
  whose adapters have LoRA on the embedding or the LM head (lora/edge.py).

Each stages a step (`stage`: rank 0, from the chunks; `load`: another rank, from what rank 0
sent) and then runs it (`run`). On a CPU the graph ways run their static buffers without
capture. Before serving, `prepare` compiles the eager steps' kernels (warmup.py) and
captures the graphs, on every rank alike.

Sampling follows the forward at once, except in a step that samples a constrained request
(structured output): its mask depends on the token the previous step sampled, which the host
reads only after this step's forward is queued. Such a step's sampling waits for `sample`,
which the engine calls with the masks once it has read that token, while the device still
runs this step's forward; other steps pay nothing for it.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

from ..engine.config import EngineConfig
from ..engine.errors import RankLost
from ..engine.kv_cache import KVCache
from ..engine.request import Request
from ..engine.scheduler import ScheduledChunk
from ..model.forward import Decoder
from .decode_graphs import StagedDecode, ordered
from .eager import EagerForward, EagerStep
from .graph_plan import GraphPlan
from .launches import StepLaunches
from .lora.plan import LoraStepPlan
from .piecewise_graphs import StagedPieces
import torch

from .sampler import StepMasks, logprobs_on_device, row_finite, sample_on_device
from .token_feedback import SampledTokens, TokenFeedback
from .warmup import warm_up

Staged = StagedDecode | StagedPieces | EagerStep  # a step as rank 0 staged it, for every rank to run


class ForwardMode(enum.Enum):
    DECODE_GRAPHS = "decode graphs"
    PIECEWISE_GRAPHS = "piecewise graphs"
    EAGER = "eager"


@dataclass
class StepRun:
    """A launched step: its forward queued on the device, and its sampling unless it waits for
    masks (tokens None until `ModelRunner.sample`)."""

    chunks: list[ScheduledChunk]   # in the order of the step's rows
    sampled: list[Request]         # whose next token it samples, row by row (TokenFeedback's rows)
    tokens: SampledTokens | None
    mode: ForwardMode
    # The forward's logits, greedy tokens and finite flags, kept while sampling waits.
    outputs: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor] | None = None


class OtherRanks(Protocol):
    """A tensor-parallel node's ranks beside rank 0 (parallel/workers.py Workers): they run
    every step's forward with it (each staged step sent to them first) and hold the same
    adapter slots."""

    size: int
    table_checks: int
    def mirror(self, step: Staged) -> None: ...
    def capture_graphs(self, plan: GraphPlan) -> None: ...
    def check_slot_tables(self) -> None: ...
    def lost(self, wait_s: float) -> str | None: ...


class ModelRunner:
    def __init__(self, model: Decoder, launches: StepLaunches, config: EngineConfig,
                 lora: LoraStepPlan | None = None, ranks: OtherRanks | None = None) -> None:
        """lora: the steps' LoRA kernels (None: base model only). ranks: the other ranks of a
        tensor-parallel node (this runner is rank 0's)."""
        self.warms_up = config.warmup == "on" or (config.warmup == "auto" and model.device.type == "cuda")
        if ranks is not None and self.warms_up:
            raise ValueError("the warm-up's forwards are not run on every tensor-parallel rank: "
                             "a tensor-parallel engine takes warmup='off'")
        self.model, self.launches, self.config, self.lora, self.ranks = model, launches, config, lora, ranks
        self.warmup_forwards = 0  # synthetic eager forwards run at start (warmup.py)
        # One block more than the engine's allocator hands out: the scratch block of padded
        # graph rows (and of the warm-up's forwards).
        self.kv = KVCache(model.config, config.num_kv_blocks + 1, config.block_size, model.dtype, model.device)
        self.feedback = TokenFeedback(config.max_num_seqs, model.device)
        self.eager = EagerForward(model, launches, self.kv, lora, self.feedback.tokens)
        self.plan = GraphPlan.of(config)
        self.decode_graphs, self.piecewise_graphs = self.plan.build(model, launches, self.kv, lora,
                                                                    self.feedback.tokens)

    def prepare(self) -> None:
        """Compiles the eager steps' kernels (where the warm-up is on) and captures the graphs,
        the other ranks' beside these (their collectives meet)."""
        if self.warms_up:
            self.warm_up()
        if self.ranks is not None:
            self.ranks.capture_graphs(self.plan)
        if self.decode_graphs is not None:
            self.decode_graphs.capture_all()
        if self.piecewise_graphs is not None:
            self.piecewise_graphs.capture_all()

    def warm_up(self) -> None:
        self.warmup_forwards = warm_up(self.model, self.launches, self.kv, self.lora, self.config)

    def run(self, chunks: list[ScheduledChunk], special_rows: bool = False) -> StepRun:
        """Queues the step's forward and the sampling of the rows that complete a prompt; the
        sampling waits for `sample` where a sampled request has a grammar. special_rows: some
        live request asks for a grammar or logprobs (otherwise no row is looked at for them)."""
        # A step whose adapters have embedding or LM head LoRA runs eagerly (lora/edge.py).
        graphs = self.lora is None or not self.lora.needs_eager(chunks)
        if graphs and self.decode_graphs is not None and self.decode_graphs.fits(chunks):
            chunks = ordered(chunks)  # each adapter's rows one run: the LoRA kernels' layout
            mode, way = ForwardMode.DECODE_GRAPHS, self.decode_graphs
        elif graphs and self.piecewise_graphs is not None and self.piecewise_graphs.fits(chunks):
            mode, way = ForwardMode.PIECEWISE_GRAPHS, self.piecewise_graphs
        else:
            mode, way = ForwardMode.EAGER, self.eager
        sampled = [c.request for c in chunks if c.completes_prompt]
        staged = way.stage(chunks)
        if self.ranks is not None:  # the other ranks run the same forward beside this one
            self.ranks.mirror(staged)
        logits, greedy, finite = self._forward(way, staged)
        if finite is None:
            finite = row_finite(logits)
        step = StepRun(chunks, sampled, None, mode, (logits, greedy, finite))
        if not (special_rows and any(req.grammar is not None for req in sampled)):
            self.sample(step, special_rows=special_rows)
        return step

    def sample(self, step: StepRun, masks: StepMasks | None = None, special_rows: bool = True) -> None:
        """Queues the step's sampling (its constrained rows limited to their masks) and the
        log-probabilities of the rows that ask; sets step.tokens."""
        logits, greedy, finite = step.outputs
        step.outputs = None
        chosen = sample_on_device(logits, step.sampled, greedy, finite, masks)
        logprobs = logprobs_on_device(logits, step.sampled, chosen) if special_rows else None
        step.tokens = self.feedback.publish(chosen, finite, logprobs)

    def release_graphs(self) -> None:
        """Drops the captured graphs once the engine loop has ended: graphs that captured NCCL
        collectives may hold their communicators, so a tensor-parallel group ends after."""
        self.decode_graphs = self.piecewise_graphs = None

    def _forward(self, way, staged: Staged):
        """way.run(staged); where it fails and another rank has died, RankLost naming it (a
        dead rank's sockets close while it exits, before rank 0 can see its exit: lost waits
        up to a second for that)."""
        try:
            return way.run(staged)
        except Exception as exc:
            lost = self.ranks.lost(1.0) if self.ranks is not None else None
            if lost is None:
                raise
            raise RankLost(lost) from exc

    # -- the other ranks, for the engine's stats and checks -------------------------------------
    @property
    def tensor_parallel_size(self) -> int:
        return self.ranks.size if self.ranks is not None else 1

    @property
    def slot_table_checks(self) -> int:
        return self.ranks.table_checks if self.ranks is not None else 0

    def check_ranks(self) -> None:
        """Raises AssertionError unless every rank's adapter slots hold what rank 0's hold."""
        if self.ranks is not None:
            self.ranks.check_slot_tables()
