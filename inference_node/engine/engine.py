"""The engine loop: a single thread owns the scheduler, the KV blocks and the model runner.

Other threads talk to it through commands (`submit`, `abort`, `call`: mailbox.py) and hear
back through each request's `emit` callback, so no lock guards model state. The runner
(inference_node/runner) turns a scheduled step into sampled tokens. The engine streams token
ids; text and stop strings belong to the front ends (inference_node/frontend).

Steps are pipelined one deep: the loop launches step n+1, then waits for step n's tokens and
streams them while the GPU runs step n+1, which reads them on the device (TokenFeedback). A
request that step n ends by length is not scheduled again; one it ends by EOS or a stop string
has step n+1's token dropped (its blocks freed first: their later use queues behind step n+1).

Structured output (constraints.py): a step with constrained rows has its sampling queued
after step n's tokens are read, so the host fills the masks while the device runs the forward.
"""
from __future__ import annotations

import gc
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

from ..runner.runner import ModelRunner, StepRun
from ..runner.token_feedback import NON_FINITE
from .admission import Admission
from .config import EngineConfig
from .constraints import Constraints
from .errors import CutShort, EngineStopped, NonFiniteLogits, NotStarted, RankLost
from .grammar import GrammarCompiler
from .invariants import check_engine
from .kv_cache import BlockAllocator
from .mailbox import Mailbox
from .prefix_cache import PrefixCache
from .request import Request, Status
from .scheduler import LoraProvider, ScheduledChunk, Scheduler, SchedulerConfig
from .stats import EngineStats, engine_snapshot

log = logging.getLogger(__name__)


@dataclass
class LaunchedStep:
    """A step whose forward and sampling are queued on the device; its tokens not yet read."""

    run: StepRun
    started: float                   # time.monotonic() when it was scheduled
    prefill: bool                    # it carries prompt tokens


class Engine:
    def __init__(self, runner: ModelRunner, config: EngineConfig, lora: LoraProvider | None = None,
                 grammars: GrammarCompiler | None = None) -> None:
        """lora: the adapters' lifecycles, with the runner's LoRA step plan (None: base model
        only). grammars: structured output's compiler (None: requests with one are refused)."""
        if (lora is None) != (runner.lora is None):
            raise ValueError("LoRA needs both the adapter manager and the step plan")
        self.runner = runner
        self.config = config
        self.lora = lora
        self.allocator = BlockAllocator(config.num_kv_blocks)
        self._launched: LaunchedStep | None = None
        self.prefix_cache = PrefixCache(self.allocator, config.block_size) if config.prefix_caching else None
        # Blocks behind a sliding window are given back only where every layer forgets them.
        model = runner.model.config
        window = model.sliding_window if model.every_layer_windowed else 0
        self.scheduler = Scheduler(SchedulerConfig.of(config, window), self.allocator, lora, self.prefix_cache)
        if lora is not None and self.prefix_cache is not None:
            lora.set_namespace_listener(self.prefix_cache.drop_namespace)
        self.stats = EngineStats()
        self.eos_ids = frozenset(runner.model.config.eos_token_ids)
        self._commands = Mailbox()
        self.admission = Admission(config, window)
        self._requests: dict[int, Request] = {}
        self.constraints = Constraints(grammars, config.max_num_seqs)
        self._special_requests = 0  # live requests with logprobs or a grammar (none: rows unread)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # -- public, thread-safe -----------------------------------------------------------------
    def start(self) -> None:
        """Prepares the engine and runs its loop on a thread of its own."""
        self.prepare()
        self._thread = threading.Thread(target=self.run_forever, name="engine-loop", daemon=True)
        self._thread.start()

    def prepare(self) -> None:
        """Compiles, captures and freezes what the loop needs, before it runs."""
        self.runner.prepare()
        # Start-up objects (the model, torch, the graphs: hundreds of thousands) live as long as
        # the process. Frozen, a full garbage collection no longer walks them: unfrozen, one
        # took 160-180 ms on the development CPU, a stall of dozens of decode steps.
        gc.collect()
        gc.freeze()

    def submit(self, request: Request) -> None:
        """Queues the request for the loop, or raises why the node does not take it."""
        self.constraints.check(request)
        self.admission.admit(request)
        self._commands.put(("add", (request, self.constraints.compile(request))))

    def abort(self, request_id: int) -> None:
        self._commands.put(("abort", request_id))

    def call(self, fn: Callable[[], Any]) -> Future:
        """Runs fn on the loop thread (between steps) and returns its future."""
        future: Future = Future()
        self._commands.put(("call", (fn, future)))
        return future

    def drain(self) -> None:
        """Takes no new work and refuses every request that has streamed nothing yet (waiting,
        loading its adapter, or in its prefill) with NotStarted; running answers go on. The
        caller waits for num_inflight() to reach zero, then calls shutdown()."""
        self.admission.accepting = False
        self._commands.put(("drain", None))

    def shutdown(self, timeout: float = 5.0) -> None:
        self.admission.accepting = False
        self._stop.set()
        self._commands.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout)
        self.constraints.close()
        gc.unfreeze()  # what start froze may be collected again (and is, at interpreter exit)

    def release_graphs(self) -> None:
        """Drops the runner's graphs once the loop has ended (before a tensor-parallel group ends)."""
        self.runner.release_graphs()

    def num_inflight(self) -> int:
        return self.admission.inflight

    # -- loop thread ---------------------------------------------------------------------------
    def run_forever(self, after_each: Callable[[], None] = lambda: None) -> None:
        """Runs loop iterations until shutdown; after_each runs after every one (the engine
        core process sends the step's output there). Requests still running at shutdown end
        with CutShort (they streamed part of an answer) or EngineStopped."""
        log.info("engine loop started: %d KV blocks of %d tokens", self.config.num_kv_blocks,
                 self.config.block_size)
        while not self._stop.is_set():
            self.run_once()
            after_each()
        for req in list(self._requests.values()):
            if req.emitted_tokens:
                self.stats.cut_short += 1
                self._finish(req, "cancelled", error=CutShort(
                    f"the node shut down after {req.emitted_tokens} tokens of this answer"))
            else:
                self._finish(req, "cancelled", error=EngineStopped("the node shut down"))
        after_each()

    def run_once(self, block: bool = True) -> None:
        """One loop iteration: commands, adapter progress, one step. The loop thread calls it;
        a test or benchmark that never starts the thread may drive the engine with it."""
        adapters_busy = self.lora is not None and self.lora.busy()
        idle = not self.scheduler.has_work() and not adapters_busy and self._launched is None
        self._drain_commands(block=block and idle)
        if self.lora is not None:
            self._prepare_adapters()
        if self.scheduler.has_work() or self._launched is not None:
            self._step()
        elif adapters_busy and block:
            self._drain_commands(block=True, timeout=0.005)

    def _drain_commands(self, block: bool, timeout: float = 0.05) -> None:
        for kind, arg in self._commands.take(block, timeout):
            self._handle(kind, arg)

    def _handle(self, kind: str, arg: Any) -> None:
        if kind == "add":
            req, compiled = arg
            self._requests[req.id] = req
            if req.params.logprobs >= 0 or req.grammar_source:
                self._special_requests += 1
            if compiled is None:
                self.scheduler.add(req)
            else:
                self.constraints.wait(req, compiled, lambda: self._commands.put(("compiled", (req, compiled))))
        elif kind == "compiled":  # a constrained request joins the scheduler, or ends with its GrammarError
            req, compiled = arg
            error = self.constraints.compiled(req, compiled)
            if req.id not in self._requests:  # cancelled while it compiled
                pass
            elif error is not None:
                self._finish(req, "error", error=error)
            else:
                self.scheduler.add(req)
        elif kind == "abort":
            req = self._requests.get(arg)
            if req is not None:
                self._finish(req, "cancelled")
        elif kind == "drain":
            for req in list(self._requests.values()):
                if not req.emitted_tokens:
                    self._finish(req, "cancelled", error=NotStarted(
                        "the node is draining and this request had not started: retry it on another node"))
        elif kind == "call":
            fn, future = arg
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # handed to the caller
                    future.set_exception(exc)

    def _prepare_adapters(self) -> None:
        """Adapter loads progress; requests whose adapter failed to load end with its error."""
        self.lora.prepare(self.scheduler.waiting)
        for req, error in self.lora.collect_failures(list(self.scheduler.waiting)):
            self._finish(req, "error", error=error)

    def _step(self) -> None:
        """Launches the next step, then reads and streams the previous one's tokens."""
        started = time.monotonic()
        chunks = self.scheduler.schedule()
        if not chunks:  # e.g. every running request waits for its last token, or for an adapter
            if self._launched is not None:
                self._resolve()
            else:
                self._drain_commands(block=True, timeout=0.005)
            return
        prefill = any(c.request.num_computed < len(c.request.prompt_token_ids) for c in chunks)
        launched = self._launch(chunks, started, prefill)
        if self._launched is not None:
            self._resolve()
        if launched is not None and launched.run.tokens is None:
            launched = self._sample_constrained(launched)
        self._launched = launched
        if self.config.debug_checks:
            self.check_consistency()

    def _launch(self, chunks: list[ScheduledChunk], started: float, prefill: bool) -> LaunchedStep | None:
        """Queues the step's forward and sampling; the requests' counters move on at once."""
        distinct = len({c.request.lora_slot for c in chunks if c.request.lora_slot >= 0})
        self.stats.max_adapters_in_step = max(self.stats.max_adapters_in_step, distinct)
        eager_prefill = any(c.request.in_prefill for c in chunks)
        try:
            run = self.runner.run(chunks, special_rows=self._special_requests > 0)
        except Exception as exc:  # a failed step fails its requests, the node keeps serving
            self._fail_step(chunks, exc)
            return None
        self.stats.count(run.mode, eager_prefill)
        self.stats.prompt_tokens += sum(c.request.computed(c.num_new_tokens) for c in run.chunks)
        for row, req in enumerate(run.sampled):
            req.sampling(row, self.config.max_model_len)
        self.stats.preemptions = self.scheduler.num_preemptions
        self.stats.cached_prompt_tokens = self.scheduler.num_cached_prompt_tokens
        return LaunchedStep(run, started, prefill)

    def _sample_constrained(self, launched: LaunchedStep) -> LaunchedStep | None:
        """Queues a constrained step's sampling, now that every earlier token is known."""
        try:
            self.runner.sample(launched.run, self.constraints.masks(launched.run))
        except Exception as exc:  # as a failed launch: its requests fail, the node keeps serving
            self._fail_step(launched.run.chunks, exc)
            return None
        return launched

    def _resolve(self) -> None:
        """Waits for the launched step's tokens and streams them. Requests that ended (or were
        cancelled) since it was launched drop theirs."""
        launched, self._launched = self._launched, None
        step = launched.run
        try:
            tokens = step.tokens.wait()
        except Exception as exc:  # a device error surfaces here, at the step's one sync
            self._fail_step(step.chunks, exc)
            return
        if launched.prefill:
            self.scheduler.note_prefill_step(time.monotonic() - launched.started)
        logprobs = step.tokens.token_logprobs() if step.tokens.logprobs is not None else None
        for row, (req, token) in enumerate(zip(step.sampled, tokens)):
            if req.status is Status.FINISHED:
                continue
            req.num_pending -= 1
            if token == NON_FINITE:
                self._fail_non_finite(req)
                continue
            req.output_token_ids.append(token)
            if logprobs is not None and logprobs[row] is not None:
                req.output_logprobs.append(logprobs[row])
            refusal = self.constraints.refusal(req, token)
            if refusal is not None:
                self._fail(req, refusal)
        if self.prefix_cache is not None:  # now that the blocks' tokens are known on the host
            for c in step.chunks:
                if c.request.status is not Status.FINISHED:
                    self.prefix_cache.insert(c.request)
        for req in step.sampled:
            if req.status is not Status.FINISHED:
                self._on_token(req)

    def _fail_step(self, chunks: list[ScheduledChunk], error: Exception) -> None:
        """A step that failed fails its requests; the node keeps serving the others."""
        log.error("engine step failed: %s", error, exc_info=not isinstance(error, RankLost))
        for c in chunks:
            self._finish(c.request, "error", error=error)

    def _fail_non_finite(self, req: Request) -> None:
        """A row whose logits held NaN or Inf: its request ends with an error, not a token
        (other rows of the step are untouched), and its adapter version is marked unhealthy."""
        self.stats.non_finite_rows += 1
        if req.adapter_entry is not None and self.lora is not None:
            error: Exception = self.lora.numerical_fault(req)
        else:
            error = NonFiniteLogits(f"the base model's logits were not finite (NaN or Inf) at output token "
                                    f"{len(req.output_token_ids) + 1}; the node or its checkpoint is at fault")
        self._fail(req, error)

    def _fail(self, req: Request, error: Exception) -> None:
        log.error("request %s: %s", req.request_id or req.id, error)
        self._finish(req, "error", error=error)

    def _on_token(self, req: Request) -> None:
        """The newest known token of req: stop checks, then stream it."""
        self.stats.generated_tokens += 1
        reason = req.stop_reason(self.eos_ids, self.config.max_model_len)
        if reason is not None:
            self._finish(req, reason)
        else:
            req.stream()

    def _finish(self, req: Request, reason: str, error: BaseException | None = None) -> None:
        if self._requests.pop(req.id, None) is None:
            return
        if req.params.logprobs >= 0 or req.grammar_source:
            self._special_requests -= 1
        self.constraints.compiling.discard(req.id)
        self.scheduler.remove(req)
        req.num_pending = 0  # a token still on the device for it is dropped
        self.admission.finished()
        req.stream(reason, error)

    # -- invariants ------------------------------------------------------------------------------
    def check_consistency(self) -> None:
        """Raises where the KV blocks, the prefix index, the queues or the adapters' references
        disagree with the live requests (invariants.py)."""
        check_engine(self)

    def live_requests(self) -> list[Request]:
        return list(self._requests.values())

    def snapshot(self) -> dict[str, int]:
        """Counters for stats RPCs; call through `call` from other threads."""
        return engine_snapshot(self)
