"""Token embedding lookup: the PyTorch reference (the CPU path and the Triton gather's oracle)."""
from __future__ import annotations

import torch


def embed_tokens_ref(weight: torch.Tensor, input_ids: torch.Tensor,
                     feedback: torch.Tensor | None = None,
                     feedback_rows: torch.Tensor | None = None) -> torch.Tensor:
    """weight[token] per token, where a token with feedback_rows >= 0 is feedback[that row]
    (the previous step's sample, still on the device) and any other is input_ids'."""
    if feedback is not None and feedback_rows is not None:
        input_ids = torch.where(feedback_rows >= 0, feedback[feedback_rows.clamp(min=0)], input_ids)
    return weight[input_ids]
