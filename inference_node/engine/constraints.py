"""Structured output on the engine loop: which live requests are constrained, their grammars'
compilation, and each step's masks.

A grammar compiles off the loop from the request's submission (GrammarCompiler's thread), so
it is mostly done when the loop takes the request; until it is, the request waits out of the
scheduler. A step with constrained rows has its forward launched as any other; its sampling
is queued once the previous step's tokens have moved every matcher on, so the host fills the
masks while the device runs the forward (ModelRunner.sample).
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import Callable

import numpy as np

from ..runner.runner import StepRun
from ..runner.sampler import StepMasks
from .errors import InvalidRequest
from .grammar import GrammarCompiler, mask_words
from .request import Request, Status


class Constraints:
    def __init__(self, grammars: GrammarCompiler | None, max_rows: int) -> None:
        """grammars: None where structured output is not available (requests with one are refused)."""
        self.grammars = grammars
        self.max_rows = max_rows
        self.compiling: set[int] = set()   # live requests whose grammar is being compiled
        self._masks: np.ndarray | None = None

    def check(self, request: Request) -> None:
        """Raises InvalidRequest where the request has a grammar and this engine no compiler."""
        if request.grammar_source and self.grammars is None:
            raise InvalidRequest("structured output (response_format) is not available on this engine")

    def compile(self, request: Request) -> Future | None:
        """A future of the request's compiled grammar, started now (None: it has none)."""
        return self.grammars.compile(request.grammar_source) if request.grammar_source else None

    def wait(self, req: Request, compiled: Future, on_done: Callable[[], None]) -> None:
        """req waits for its grammar; on_done runs (on the compiler's thread) once it compiled."""
        self.compiling.add(req.id)
        compiled.add_done_callback(lambda _: on_done())

    def compiled(self, req: Request, compiled: Future) -> BaseException | None:
        """req's grammar is ready: it takes it, or the error it failed with is returned."""
        self.compiling.discard(req.id)
        if compiled.exception() is None:
            req.grammar = compiled.result()
        return compiled.exception()

    def masks(self, run: StepRun) -> StepMasks | None:
        """Each live constrained row's allowed tokens (rows of requests that ended allow
        anything: their token is dropped); None where the step has none."""
        rows = [i for i, req in enumerate(run.sampled) if req.grammar is not None and req.status is not Status.FINISHED]
        if not rows:
            return None
        if self._masks is None:
            self._masks = np.zeros((self.max_rows, mask_words(self.grammars.vocab_size)), dtype=np.int32)
        self.grammars.fill_masks([run.sampled[i].grammar for i in rows], self._masks)
        return StepMasks(rows, self._masks[:len(rows)])

    @staticmethod
    def refusal(req: Request, token: int) -> Exception | None:
        """Moves req's matcher on by token; the error if its grammar refuses it. The mask allowed
        only grammatical tokens, so a refusal is the node's fault (INTERNAL)."""
        if req.grammar is None or req.grammar.accept(token):
            return None
        return RuntimeError(f"structured output failed at output token {len(req.output_token_ids)} "
                            f"({token}): {req.grammar.error or 'the grammar refused the token'}")

    def close(self) -> None:
        if self.grammars is not None:
            self.grammars.close()
