"""Token sampling: greedy, temperature, top-k, top-p, each request with its own seeded RNG."""
from __future__ import annotations

import torch

from kernels.sampling import first_argmax

from .request import Request, SamplingParams


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


def sample_on_device(logits: torch.Tensor, requests: list[Request],
                     greedy: torch.Tensor | None = None) -> torch.Tensor:
    """The chosen tokens [N] int64, left on the logits' device (queued, no sync). Greedy rows
    take the argmax of the logits as they are (widening bf16 to float32 is exact, so the
    choice is the same), or `greedy` where the caller computed it (a decode graph does);
    sampled rows are widened to float32 first."""
    if greedy is None:
        greedy = first_argmax(logits)
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
        probs = filter_logits(logits[i].float(), req.params).softmax(-1)
        chosen[i] = torch.multinomial(probs, 1, generator=req.generator)[0]
    return chosen
