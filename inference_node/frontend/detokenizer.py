"""Incremental detokenization with stop strings, so text streams token by token.

Each token goes through the tokenizer's own incremental decoder (`tokenizers`' DecodeStream:
the "prefix/read offset" method in Rust, one call per token, text held back while a token
ends inside a multi-byte character), and text that may be the start of a stop string is held
back so a client never sees part of one.
"""
from __future__ import annotations

from typing import Callable, Sequence

StepDecode = Callable[[int], "str | None"]   # the text a new token completes, if any


class TextStream:
    def __init__(self, step: StepDecode, stop: Sequence[str]) -> None:
        self._step = step
        self._stop = [s for s in stop if s]
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self.text = ""           # all text decoded so far (truncated at a stop string)
        self._sent = 0           # characters of text already handed out
        self.stopped = False

    def push(self, token_id: int) -> None:
        """Feeds the next output token."""
        piece = self._step(token_id)
        if piece:
            start = max(len(self.text) - self._holdback, 0)
            self.text += piece
            if self._stop:
                self._check_stop(start)

    def _check_stop(self, search_from: int) -> None:
        hits = [i for i in (self.text.find(s, search_from) for s in self._stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True

    def take(self, final: bool) -> str:
        """Text not yet handed out; keeps back a possible stop-string prefix unless final."""
        end = len(self.text) if (final or self.stopped) else max(len(self.text) - self._holdback, self._sent)
        chunk = self.text[self._sent:end]
        self._sent = end
        return chunk
