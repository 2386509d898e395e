"""Structured output: each constrained request's grammar matcher (llguidance), and the masks of
the tokens it allows next.

A front end turns a response format into an llguidance grammar (inference_node/frontend/response_format.py)
and has already checked that it compiles; here it is compiled against the model's vocabulary
on a thread of its own, never on the engine loop (the vocabulary's tables take seconds to
build once, a schema milliseconds to seconds), while the request waits. The loop then moves
each matcher on by the tokens its request samples and, before a step samples a constrained
request, fills a bitmask of the tokens its grammar allows (runner/sampler.py applies it).
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

import llguidance
import llguidance.numpy
import numpy as np

from .errors import InvalidRequest

log = logging.getLogger(__name__)


class GrammarError(InvalidRequest):
    """A response format that does not compile against this model (INVALID_ARGUMENT)."""


class Grammar:
    """One request's matcher: where its answer is in the grammar."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def accept(self, token: int) -> bool:
        """Moves on by a sampled token; False if the grammar does not allow it (the mask did)."""
        return self.matcher.consume_token(token)

    @property
    def complete(self) -> bool:
        """The answer is whole: the grammar allows nothing after it but the end of sequence."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error()


def mask_words(vocab_size: int) -> int:
    """int32 words of one row's bitmask (bit t of word t // 32 allows token t)."""
    return (vocab_size + 31) // 32


class GrammarCompiler:
    """Compiles grammars against the model's vocabulary off the engine loop, and fills the
    masks of a step's constrained rows."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_token_ids: Sequence[int],
                 parallel_masks: bool = False) -> None:
        """vocab_size: the model's logits width (may exceed the tokenizer's: those ids are never
        allowed); eos_token_ids: what ends a complete answer. parallel_masks: fill a step's
        masks on the library's threads, for a GPU node, whose host cores are idle while the
        device runs the forward; on a CPU node they run the forward, and threads that spin
        between steps take them from it (measured: bench/structured_output.py), so one
        thread fills the masks."""
        self.tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self._executor = llguidance.LLExecutor() if parallel_masks else None
        self._lock = threading.Lock()

    def _vocabulary(self) -> llguidance.LLTokenizer:
        """The vocabulary's tables, built at the first constrained request (about a second)."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(self.tokenizer_json.read_text(), n_vocab=self.vocab_size,
                                                         eos_token=self.eos_token_ids)
            return self._tokenizer

    def compile(self, grammar: str) -> Future:
        """Compiles `grammar` (llguidance's JSON) on the compiler's thread: a future of its
        Grammar, or of GrammarError."""
        def run() -> Grammar:
            try:
                matcher = llguidance.LLMatcher(self._vocabulary(), grammar, log_level=0)
            except Exception as exc:  # the library's own failure: the request ends with it
                log.exception("compiling a grammar failed")
                raise GrammarError(f"response_format does not compile: {exc}") from None
            if matcher.is_error():
                raise GrammarError(f"response_format does not compile: {matcher.get_error()}")
            return Grammar(matcher)

        return self._pool.submit(run)

    def fill_masks(self, grammars: Sequence[Grammar], out: np.ndarray) -> None:
        """Row i of `out` ([>= len(grammars), mask_words] int32, C-contiguous) gets the tokens
        grammars[i] allows next."""
        if self._executor is not None and len(grammars) > 1:
            llguidance.numpy.fill_next_token_bitmask_par(
                self._executor, [(g.matcher, i) for i, g in enumerate(grammars)], out[:len(grammars)])
            return
        for i, grammar in enumerate(grammars):
            llguidance.numpy.fill_next_token_bitmask(grammar.matcher, out, i)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
