"""The engine loop: a single thread owns the scheduler, the KV blocks and the model runner.

Other threads only talk to it through a command queue (`submit`, `abort`, `call`), and
receive results through each request's `emit` callback, so no lock guards model state. The
model runner (inference_node/runner) turns each scheduled step into sampled tokens. The
engine streams token ids: text, stop strings and everything else per request belong to the
front end (inference_node/frontend), which runs in other processes and aborts a request
once its text hits a stop string.

Steps are pipelined one deep: the loop schedules and launches step n+1, then waits for step
n's sampled tokens and streams them while the GPU runs step n+1. Step n+1 reads the tokens
step n sampled on the device (TokenFeedback), so the host's scheduling, input writes and
streaming overlap the GPU instead of adding to each step. A request that step n ends by
length is not scheduled again; one that it ends by EOS or a stop string has step n+1's token
for it dropped (its KV blocks are freed first, which is safe: any later use of them is queued
behind step n+1 on the same stream).

Structured output: a constrained request's grammar compiles off the loop from its submission
(grammar.py); the request waits out of the scheduler until it has. A step that samples constrained rows has its forward
launched as any other; its sampling is queued once step n's tokens are read and each
constrained request's matcher has moved on by its token, so the host fills the masks while
the device runs the forward (ModelRunner.sample).
"""
from __future__ import annotations

import gc
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from typing import Any, Callable

import numpy as np

from ..runner.runner import ModelRunner, StepRun
from ..runner.sampler import StepMasks
from ..runner.token_feedback import NON_FINITE
from .admission import Admission
from .config import EngineConfig
from .errors import CutShort, EngineStopped, InvalidRequest, NonFiniteLogits, NotStarted
from .grammar import GrammarCompiler, mask_words
from .kv_cache import BlockAllocator
from .prefix_cache import NamespaceStats, PrefixCache, split_namespace
from .request import Request, Status
from .scheduler import LoraProvider, ScheduledChunk, Scheduler, SchedulerConfig
from .stats import EngineStats

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
        """runner: the model runner (its LoRA step plan and this lora, the adapters'
        lifecycles, go together; None: LoRA disabled, base model only). grammars: compiles
        structured output's grammars (None: requests with one are refused)."""
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
        self._commands: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.admission = Admission(config, window)
        self._requests: dict[int, Request] = {}
        self.grammars = grammars
        self._compiling: set[int] = set()   # live requests whose grammar is being compiled
        self._masks: np.ndarray | None = None
        # Live requests that ask for logprobs or have a grammar: while there are none, no
        # step's rows are looked at for them.
        self._special_requests = 0
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

    @property
    def kv_capacity_tokens(self) -> int:
        """The longest context (prompt and the token it samples) the KV cache can hold."""
        return self.admission.capacity_tokens

    def submit(self, request: Request) -> None:
        """Queues the request for the loop, or raises why the node does not take it."""
        if request.grammar_source and self.grammars is None:
            raise InvalidRequest("structured output (response_format) is not available on this engine")
        self.admission.admit(request)
        # Compiling from now on, it is mostly done when the loop takes the request.
        compiled = self.grammars.compile(request.grammar_source) if request.grammar_source else None
        self._commands.put(("add", (request, compiled)))

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
        if self.grammars is not None:
            self.grammars.close()
        gc.unfreeze()  # what start froze may be collected again (and is, at interpreter exit)

    def release_graphs(self) -> None:
        """Drops the runner's captured graphs once the loop has ended (a tensor-parallel group
        ends after them)."""
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
        try:
            cmd = self._commands.get(timeout=timeout) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _handle(self, kind: str, arg: Any) -> None:
        if kind == "add":
            req, compiled = arg
            self._requests[req.id] = req
            if req.params.logprobs >= 0 or req.grammar_source:
                self._special_requests += 1
            if compiled is None:
                self.scheduler.add(req)
            elif compiled.done():
                self._compiled(req, compiled)
            else:
                self._compiling.add(req.id)
                compiled.add_done_callback(lambda _, req=req, compiled=compiled: self._commands.put(
                    ("compiled", (req, compiled))))
        elif kind == "compiled":
            req, compiled = arg
            self._compiling.discard(req.id)
            if req.id in self._requests:  # not cancelled while it compiled
                self._compiled(req, compiled)
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

    def _compiled(self, req: Request, compiled: Future) -> None:
        """A constrained request whose grammar has compiled joins the scheduler; one whose
        grammar failed ends with its GrammarError."""
        error = compiled.exception()
        if error is not None:
            self._finish(req, "error", error=error)
        else:
            req.grammar = compiled.result()
            self.scheduler.add(req)

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
            log.exception("engine step failed")
            for c in chunks:
                self._finish(c.request, "error", error=exc)
            return None
        self.stats.count(run.mode, eager_prefill)
        for c in run.chunks:
            req = c.request
            if req.num_computed < len(req.prompt_token_ids):
                self.stats.prompt_tokens += min(c.num_new_tokens, len(req.prompt_token_ids) - req.num_computed)
            req.num_computed += c.num_new_tokens
        for row, req in enumerate(run.sampled):
            req.num_pending += 1
            req.feedback_row = row
            req.last_token_pending = (len(req.output_token_ids) + req.num_pending >= req.params.max_tokens
                                      or req.num_tokens >= self.config.max_model_len)
        self.stats.preemptions = self.scheduler.num_preemptions
        self.stats.cached_prompt_tokens = self.scheduler.num_cached_prompt_tokens
        return LaunchedStep(run, started, prefill)

    def _sample_constrained(self, launched: LaunchedStep) -> LaunchedStep | None:
        """Queues the sampling of a step with constrained rows, now that every earlier token is
        known: each grammar's mask for its row (rows of requests that ended allow anything:
        their token is dropped)."""
        run = launched.run
        rows = [i for i, req in enumerate(run.sampled) if req.grammar is not None and req.status is not Status.FINISHED]
        try:
            masks = None
            if rows:
                if self._masks is None:
                    words = mask_words(self.grammars.vocab_size)
                    self._masks = np.zeros((self.config.max_num_seqs, words), dtype=np.int32)
                self.grammars.fill_masks([run.sampled[i].grammar for i in rows], self._masks)
                masks = StepMasks(rows, self._masks[:len(rows)])
            self.runner.sample(run, masks)
        except Exception as exc:  # as a failed launch: its requests fail, the node keeps serving
            log.exception("engine step failed")
            for c in run.chunks:
                self._finish(c.request, "error", error=exc)
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
            log.exception("engine step failed")
            for c in step.chunks:
                self._finish(c.request, "error", error=exc)
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
            if req.grammar is not None and not req.grammar.accept(token):
                self._fail_grammar(req, token)
        if self.prefix_cache is not None:  # now that the blocks' tokens are known on the host
            for c in step.chunks:
                if c.request.status is not Status.FINISHED:
                    self.prefix_cache.insert(c.request)
        for req in step.sampled:
            if req.status is not Status.FINISHED:
                self._on_token(req)

    def _fail_non_finite(self, req: Request) -> None:
        """A row whose logits held NaN or Inf: its request ends with an error, not a token
        (other rows of the step are untouched), and its adapter version is marked unhealthy."""
        self.stats.non_finite_rows += 1
        if req.adapter_entry is not None and self.lora is not None:
            error: Exception = self.lora.numerical_fault(req)
        else:
            error = NonFiniteLogits(f"the base model's logits were not finite (NaN or Inf) at output token "
                                    f"{len(req.output_token_ids) + 1}; the node or its checkpoint is at fault")
        log.error("request %s: %s", req.request_id or req.id, error)
        self._finish(req, "error", error=error)

    def _fail_grammar(self, req: Request, token: int) -> None:
        """A sampled token its grammar refuses: the mask allowed only grammatical tokens, so
        this is a fault of the node's (INTERNAL), and the request ends with it."""
        error = RuntimeError(f"structured output failed at output token {len(req.output_token_ids)} "
                             f"({token}): {req.grammar.error or 'the grammar refused the token'}")
        log.error("request %s: %s", req.request_id or req.id, error)
        self._finish(req, "error", error=error)

    def _on_token(self, req: Request) -> None:
        """The newest known token of req: stop checks, then stream it."""
        self.stats.generated_tokens += 1
        token = req.output_token_ids[-1]
        reason = None
        if (token in self.eos_ids and not req.params.ignore_eos) or token in req.params.stop_token_ids:
            reason = "stop"
        elif req.grammar is not None and req.grammar.complete:
            reason = "stop"  # the answer is whole: its grammar allows only the end of sequence
        elif (len(req.output_token_ids) >= req.params.max_tokens
              or req.num_known_tokens >= self.config.max_model_len):
            reason = "length"
        if reason is not None:
            self._finish(req, reason)
        else:
            req.stream()

    def _finish(self, req: Request, reason: str, error: BaseException | None = None) -> None:
        if self._requests.pop(req.id, None) is None:
            return
        if req.params.logprobs >= 0 or req.grammar_source:
            self._special_requests -= 1
        self._compiling.discard(req.id)
        self.scheduler.remove(req)
        req.num_pending = 0  # a token still on the device for it is dropped
        self.admission.finished()
        req.stream(reason, error)

    # -- invariants ------------------------------------------------------------------------------
    def check_consistency(self) -> None:
        """Every KV block is free, cached-idle or owned, exactly once; each block's reference
        count equals the live requests holding it; the prefix index agrees with the allocator;
        every adapter reference count equals the live requests bound to it (raises otherwise)."""
        self.allocator.check_owners({req.id: req.block_ids for req in self._requests.values()})
        self.allocator.check_consistency()
        if self.prefix_cache is not None:
            self.prefix_cache.check_consistency()
        elif self.allocator.num_cached_idle:
            raise AssertionError("cached KV blocks without a prefix cache")
        live = set(self._requests)
        queued = ({r.id for r in self.scheduler.running} | {r.id for r in self.scheduler.waiting}
                  | self._compiling)
        if queued != live:
            raise AssertionError(f"scheduler holds {sorted(queued)} but live requests are {sorted(live)}")
        if self.lora is not None:
            self.lora.check_consistency(self._requests.values())
        self.runner.check_ranks()

    def prefix_cache_rows(self) -> list[tuple[tuple[str, str], NamespaceStats]]:
        """((adapter, version), counters) per live KV namespace; "" adapter = the base model."""
        cache = self.prefix_cache
        return [] if cache is None else [(split_namespace(ns), s) for ns, s in sorted(cache.stats.items())]

    def snapshot(self) -> dict[str, int]:
        """Counters for stats RPCs; call through `call` from other threads."""
        return {
            **asdict(self.stats),
            "kv_blocks_total": self.allocator.num_blocks,
            "kv_blocks_free": self.allocator.num_free,
            "kv_blocks_cached": self.prefix_cache.num_blocks if self.prefix_cache is not None else 0,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "preemptions": self.scheduler.num_preemptions,
            "live_requests": len(self._requests),
            "tensor_parallel_size": self.runner.tensor_parallel_size,
            "slot_table_checks": self.runner.slot_table_checks,
        }
