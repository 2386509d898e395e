"""Token sampling: greedy, temperature, top-k, top-p, each request with its own seeded RNG;
grammar masks for constrained rows, and log-probabilities for the rows that ask."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels.sampling import first_argmax

from ..engine.request import Request, SamplingParams


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Applies temperature, top-k and top-p to one row of logits; masked entries become -inf."""
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if 0.0 < params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        cumulative = probs.cumsum(-1) - probs
        drop = cumulative >= params.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(0, order, sorted_logits)
    return logits


def row_finite(logits: torch.Tensor) -> torch.Tensor:
    """[rows] bool, on the device: every logit of the row is finite. One reduction: a float32
    sum is NaN or Inf as soon as one term is (a row so large that finite terms overflow the
    sum is no healthier)."""
    return torch.isfinite(logits.sum(dim=-1, dtype=torch.float32))


def checked_greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's greedy token and its row_finite flag. A row that is not finite gets token 0:
    the argmax of NaNs may be any index, even past the vocabulary, and the next step reads
    this token on the device before the host has seen the flag."""
    finite = row_finite(logits)
    return torch.where(finite, first_argmax(logits), 0), finite


@dataclass(frozen=True)
class StepMasks:
    """The tokens each constrained row of a step may take: rows (indexes into the step's
    sampled rows) and their bitmasks on the host ([len(rows), words] int32; bit t of word
    t // 32 allows token t), from engine/grammar.py."""

    rows: list[int]
    bits: np.ndarray


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on the device without waiting for the queued step: a plain copy to
    a GPU waits for the stream to finish (the forward the host means to overlap); a copy from
    pinned memory is queued like a kernel (the caching host allocator keeps the pinned block
    until the copy has run)."""
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def allowed_tokens(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[k, vocab] bool from [k, words] int32 bitmasks. A row that allows nothing (its grammar
    failed) allows everything, so sampling stays defined; the engine ends that request."""
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab_size]
    return allowed | ~allowed.any(dim=-1, keepdim=True)


def sample_on_device(logits: torch.Tensor, requests: list[Request], greedy: torch.Tensor | None = None,
                     finite: torch.Tensor | None = None, masks: StepMasks | None = None) -> torch.Tensor:
    """The chosen tokens [N] int64, left on the logits' device (queued, no sync), each a valid
    vocabulary index. Greedy rows take the argmax of the logits as they are (widening bf16 to
    float32 is exact, so the choice is the same), or `greedy` where the caller computed it
    with checked_greedy (a decode graph does, with `finite`); sampled rows are widened to
    float32 first, and a row that is not finite samples from zeros instead (multinomial over
    NaN would fail the device). The rows of `masks` choose among the tokens their grammar
    allows (a copy of their logits is masked: the logits stay raw for logprobs)."""
    if greedy is None or finite is None:
        greedy, finite = checked_greedy(logits)
    if masks is None and all(req.params.greedy for req in requests):
        return greedy
    chosen = greedy.clone()
    constrained: dict[int, torch.Tensor] = {}
    if masks is not None and masks.rows:
        rows = to_device(torch.tensor(masks.rows), logits.device)
        allowed = allowed_tokens(to_device(torch.from_numpy(masks.bits), logits.device), logits.shape[-1])
        masked = logits[rows].float().masked_fill(~allowed, float("-inf"))
        chosen[rows] = torch.where(finite[rows], masked.argmax(dim=-1), 0)
        constrained = {row: masked[j] for j, row in enumerate(masks.rows)}
    for i, req in enumerate(requests):
        if req.params.greedy:
            continue
        if req.generator is None:
            req.generator = torch.Generator(device=logits.device)
            seed = req.params.seed if req.params.seed is not None else torch.seed()
            req.generator.manual_seed(seed)
        row = constrained[i] if i in constrained else logits[i].float()
        row = torch.where(finite[i], row, 0.0)
        probs = filter_logits(row, req.params).softmax(-1)
        chosen[i] = torch.multinomial(probs, 1, generator=req.generator)[0]
    return chosen


@dataclass(frozen=True)
class StepLogprobs:
    """Log-probabilities of a step's rows that ask for them, on the device: the sampled
    token's [k] and the top alternatives' ids and values [k, most asked]."""

    rows: list[int]          # indexes into the step's sampled rows
    tops: list[int]          # how many alternatives each of those rows asked for
    chosen: torch.Tensor
    top_ids: torch.Tensor
    top_values: torch.Tensor


def logprobs_on_device(logits: torch.Tensor, requests: list[Request], chosen: torch.Tensor) -> StepLogprobs | None:
    """The log-softmax of the raw logits (before temperature, top-k, top-p or a grammar, as
    OpenAI reports them) at the chosen tokens and the most likely ones, for the rows whose
    request asks; None when none does. Queued, no sync."""
    rows = [i for i, req in enumerate(requests) if req.params.logprobs >= 0]
    if not rows:
        return None
    tops = [requests[i].params.logprobs for i in rows]
    index = to_device(torch.tensor(rows), logits.device)
    logprobs = torch.log_softmax(logits[index].float(), dim=-1)
    picked = logprobs.gather(1, chosen[index].unsqueeze(1)).squeeze(1)
    top_values, top_ids = logprobs.topk(max(tops), dim=-1)
    return StepLogprobs(rows, tops, picked, top_ids, top_values)
