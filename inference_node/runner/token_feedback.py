"""Sampled tokens kept on the device for the next step, and copied to the host without a stall.

The engine launches step n+1 before it reads step n's tokens (so scheduling, input writes
and streaming overlap the GPU). Step n+1's inputs therefore take the tokens step n sampled
from a device buffer, `tokens`, where row i holds the token of step n's i-th sampled request
(Request.feedback_row). The same tokens go to the host through a pinned buffer and an event,
read one step later by `SampledTokens.wait`. A row whose logits were not finite reaches the
host as NON_FINITE in the same copy (no sync of its own), while the device keeps a valid
token for it so the next step, already launched, reads a real vocabulary index. The
log-probabilities of the rows that ask for them travel in the same way, behind the same event.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.protocol import MAX_TOP_LOGPROBS, TokenLogprobs
from .sampler import StepLogprobs

NON_FINITE = -1  # a host token: that row's logits held NaN or Inf


@dataclass
class HostLogprobs:
    """A step's log-probabilities in host buffers (valid once the step's copy finished)."""

    rows: list[int]
    tops: list[int]
    chosen: torch.Tensor       # [k] float32
    top_ids: torch.Tensor      # [k, most asked] int64
    top_values: torch.Tensor   # [k, most asked] float32


@dataclass
class SampledTokens:
    """One step's sampled tokens on their way to the host."""

    host: torch.Tensor
    count: int
    copied: torch.cuda.Event | None
    logprobs: HostLogprobs | None = None

    def wait(self) -> list[int]:
        """The tokens, after the step and its copy finished (the step's one host sync);
        NON_FINITE for a row whose logits were not finite."""
        if self.copied is not None:
            self.copied.synchronize()
        return self.host[:self.count].tolist()

    def token_logprobs(self) -> list[TokenLogprobs | None]:
        """After wait: each row's log-probabilities, None for rows that did not ask."""
        out: list[TokenLogprobs | None] = [None] * self.count
        lp = self.logprobs
        if lp is None:
            return out
        chosen, ids, values = lp.chosen.tolist(), lp.top_ids.tolist(), lp.top_values.tolist()
        for j, (row, top) in enumerate(zip(lp.rows, lp.tops)):
            out[row] = (chosen[j], ids[j][:top], values[j][:top])
        return out


class TokenFeedback:
    def __init__(self, max_rows: int, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.tokens = torch.zeros(max_rows, dtype=torch.long, device=device)
        # Two host buffers: step n+1's copy is queued while the host has not yet read step n's.
        self._host = [torch.zeros(max_rows, dtype=torch.long, pin_memory=self.cuda) for _ in range(2)]
        self._logprobs = [(torch.zeros(max_rows, pin_memory=self.cuda),
                           torch.zeros(max_rows * MAX_TOP_LOGPROBS, dtype=torch.long, pin_memory=self.cuda),
                           torch.zeros(max_rows * MAX_TOP_LOGPROBS, pin_memory=self.cuda)) for _ in range(2)]
        self._events = [torch.cuda.Event() if self.cuda else None for _ in range(2)]
        self._turn = 0

    def publish(self, chosen: torch.Tensor, finite: torch.Tensor | None = None,
                logprobs: StepLogprobs | None = None) -> SampledTokens:
        """Queues chosen ([k] int64 on the device, valid ids) into `tokens`, and toward the
        host with NON_FINITE where `finite` ([k] bool) is false; `logprobs` toward the host."""
        count = chosen.numel()
        turn = self._turn
        host, event = self._host[turn], self._events[turn]
        self._turn ^= 1
        if count:
            self.tokens[:count].copy_(chosen)
            marked = chosen if finite is None else torch.where(finite, chosen, NON_FINITE)
            host[:count].copy_(marked, non_blocking=self.cuda)
        on_host = None
        if logprobs is not None:
            k, top = len(logprobs.rows), logprobs.top_ids.shape[1]
            chosen_buf, ids_buf, values_buf = self._logprobs[turn]
            # Contiguous [k, top] views, so each is one plain copy.
            on_host = HostLogprobs(logprobs.rows, logprobs.tops, chosen_buf[:k], ids_buf[:k * top].view(k, top),
                                   values_buf[:k * top].view(k, top))
            on_host.chosen.copy_(logprobs.chosen, non_blocking=self.cuda)
            on_host.top_ids.copy_(logprobs.top_ids, non_blocking=self.cuda)
            on_host.top_values.copy_(logprobs.top_values, non_blocking=self.cuda)
        if event is not None:
            event.record()
        return SampledTokens(host, count, event, on_host)
