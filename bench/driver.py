"""An engine driven in process from the calling thread, as the benchmarks measure it: every
request's timings (submit, first and last token, finish) and every decode step's (its call,
the forward on the device, the host's share), without a synchronize of its own."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from bench.harness import Spec, sync


@dataclass
class ReqRecord:
    submit: float = 0.0
    first: float | None = None
    last: float | None = None
    done: float | None = None
    tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class DecodeStep:
    seconds: float
    batch: int
    adapters: frozenset[str]
    kv_tokens: int
    forward: float = float("nan")   # the model's forward alone (graph replay or eager), device time
    host: float = float("nan")      # the part of `seconds` not spent waiting for sampled tokens
    marks: list = field(default_factory=list)   # its CUDA event pairs (CPU: seconds) until read
    boundary: bool = False          # the call it is charged to also launched a prefill/mixed step


class Driver:
    """Runs requests through an engine from this thread. Closed loop: `concurrency` requests
    in flight, the next submitted when one finishes; Poisson: each at its arrival time."""

    def __init__(self, engine, device: torch.device, concurrency: int, poisson: bool,
                 stall_seconds: float = 300.0) -> None:
        self.engine, self.device, self.concurrency, self.poisson = engine, device, concurrency, poisson
        self.stall_seconds = stall_seconds

    def run(self, specs: list[Spec], max_tokens: Callable[[Spec], int] | None = None,
            grammar: str = "") -> tuple[list[ReqRecord], list[DecodeStep]]:
        """Requests run to max_tokens (ignore_eos), or under a `grammar` until it is complete."""
        from inference_node.engine.request import Request, SamplingParams
        from inference_node.runner.token_feedback import SampledTokens

        engine = self.engine
        records = [ReqRecord() for _ in specs]
        steps: list[DecodeStep] = []
        order = sorted(range(len(specs)), key=lambda i: (specs[i].arrival, i))
        state = {"next": 0, "inflight": 0, "finished": 0}
        t0 = time.perf_counter()

        def submit(i: int, at: float) -> None:
            spec = specs[i]
            records[i].submit = at
            n = max_tokens(spec) if max_tokens else spec.max_tokens
            engine.submit(Request(list(spec.prompt), SamplingParams(max_tokens=n, ignore_eos=not grammar),
                                  emit=lambda ev, i=i: on_event(i, ev), adapter=spec.adapter,
                                  request_id=f"bench-{i}", grammar_source=grammar))
            state["inflight"] += 1

        def submit_next(now: float) -> None:
            if state["next"] < len(order):
                state["next"] += 1
                submit(order[state["next"] - 1], now)

        def on_event(i: int, ev) -> None:
            now = time.perf_counter()
            rec = records[i]
            if ev.token_ids:
                rec.first = rec.first or now
                rec.last = now
                rec.tokens += len(ev.token_ids)
            if ev.finish_reason is not None:
                rec.done, rec.finish_reason = now, ev.finish_reason
                if ev.error is not None or ev.finish_reason == "error":
                    rec.error = f"{ev.finish_reason}: {ev.error}"
                state["inflight"] -= 1
                state["finished"] += 1
                if not self.poisson:
                    submit_next(now)

        # Which steps are pure decode: every scheduled chunk one decode token.
        pending_step: dict = {}
        original = engine.scheduler.schedule

        def schedule():
            chunks = original()
            if chunks:
                pending_step["launched"] = True
            if chunks and all(c.num_new_tokens == 1 and c.completes_prompt for c in chunks):
                adapters = frozenset(c.request.adapter for c in chunks if c.request.adapter)
                pending_step["decode"] = (len(chunks), adapters, sum(c.request.num_computed + 1 for c in chunks))
            return chunks

        # The forward's own time: CUDA events around the outermost call of the model's forward
        # or of a graph step's replays (on CPU: wall time), so host overhead shows apart.
        forward_marks: list = []
        depth = [0]

        def timed(fn):
            def wrapper(*a, **kw):
                depth[0] += 1
                try:
                    if depth[0] > 1:
                        return fn(*a, **kw)
                    if self.device.type == "cuda":
                        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        begin.record()
                        out = fn(*a, **kw)
                        end.record()
                        forward_marks.append((begin, end))
                    else:
                        t = time.perf_counter()
                        out = fn(*a, **kw)
                        forward_marks.append(time.perf_counter() - t)
                    return out
                finally:
                    depth[0] -= 1
            return wrapper

        # Time blocked on the device for sampled tokens: the rest of a step is host work. When
        # host work is shorter than the GPU's step, the GPU sets the pace.
        waited = [0.0]
        original_wait = SampledTokens.wait

        def timed_wait(tokens):
            t = time.perf_counter()
            try:
                return original_wait(tokens)
            finally:
                waited[0] += time.perf_counter() - t

        runner = engine.runner
        hooked = [(runner.model, "forward")] + [(g, "run") for g in (runner.decode_graphs, runner.piecewise_graphs)
                                                 if g is not None]
        SampledTokens.wait = timed_wait
        engine.scheduler.schedule = schedule
        for obj, name in hooked:
            setattr(obj, name, timed(getattr(obj, name)))
        try:
            if not self.poisson:
                for _ in range(min(self.concurrency, len(specs))):
                    submit_next(t0)
            last_progress, seen = time.perf_counter(), 0
            outstanding = None  # (decode info or None, forward marks) of the step not yet read
            while state["finished"] < len(specs):
                now = time.perf_counter()
                if self.poisson:
                    while state["next"] < len(order) and t0 + specs[order[state["next"]]].arrival <= now:
                        submit_next(t0 + specs[order[state["next"]]].arrival)
                    if state["inflight"] == 0:
                        time.sleep(max(0.0, min(t0 + specs[order[state["next"]]].arrival - now, 0.01)))
                        continue
                pending_step.clear()
                forward_marks.clear()
                waited[0] = 0.0
                started = time.perf_counter()
                engine.run_once(block=False)  # no sync here: the engine overlaps its steps
                ended = time.perf_counter()
                # A call launches step n+1 and then waits for step n, so in steady state it lasts
                # as long as step n on the GPU: its time belongs to the step launched before it
                # (a decode step right after a long prefill step is not charged for the prefill).
                launched = bool(pending_step.get("launched"))
                if outstanding is not None and outstanding[0] is not None:
                    (batch, adapters, kv), marks = outstanding
                    boundary = launched and pending_step.get("decode") is None
                    steps.append(DecodeStep(ended - started, batch, adapters, kv, host=ended - started - waited[0],
                                            marks=marks, boundary=boundary))
                # The step this call launched is read by the next (a call that launched nothing only read).
                outstanding = (pending_step.get("decode"), list(forward_marks)) if launched else None
                progress = state["finished"] + sum(r.tokens for r in records)
                if progress != seen:
                    seen, last_progress = progress, ended
                elif ended - last_progress > self.stall_seconds:
                    raise RuntimeError(f"no progress for {self.stall_seconds:.0f}s "
                                       f"({state['finished']}/{len(specs)} finished)")
        finally:
            SampledTokens.wait = original_wait
            del engine.scheduler.schedule  # back to the class's methods
            for obj, name in hooked:
                delattr(obj, name)
        sync(self.device)
        for step in steps:  # CUDA events are read once the device is done with all of them
            step.forward = sum(m if isinstance(m, float) else m[0].elapsed_time(m[1]) * 1e-3
                               for m in step.marks) if step.marks else math.nan
            step.marks = []
        engine.check_consistency()
        errors = [r.error for r in records if r.error]
        if errors:
            raise RuntimeError(f"{len(errors)} requests failed, first: {errors[0]}")
        return records, steps
