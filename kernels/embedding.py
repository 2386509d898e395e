"""Token embedding dispatcher: the Triton gather on CUDA (kernels/embedding_triton.py), the
PyTorch reference elsewhere."""
from __future__ import annotations

import torch

from ._dispatch import use_triton


def embed_tokens_ref(weight: torch.Tensor, input_ids: torch.Tensor,
                     feedback: torch.Tensor | None = None,
                     feedback_rows: torch.Tensor | None = None) -> torch.Tensor:
    """weight[token] per token, where a token with feedback_rows >= 0 is feedback[that row]
    (the previous step's sample, still on the device) and any other is input_ids'."""
    if feedback is not None and feedback_rows is not None:
        input_ids = torch.where(feedback_rows >= 0, feedback[feedback_rows.clamp(min=0)], input_ids)
    return weight[input_ids]


def embed_tokens(weight: torch.Tensor, input_ids: torch.Tensor,
                 feedback: torch.Tensor | None = None,
                 feedback_rows: torch.Tensor | None = None) -> torch.Tensor:
    """[T, hidden] embeddings; see embed_tokens_ref for which token each row takes."""
    if use_triton(weight):
        try:
            from .embedding_triton import embed_tokens_triton
        except ImportError:  # Triton absent: the reference serves
            pass
        else:
            return embed_tokens_triton(weight, input_ids, feedback, feedback_rows)
    return embed_tokens_ref(weight, input_ids, feedback, feedback_rows)
