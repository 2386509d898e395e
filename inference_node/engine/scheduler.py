"""Continuous batching: which requests run in the next step, and how many tokens each.

Policy (one step = one forward pass):
1. Decode first: every running request that has finished its prompt gets one token.
2. Running requests still in prefill get chunks of their prompt from what budget is left.
3. Waiting requests are admitted in arrival order while the token budget, the sequence
   limit and free KV blocks allow, and while their adapter can be bound to a device slot
   (a request whose adapter is not resident is skipped, not blocking the others). An
   admitted request starts from the longest cached prefix of its own KV namespace. The
   later answers of a prompt asked for n times (Request.follows) wait until the first has
   its prompt's full blocks cached, so all n share one computation of the prompt.
   With `prefill_delay_factor` > 0, while requests are decoding, admission waits until the
   oldest waiting request has waited that many times the last prefill step's duration (or
   the waiting prompts fill the step's token budget). A step that carries a prompt runs
   eagerly for every row, at a host cost that hardly depends on its token count; under a
   trickle of arrivals, admitting each one at once turns most steps into such steps. The
   delay gathers arrivals into fewer prefill steps (vLLM's scheduler delay factor).
   With `refill_wait_factor` > 0 (the default), after a step in which a burst of requests
   finished (at least 1/16 of the batch, and 2), new prompts wait until as many have
   arrived as finished, or the oldest has waited that many times the last prefill step.
   Clients that resubmit when an answer ends (batch jobs, evaluation harnesses) send the
   burst's replacements one network round trip apart; admitting the first alone would
   split them over several prefill steps, each a step for every decoding row. Lone
   finishes never hold anyone, so independent arrivals are admitted at once.
With a sliding window on every layer (`window`: Mistral, Phi-3), a request gives back the
blocks wholly behind its next query's window before its chunk is planned: no later query of it
reads them. A full block is indexed by the prefix cache first, so it stays as cache (valid KV
for another request whose prefix it is) rather than going to the free list; its table entry
becomes the allocator's `released` id.
When a running request needs a KV block and none is free, the latest-arrived running
request is preempted: its blocks are released (its full blocks stay as prefix cache) and
it is recomputed later from its prompt plus the tokens it already streamed, under the same
adapter version it keeps bound, so its output does not change.

The engine schedules step n+1 before it has read step n's tokens: a request's num_tokens
counts its pending token, and a request whose pending token is its last by length
(Request.last_token_pending) is not scheduled again.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol

from .config import EngineConfig
from .kv_cache import BlockAllocator
from .prefix_cache import PrefixCache
from .request import Request, Status


class AdapterBinder(Protocol):
    """Binds a request to its adapter's device slot (or refuses while it is not resident)."""

    def try_bind(self, request: Request) -> bool: ...
    def release(self, request: Request) -> None: ...


class LoraProvider(AdapterBinder, Protocol):
    """The adapters' lifecycles: which adapter version a request binds to and when its slot
    is ready (inference_node.adapters.AdapterManager)."""

    def busy(self) -> bool: ...
    def prepare(self, waiting: Iterable[Request]) -> None: ...
    def collect_failures(self, waiting: Iterable[Request]) -> list[tuple[Request, Exception]]: ...
    def check_consistency(self, live: Iterable[Request]) -> None: ...
    def set_namespace_listener(self, on_dropped: Callable[[str], object]) -> None: ...
    def numerical_fault(self, request: Request) -> Exception: ...


class BaseModelOnly:
    """Binder for a node without adapters: only base-model requests run."""

    def try_bind(self, request: Request) -> bool:
        return request.adapter == ""

    def release(self, request: Request) -> None:
        request.lora_slot = -1


@dataclass(frozen=True)
class SchedulerConfig:
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    prefill_delay_factor: float = 0.0  # 0: admit waiting requests as soon as they fit
    refill_wait_factor: float = 1.0    # after a burst of finishes, wait this x the last prefill step for its replacements (0: off)
    window: int = 0                    # every layer's sliding window: blocks behind it are given back (0: none)

    @classmethod
    def of(cls, config: EngineConfig, window: int = 0) -> "SchedulerConfig":
        """The scheduler's part of the engine's settings (window: the model's, where every
        layer has one)."""
        return cls(config.block_size, config.max_num_seqs, config.max_num_batched_tokens,
                   config.prefill_delay_factor, config.refill_wait_factor, window)


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    request: Request
    num_new_tokens: int
    # After this chunk every known token has KV, so the step samples a new token. Fixed when
    # the chunk is planned: the engine moves the request's counters on once it launches the
    # step, and a decode step asks this of every row several times on the host.
    completes_prompt: bool

    @classmethod
    def plan(cls, request: Request, num_new_tokens: int) -> "ScheduledChunk":
        return cls(request, num_new_tokens,
                   request.num_computed + num_new_tokens == request.num_tokens)


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: BlockAllocator,
                 binder: AdapterBinder | None = None, prefix_cache: PrefixCache | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """clock: the time base of Request.arrival (tests pass a fake one)."""
        self.config = config
        self.clock = clock
        self.last_prefill_seconds = 0.0  # the latest step with prompt tokens, launch to tokens
        self.allocator = allocator
        self.prefix_cache = prefix_cache
        self.binder: AdapterBinder = binder or BaseModelOnly()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_cached_prompt_tokens = 0  # prompt tokens whose prefill a cache hit skipped
        # The burst-refill count (refill_wait_factor): finishes and arrivals since the last
        # plan, and how many replacements a recent burst of finishes still expects.
        self._finished_since_plan = 0
        self._arrived_since_plan = 0
        self.refills_owed = 0
        self._owed_since = 0.0

    # -- queue ---------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queues a request (the engine bounds how many are in flight before this)."""
        request.status = Status.WAITING
        self.waiting.append(request)
        self._arrived_since_plan += 1

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def remove(self, request: Request) -> None:
        """Takes a request out (finished or aborted) and frees everything it holds."""
        if request in self.running:
            self.running.remove(request)
            self._finished_since_plan += 1
        elif request in self.waiting:
            self.waiting.remove(request)
        self.binder.release(request)  # a preempted request waits with its adapter still bound
        self._free_blocks(request)
        request.status = Status.FINISHED

    # -- planning --------------------------------------------------------------------------
    def schedule(self) -> list[ScheduledChunk]:
        budget = self.config.max_num_batched_tokens
        plan: list[ScheduledChunk] = []
        scheduled: set[int] = set()

        for req in list(self.running):
            if budget <= 0:
                break
            if req.status is not Status.RUNNING or req.last_token_pending:
                continue  # preempted earlier in this loop, or its last token is being sampled
            self._release_behind_window(req)
            n = min(req.num_tokens - req.num_computed, budget)
            needed = self._blocks_needed(req, n)  # 0 for most decode rows: the last block has room
            if needed and not self._reserve(req, needed, scheduled):
                continue
            plan.append(ScheduledChunk.plan(req, n))
            scheduled.add(req.id)
            budget -= n

        self._count_refills()
        admit = self._admission_due(budget)
        while (admit and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs):
            picked = self._next_admissible()
            if picked is None:
                break
            req, newly_bound = picked
            hit = self.prefix_cache.match(req) if self.prefix_cache is not None else []
            computed = len(hit) * self.config.block_size
            n = min(req.num_tokens - computed, budget)
            needed = -(-(computed + n) // self.config.block_size) - len(hit)
            available = self.allocator.num_free - (self.prefix_cache.num_idle(hit) if hit else 0)
            if needed > available:
                if newly_bound:
                    self.binder.release(req)
                break  # admission waits for blocks, in arrival order
            if self.prefix_cache is not None:
                self.prefix_cache.acquire(req, hit)
            req.block_ids += self.allocator.allocate(needed)
            self._release_behind_window(req)  # a cached prefix longer than the window
            if req.preemptions == 0:
                req.num_cached_prompt_tokens = min(computed, len(req.prompt_token_ids))
                self.num_cached_prompt_tokens += req.num_cached_prompt_tokens
            self.waiting.remove(req)
            req.status = Status.RUNNING
            self.running.append(req)
            plan.append(ScheduledChunk.plan(req, n))
            scheduled.add(req.id)
            budget -= n
        return plan

    def note_prefill_step(self, seconds: float) -> None:
        """The engine reports how long a step carrying prompt tokens took."""
        self.last_prefill_seconds = seconds

    def _count_refills(self) -> None:
        """Moves the burst-refill count on by the finishes and arrivals since the last plan."""
        finished, arrived = self._finished_since_plan, self._arrived_since_plan
        self._finished_since_plan = self._arrived_since_plan = 0
        if self.config.refill_wait_factor <= 0:
            return
        now = self.clock()
        if finished >= max(2, -(-(len(self.running) + finished) // 16)):
            self._owed_since = now
            self.refills_owed += finished
        self.refills_owed = max(0, self.refills_owed - arrived)
        if self.refills_owed and now - self._owed_since >= self._refill_wait():
            self.refills_owed = 0  # the rest are not coming soon: admitted as they come

    def _refill_wait(self) -> float:
        return self.config.refill_wait_factor * self.last_prefill_seconds

    def _admission_due(self, budget: int) -> bool:
        """Whether waiting requests may be admitted in this step (refill_wait_factor,
        prefill_delay_factor)."""
        factor = self.config.prefill_delay_factor
        if not self.waiting or (factor <= 0 and not self.refills_owed):
            return True  # neither rule holds anyone (the usual case: no pass over the queue)
        if sum(r.num_tokens - r.num_computed for r in self.waiting) >= budget:
            return True  # a full step's worth of prompt is waiting
        waited = self.clock() - min(r.arrival for r in self.waiting)
        if self.refills_owed and waited < self._refill_wait():
            return False  # a burst's replacements are still arriving: one prefill step for them
        if factor <= 0:
            return True
        if not any(r.status is Status.RUNNING and r.num_computed >= len(r.prompt_token_ids)
                   for r in self.running):
            return True  # nothing is decoding: there is nothing to keep in fast steps
        return waited >= factor * self.last_prefill_seconds

    def _next_admissible(self) -> tuple[Request, bool] | None:
        """Oldest waiting request whose adapter is bound (a preempted one) or can be bound
        now (binding it); and whether it was bound just now."""
        for req in self.waiting:
            if req.last_token_pending:
                continue  # preempted while its last token was being sampled: it ends with it
            if req.follows is not None:
                if self._prompt_pending(req.follows):
                    continue
                req.follows = None
            if req.adapter_entry is not None:
                return req, False
            if self.binder.try_bind(req):
                return req, True
        return None

    def _prompt_pending(self, first: Request) -> bool:
        """Whether `first` (of n answers to one prompt) is still to cache its prompt's full
        blocks, which the others will reuse. The blocks are indexed when the step that
        computed them is read (Engine._resolve)."""
        if first.status is Status.FINISHED or self.prefix_cache is None:
            return False
        return first.num_indexed_blocks < len(first.prompt_token_ids) // self.config.block_size

    def _release_behind_window(self, req: Request) -> None:
        """Gives back the request's blocks that lie wholly before its next query's window."""
        window = self.config.window
        if not window:
            return
        behind = max(req.num_computed - window + 1, 0) // self.config.block_size
        behind = min(behind, len(req.block_ids))
        if behind <= req.num_released_blocks:
            return
        if self.prefix_cache is not None:
            self.prefix_cache.insert(req)  # indexed first: they stay as cache, not free
        released = req.block_ids[req.num_released_blocks:behind]
        req.block_ids[req.num_released_blocks:behind] = [self.allocator.released] * len(released)
        req.num_released_blocks = behind
        self.allocator.free(released)

    def _blocks_needed(self, req: Request, num_new: int) -> int:
        total = -(-(req.num_computed + num_new) // self.config.block_size)
        return max(total - len(req.block_ids), 0)

    def _reserve(self, req: Request, needed: int, scheduled: set[int]) -> bool:
        """Allocates `needed` more blocks for req's next chunk, preempting later arrivals if
        the pool is short."""
        while needed > self.allocator.num_free:
            candidates = [r for r in self.running if r.id not in scheduled and r is not req]
            victim = max(candidates, key=lambda r: (r.arrival, r.id)) if candidates else None
            if victim is None:
                self._preempt(req)
                return False
            self._preempt(victim)
        req.block_ids += self.allocator.allocate(needed)
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._free_blocks(req)  # its indexed full blocks stay behind as cache
        req.num_computed = 0
        req.num_indexed_blocks = 0
        req.status = Status.WAITING
        req.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _free_blocks(self, req: Request) -> None:
        if req.block_ids:
            self.allocator.free(req.block_ids[req.num_released_blocks:])
            req.block_ids = []
        req.num_released_blocks = 0
