"""Token embedding: the Triton gather (triton_kernel.py) where Triton runs, the PyTorch
reference (reference.py) elsewhere."""
from __future__ import annotations

import torch

from ..dispatch import triton_kernel
from .reference import embed_tokens_ref


def embed_tokens(weight: torch.Tensor, input_ids: torch.Tensor,
                 feedback: torch.Tensor | None = None,
                 feedback_rows: torch.Tensor | None = None) -> torch.Tensor:
    """[T, hidden] embeddings; see embed_tokens_ref for which token each row takes."""
    kernel = triton_kernel(weight, "kernels.embedding.triton_kernel", "embed_tokens_triton")
    if kernel is not None:
        return kernel(weight, input_ids, feedback, feedback_rows)
    return embed_tokens_ref(weight, input_ids, feedback, feedback_rows)
