"""Incremental detokenization with stop strings, so text streams token by token.

Decoding a whole output every step costs O(n) per token; this decodes only a short window
(the "prefix/read offset" method), and holds back text that may be the start of a stop
string so a client never sees part of one.
"""
from __future__ import annotations

from typing import Callable, Sequence

Decode = Callable[[Sequence[int]], str]


class TextStream:
    def __init__(self, decode: Decode, stop: Sequence[str]) -> None:
        self._decode = decode
        self._stop = [s for s in stop if s]
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self._prefix_offset = 0
        self._read_offset = 0
        self.text = ""           # all text decoded so far (truncated at a stop string)
        self._sent = 0           # characters of text already handed out
        self.stopped = False

    def add(self, token_ids: Sequence[int]) -> None:
        """Feeds the full output token list (the newest token last)."""
        prefix = self._decode(token_ids[self._prefix_offset:self._read_offset])
        full = self._decode(token_ids[self._prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            start = max(len(self.text) - self._holdback, 0)
            self.text += full[len(prefix):]
            self._prefix_offset = self._read_offset
            self._read_offset = len(token_ids)
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
