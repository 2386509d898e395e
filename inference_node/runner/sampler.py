"""Token sampling: greedy, temperature, top-k, top-p, each request with its own seeded RNG."""
from __future__ import annotations

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


def sample_on_device(logits: torch.Tensor, requests: list[Request], greedy: torch.Tensor | None = None,
                     finite: torch.Tensor | None = None) -> torch.Tensor:
    """The chosen tokens [N] int64, left on the logits' device (queued, no sync), each a valid
    vocabulary index. Greedy rows take the argmax of the logits as they are (widening bf16 to
    float32 is exact, so the choice is the same), or `greedy` where the caller computed it
    with checked_greedy (a decode graph does, with `finite`); sampled rows are widened to
    float32 first, and a row that is not finite samples from zeros instead (multinomial over
    NaN would fail the device)."""
    if greedy is None or finite is None:
        greedy, finite = checked_greedy(logits)
    if all(req.params.greedy for req in requests):
        return greedy
    chosen = greedy.clone()
    for i, req in enumerate(requests):
        if req.params.greedy:
            continue
        if req.generator is None:
            req.generator = torch.Generator(device=logits.device)
            seed = req.params.seed if req.params.seed is not None else torch.seed()
            req.generator.manual_seed(seed)
        row = torch.where(finite[i], logits[i].float(), 0.0)
        probs = filter_logits(row, req.params).softmax(-1)
        chosen[i] = torch.multinomial(probs, 1, generator=req.generator)[0]
    return chosen
