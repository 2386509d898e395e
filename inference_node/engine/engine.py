"""The engine loop: a single thread owns the model, the KV cache and the scheduler.

Other threads only talk to it through a command queue (`submit`, `abort`, `call`), and
receive results through each request's `emit` callback, so no lock guards model state. The
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
"""
from __future__ import annotations

import gc
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol

from ..model.forward import LoraApplier
from ..model.llama import LlamaModel
from ..runner.batch import HostBatch, build_host_batch
from ..runner.decode_graphs import DecodeGraphs, GraphLora, StagedStep, ordered
from ..runner.graph_plan import GraphPlan
from ..runner.launches import StepLaunches
from .kv_cache import BlockAllocator, KVCache
from ..runner.piecewise_graphs import PiecewiseGraphs, PiecewiseLora, StagedPieces
from .prefix_cache import NamespaceStats, PrefixCache, split_namespace
from .request import Request, Status, StreamEvent
from ..runner.sampler import row_finite, sample_on_device
from .scheduler import AdapterBinder, ScheduledChunk, Scheduler, SchedulerConfig
from ..runner.token_feedback import NON_FINITE, SampledTokens, TokenFeedback
from ..runner.warmup import warm_up

log = logging.getLogger(__name__)


class InvalidRequest(ValueError):
    """The request can never run as given (the caller answers INVALID_ARGUMENT)."""


class QueueFull(RuntimeError):
    """Too many requests in flight; the caller answers RESOURCE_EXHAUSTED."""


class EngineStopped(RuntimeError):
    """The engine is shutting down and takes no new work (UNAVAILABLE)."""


class NotStarted(EngineStopped):
    """A drain refused a request that had streamed nothing yet: safe to retry on another node."""


class CutShort(EngineStopped):
    """The drain deadline ended a request that had already streamed part of its answer."""


class NonFiniteLogits(RuntimeError):
    """The base model's logits were not finite for a request (INTERNAL: a fault of the node
    or its checkpoint, not of the request)."""


class LoraProvider(AdapterBinder, Protocol):
    """The adapters' lifecycles: which adapter version a request binds to and when its slot
    is ready (inference_node.adapters.AdapterManager)."""

    def busy(self) -> bool: ...
    def prepare(self, waiting: Iterable[Request]) -> None: ...
    def collect_failures(self, waiting: Iterable[Request]) -> list[tuple[Request, Exception]]: ...
    def check_consistency(self, live: Iterable[Request]) -> None: ...
    def set_namespace_listener(self, on_dropped: Callable[[str], object]) -> None: ...
    def numerical_fault(self, request: Request) -> Exception: ...


class LoraPlan(Protocol):
    """Which kernels add each step's LoRA deltas (inference_node.runner.lora.LoraStepPlan)."""

    max_loras: int
    def applier(self, chunks: list[ScheduledChunk]) -> LoraApplier | None: ...
    def warmup_applier(self, token_slots: list[int]) -> LoraApplier: ...
    def graph_lora(self, max_tokens: int) -> GraphLora: ...
    def piecewise_lora(self) -> PiecewiseLora: ...


class OtherRanks(Protocol):
    """A tensor-parallel node's ranks beside this one (inference_node.parallel.workers.Workers):
    they run every step's forward with it and mirror its adapter slots."""

    size: int
    table_checks: int
    def step(self, host: HostBatch, chunk_slots: list[tuple[int, int]], tp: Any, input_ids: Any) -> None: ...
    def graph_step(self, step: StagedStep) -> None: ...
    def pieces_step(self, step: StagedPieces) -> None: ...
    def capture_graphs(self, plan: GraphPlan) -> None: ...
    def check_slot_tables(self) -> None: ...


@dataclass(frozen=True)
class EngineConfig:
    num_kv_blocks: int
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_queue: int = 1024
    max_model_len: int = 4096
    prefix_caching: bool = True
    decode_graphs: bool = False      # decode steps through static buffers (CUDA graphs on CUDA)
    max_graph_batch: int = 64        # largest decode batch replayed from a graph
    piecewise_graphs: bool = False      # other steps piece by piece through static buffers (CUDA graphs on CUDA)
    prefill_delay_factor: float = 0.0  # admission waits this x the last prefill step (scheduler.py)
    refill_wait_factor: float = 1.0    # after a burst of finishes, their replacements share a prefill step (scheduler.py)
    warmup: str = "auto"             # compile eager steps' kernels at start (warmup.py): auto = on CUDA
    debug_checks: bool = False


@dataclass
class LaunchedStep:
    """A step whose forward and sampling are queued on the device; its tokens not yet read."""

    chunks: list[ScheduledChunk]
    sampling: list[Request]
    tokens: SampledTokens
    started: float = 0.0             # time.monotonic() when it was scheduled
    prefill: bool = False            # it carries prompt tokens


@dataclass
class EngineStats:
    steps: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    preemptions: int = 0
    max_adapters_in_step: int = 0
    graph_steps: int = 0             # decode steps replayed from CUDA graphs (static buffers)
    eager_decode_steps: int = 0      # decode-only steps that ran eagerly (larger than the graphs)
    eager_prefill_steps: int = 0     # steps with prompt tokens (prefill chunks, maybe beside decodes) run eagerly
    piecewise_graph_steps: int = 0   # other steps than decode graphs', replayed piece by piece (piecewise_graphs.py)
    cut_short: int = 0               # answers ended part-way by shutdown
    non_finite_rows: int = 0         # sampled rows whose logits held NaN or Inf (their requests failed)


class Engine:
    def __init__(self, model: LlamaModel, config: EngineConfig,
                 lora: LoraProvider | None = None, lora_plan: LoraPlan | None = None,
                 ranks: OtherRanks | None = None, launches: StepLaunches | None = None) -> None:
        """lora (the adapters' lifecycles) and lora_plan (the steps' LoRA kernels) go
        together; None: LoRA disabled, base model only. ranks: the other ranks of a
        tensor-parallel node (this engine is rank 0), which run every step eagerly with it."""
        if (lora is None) != (lora_plan is None):
            raise ValueError("LoRA needs both the adapter manager and the step plan")
        warms_up = config.warmup == "on" or (config.warmup == "auto" and model.device.type == "cuda")
        if ranks is not None and warms_up:
            raise ValueError("the warm-up's forwards are not run on every tensor-parallel rank: "
                             "a tensor-parallel engine takes warmup='off'")
        self.ranks = ranks
        self.model = model
        self.launches = launches or StepLaunches.fixed(model.device)
        self.config = config
        self.lora = lora
        self.lora_plan = lora_plan
        self.allocator = BlockAllocator(config.num_kv_blocks)
        self.warmup_forwards = 0  # synthetic eager forwards run at start (warmup.py)
        # One block more than the allocator hands out: the scratch block of padded graph rows
        # (and of the warm-up's forwards).
        self.scratch_block = config.num_kv_blocks
        self.kv = KVCache(model.config, config.num_kv_blocks + 1, config.block_size, model.dtype, model.device)
        self.feedback = TokenFeedback(config.max_num_seqs, model.device)
        self._launched: LaunchedStep | None = None
        self.decode_graphs: DecodeGraphs | None = None
        if config.decode_graphs:
            max_batch = min(config.max_num_seqs, config.max_graph_batch)
            self.decode_graphs = DecodeGraphs(
                model, self.launches, self.kv, scratch_block=self.scratch_block, max_model_len=config.max_model_len,
                max_batch=max_batch, feedback=self.feedback.tokens,
                lora=lora_plan.graph_lora(max_batch) if lora_plan is not None else None)
            if ranks is not None:  # every rank replays the graph rank 0 stages
                self.decode_graphs.mirror = ranks.graph_step
        self.piecewise_graphs: PiecewiseGraphs | None = None
        if config.piecewise_graphs:
            self.piecewise_graphs = PiecewiseGraphs(
                model, self.launches, self.kv, scratch_block=self.scratch_block, max_model_len=config.max_model_len,
                max_tokens=config.max_num_batched_tokens, max_seqs=config.max_num_seqs,
                feedback=self.feedback.tokens,
                lora=lora_plan.piecewise_lora() if lora_plan is not None else None)
            if ranks is not None:  # every rank runs the pieces rank 0 stages
                self.piecewise_graphs.mirror = ranks.pieces_step
        sched_cfg = SchedulerConfig(block_size=config.block_size, max_num_seqs=config.max_num_seqs,
                                    max_num_batched_tokens=config.max_num_batched_tokens,
                                    prefill_delay_factor=config.prefill_delay_factor,
                                    refill_wait_factor=config.refill_wait_factor)
        self.prefix_cache = PrefixCache(self.allocator, config.block_size) if config.prefix_caching else None
        self.scheduler = Scheduler(sched_cfg, self.allocator, lora, self.prefix_cache)
        if lora is not None and self.prefix_cache is not None:
            lora.set_namespace_listener(self.prefix_cache.drop_namespace)
        self.stats = EngineStats()
        self.eos_ids = frozenset(model.config.eos_token_ids)
        self._commands: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._requests: dict[int, Request] = {}
        self._inflight = 0
        self._inflight_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._accepting = True
        self._stop = threading.Event()

    # -- public, thread-safe -----------------------------------------------------------------
    def start(self) -> None:
        """Prepares the engine and runs its loop on a thread of its own."""
        self.prepare()
        self._thread = threading.Thread(target=self.run_forever, name="engine-loop", daemon=True)
        self._thread.start()

    def prepare(self) -> None:
        """Compiles, captures and freezes what the loop needs, before it runs."""
        if self.config.warmup == "on" or (self.config.warmup == "auto" and self.model.device.type == "cuda"):
            self.warmup_forwards = warm_up(self)
        if self.ranks is not None:  # the ranks capture beside this one: the collectives meet
            decode, pieces = self.decode_graphs, self.piecewise_graphs
            self.ranks.capture_graphs(GraphPlan(
                self.scratch_block, self.config.max_model_len, self.feedback.tokens.numel(),
                decode.max_batch if decode is not None else 0, pieces.max_tokens if pieces is not None else 0,
                pieces.max_seqs if pieces is not None else 0))
        if self.decode_graphs is not None:
            self.decode_graphs.capture_all()
        if self.piecewise_graphs is not None:
            self.piecewise_graphs.capture_all()
        # Start-up objects (the model, torch, the graphs: hundreds of thousands) live as long as
        # the process. Frozen, a full garbage collection no longer walks them: unfrozen, one
        # took 160-180 ms on the development CPU, a stall of dozens of decode steps.
        gc.collect()
        gc.freeze()

    def validate(self, prompt_len: int, max_tokens: int) -> None:
        cfg = self.config
        if prompt_len == 0:
            raise InvalidRequest("the prompt is empty")
        if prompt_len >= cfg.max_model_len:
            raise InvalidRequest(f"the prompt has {prompt_len} tokens; this node's limit is "
                                 f"{cfg.max_model_len - 1} (max model length {cfg.max_model_len})")
        capacity = cfg.num_kv_blocks * cfg.block_size
        if prompt_len + 1 > capacity:
            raise InvalidRequest(f"the prompt needs {prompt_len + 1} KV slots; the whole KV "
                                 f"cache holds {capacity}")

    def submit(self, request: Request) -> None:
        if not self._accepting:
            raise NotStarted("the node is draining and takes no new requests: retry on another node")
        self.validate(len(request.prompt_token_ids), request.params.max_tokens)
        with self._inflight_lock:
            if self._inflight >= self.config.max_queue + self.config.max_num_seqs:
                raise QueueFull(f"{self._inflight} requests in flight: the node's queue is full, "
                                "retry later")
            self._inflight += 1
        self._commands.put(("add", request))

    def abort(self, request_id: int) -> None:
        self._commands.put(("abort", request_id))

    def call(self, fn: Callable[[], Any]) -> Future:
        """Runs fn on the loop thread (between steps) and returns its future."""
        future: Future = Future()
        self._commands.put(("call", (fn, future)))
        return future

    def stop_accepting(self) -> None:
        self._accepting = False

    def drain(self) -> None:
        """Takes no new work and refuses every request that has streamed nothing yet (waiting,
        loading its adapter, or in its prefill) with NotStarted; running answers go on. The
        caller waits for num_inflight() to reach zero, then calls shutdown()."""
        self._accepting = False
        self._commands.put(("drain", None))

    def shutdown(self, timeout: float = 5.0) -> None:
        self._accepting = False
        self._stop.set()
        self._commands.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout)
        gc.unfreeze()  # what start froze may be collected again (and is, at interpreter exit)

    def release_graphs(self) -> None:
        """Drops the captured graphs once the loop has ended: graphs that captured NCCL
        collectives may hold their communicators, so a tensor-parallel group ends after."""
        self.decode_graphs = self.piecewise_graphs = None

    def num_inflight(self) -> int:
        with self._inflight_lock:
            return self._inflight

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
            self._requests[arg.id] = arg
            self.scheduler.add(arg)
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
        launched = self._launch(chunks)
        if launched is not None:
            launched.started, launched.prefill = started, prefill
        if self._launched is not None:
            self._resolve()
        self._launched = launched
        if self.config.debug_checks:
            self.check_consistency()

    def _launch(self, chunks: list[ScheduledChunk]) -> LaunchedStep | None:
        """Queues the step's forward and sampling; the requests' counters move on at once."""
        graph_step = self.decode_graphs is not None and self.decode_graphs.fits(chunks)
        if graph_step:
            chunks = ordered(chunks)  # each adapter's rows one run: the LoRA kernels' layout
        piecewise = (not graph_step and self.piecewise_graphs is not None
                     and self.piecewise_graphs.fits(chunks))
        sampling = [c.request for c in chunks if c.completes_prompt]
        try:
            distinct = len({c.request.lora_slot for c in chunks if c.request.lora_slot >= 0})
            self.stats.max_adapters_in_step = max(self.stats.max_adapters_in_step, distinct)
            greedy = finite = None
            if graph_step:
                logits, greedy, finite = self.decode_graphs.run(chunks)
                self.stats.graph_steps += 1
            elif piecewise:
                logits, greedy, finite = self.piecewise_graphs.run(chunks)
                self.stats.piecewise_graph_steps += 1
            else:
                if any(c.request.in_prefill for c in chunks):
                    self.stats.eager_prefill_steps += 1
                else:
                    self.stats.eager_decode_steps += 1
                host = build_host_batch(chunks, self.config.block_size)
                batch = host.to_device(self.model.device, self.feedback.tokens)
                applier = self.lora_plan.applier(chunks) if self.lora_plan is not None else None
                if self.ranks is not None:  # the other ranks run the same forward beside this one
                    self.ranks.step(host, [(c.request.lora_slot, c.num_new_tokens) for c in chunks],
                                    self.model.tp, batch.input_ids)
                launch = self.launches.for_step(len(batch.input_ids), distinct)  # its bucket's
                logits = self.model.forward(batch, self.kv.k, self.kv.v, launch, applier)
                finite = row_finite(logits)
            tokens = self.feedback.publish(sample_on_device(logits, sampling, greedy, finite), finite)
        except Exception as exc:  # a failed step fails its requests, the node keeps serving
            log.exception("engine step failed")
            for c in chunks:
                self._finish(c.request, "error", error=exc)
            return None
        self.stats.steps += 1
        for c in chunks:
            req = c.request
            if req.num_computed < len(req.prompt_token_ids):
                self.stats.prompt_tokens += min(c.num_new_tokens, len(req.prompt_token_ids) - req.num_computed)
            req.num_computed += c.num_new_tokens
        for row, req in enumerate(sampling):
            req.num_pending += 1
            req.feedback_row = row
            req.last_token_pending = (len(req.output_token_ids) + req.num_pending >= req.params.max_tokens
                                      or req.num_tokens >= self.config.max_model_len)
        self.stats.preemptions = self.scheduler.num_preemptions
        self.stats.cached_prompt_tokens = self.scheduler.num_cached_prompt_tokens
        return LaunchedStep(chunks, sampling, tokens)

    def _resolve(self) -> None:
        """Waits for the launched step's tokens and streams them. Requests that ended (or were
        cancelled) since it was launched drop theirs."""
        step, self._launched = self._launched, None
        try:
            tokens = step.tokens.wait()
        except Exception as exc:  # a device error surfaces here, at the step's one sync
            log.exception("engine step failed")
            for c in step.chunks:
                self._finish(c.request, "error", error=exc)
            return
        if step.prefill:
            self.scheduler.note_prefill_step(time.monotonic() - step.started)
        for req, token in zip(step.sampling, tokens):
            if req.status is Status.FINISHED:
                continue
            req.num_pending -= 1
            if token == NON_FINITE:
                self._fail_non_finite(req)
                continue
            req.output_token_ids.append(token)
        if self.prefix_cache is not None:  # now that the blocks' tokens are known on the host
            for c in step.chunks:
                if c.request.status is not Status.FINISHED:
                    self.prefix_cache.insert(c.request)
        for req in step.sampling:
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

    def _on_token(self, req: Request) -> None:
        """The newest known token of req: stop checks, then stream it."""
        self.stats.generated_tokens += 1
        token = req.output_token_ids[-1]
        reason = None
        if token in self.eos_ids and not req.params.ignore_eos:
            reason = "stop"
        elif (len(req.output_token_ids) >= req.params.max_tokens
              or req.num_known_tokens >= self.config.max_model_len):
            reason = "length"
        if reason is not None:
            self._finish(req, reason)
        else:
            self._emit(req, None)

    def _emit(self, req: Request, reason: str | None, error: BaseException | None = None) -> None:
        new_ids = req.output_token_ids[req.emitted_tokens:]
        first = req.emitted_tokens == 0
        req.emitted_tokens = len(req.output_token_ids)
        event = StreamEvent(token_ids=new_ids, finish_reason=reason, error=error)
        if first or reason is not None:  # what the answer was computed with, known from its start
            event.cached_prompt_tokens = req.num_cached_prompt_tokens
            event.adapter_version = req.adapter_version
        if reason is not None:
            event.prompt_tokens = len(req.prompt_token_ids)
            event.completion_tokens = len(req.output_token_ids)
        if new_ids or reason is not None:
            try:
                req.emit(event)
            except Exception:  # a broken consumer must not stop the loop
                log.exception("request %s: emit failed", req.id)

    def _finish(self, req: Request, reason: str, error: BaseException | None = None) -> None:
        if self._requests.pop(req.id, None) is None:
            return
        self.scheduler.remove(req)
        req.num_pending = 0  # a token still on the device for it is dropped
        with self._inflight_lock:
            self._inflight -= 1
        self._emit(req, reason, error)

    # -- invariants ------------------------------------------------------------------------------
    def check_consistency(self) -> None:
        """Every KV block is free, cached-idle or owned, exactly once; each block's reference
        count equals the live requests holding it; the prefix index agrees with the allocator;
        every adapter reference count equals the live requests bound to it (raises otherwise)."""
        holders: dict[int, int] = {}
        for req in self._requests.values():
            if len(set(req.block_ids)) != len(req.block_ids):
                raise AssertionError(f"request {req.id} holds a KV block twice")
            for b in req.block_ids:
                holders[b] = holders.get(b, 0) + 1
        for b in range(self.allocator.num_blocks):
            if self.allocator.ref_count(b) != holders.get(b, 0):
                raise AssertionError(f"KV block {b} has ref count {self.allocator.ref_count(b)}, "
                                     f"held by {holders.get(b, 0)} live requests")
        self.allocator.check_consistency()
        if self.prefix_cache is not None:
            self.prefix_cache.check_consistency()
        elif self.allocator.num_cached_idle:
            raise AssertionError("cached KV blocks without a prefix cache")
        live = set(self._requests)
        queued = {r.id for r in self.scheduler.running} | {r.id for r in self.scheduler.waiting}
        if queued != live:
            raise AssertionError(f"scheduler holds {sorted(queued)} but live requests are {sorted(live)}")
        if self.lora is not None:
            self.lora.check_consistency(self._requests.values())
        if self.ranks is not None:
            self.ranks.check_slot_tables()

    def prefix_cache_rows(self) -> list[tuple[tuple[str, str], NamespaceStats]]:
        """((adapter, version), counters) per live KV namespace; "" adapter = the base model."""
        if self.prefix_cache is None:
            return []
        return [(split_namespace(ns), stats) for ns, stats in sorted(self.prefix_cache.stats.items())]

    def snapshot(self) -> dict[str, int]:
        """Counters for stats RPCs; call through `call` from other threads."""
        return {
            "kv_blocks_total": self.allocator.num_blocks,
            "kv_blocks_free": self.allocator.num_free,
            "kv_blocks_cached": self.prefix_cache.num_blocks if self.prefix_cache is not None else 0,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "steps": self.stats.steps,
            "generated_tokens": self.stats.generated_tokens,
            "prompt_tokens": self.stats.prompt_tokens,
            "cached_prompt_tokens": self.stats.cached_prompt_tokens,
            "preemptions": self.scheduler.num_preemptions,
            "live_requests": len(self._requests),
            "max_adapters_in_step": self.stats.max_adapters_in_step,
            "graph_steps": self.stats.graph_steps,
            "eager_decode_steps": self.stats.eager_decode_steps,
            "eager_prefill_steps": self.stats.eager_prefill_steps,
            "piecewise_graph_steps": self.stats.piecewise_graph_steps,
            "cut_short": self.stats.cut_short,
            "non_finite_rows": self.stats.non_finite_rows,
            "tensor_parallel_size": self.ranks.size if self.ranks is not None else 1,
            "slot_table_checks": self.ranks.table_checks if self.ranks is not None else 0,
        }
