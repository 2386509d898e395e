"""Sampled tokens kept on the device for the next step, and copied to the host without a stall.

The engine launches step n+1 before it reads step n's tokens (so scheduling, input writes
and streaming overlap the GPU). Step n+1's inputs therefore take the tokens step n sampled
from a device buffer, `tokens`, where row i holds the token of step n's i-th sampled request
(Request.feedback_row). The same tokens go to the host through a pinned buffer and an event,
read one step later by `SampledTokens.wait`. A row whose logits were not finite reaches the
host as NON_FINITE in the same copy (no sync of its own), while the device keeps a valid
token for it so the next step, already launched, reads a real vocabulary index.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

NON_FINITE = -1  # a host token: that row's logits held NaN or Inf

@dataclass
class SampledTokens:
    """One step's sampled tokens on their way to the host."""

    host: torch.Tensor
    count: int
    copied: torch.cuda.Event | None

    def wait(self) -> list[int]:
        """The tokens, after the step and its copy finished (the step's one host sync);
        NON_FINITE for a row whose logits were not finite."""
        if self.copied is not None:
            self.copied.synchronize()
        return self.host[:self.count].tolist()


class TokenFeedback:
    def __init__(self, max_rows: int, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.tokens = torch.zeros(max_rows, dtype=torch.long, device=device)
        # Two host buffers: step n+1's copy is queued while the host has not yet read step n's.
        self._host = [torch.zeros(max_rows, dtype=torch.long, pin_memory=self.cuda) for _ in range(2)]
        self._events = [torch.cuda.Event() if self.cuda else None for _ in range(2)]
        self._turn = 0

    def publish(self, chosen: torch.Tensor, finite: torch.Tensor | None = None) -> SampledTokens:
        """Queues chosen ([k] int64 on the device, valid ids) into `tokens`, and toward the
        host with NON_FINITE where `finite` ([k] bool) is false."""
        count = chosen.numel()
        host, event = self._host[self._turn], self._events[self._turn]
        self._turn ^= 1
        if count:
            self.tokens[:count].copy_(chosen)
            marked = chosen if finite is None else torch.where(finite, chosen, NON_FINITE)
            host[:count].copy_(marked, non_blocking=self.cuda)
        if event is not None:
            event.record()
        return SampledTokens(host, count, event)
