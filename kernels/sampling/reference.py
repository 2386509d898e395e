"""Greedy argmax: the PyTorch reference (the CPU path and the Triton kernels' oracle)."""
from __future__ import annotations

import torch


def first_argmax_ref(logits: torch.Tensor, chunks: int = 64, two_pass: bool | None = None) -> torch.Tensor:
    """argmax over the last dim (the first index of the maximum, as torch.argmax), in two
    passes when the vocabulary splits into `chunks` equal parts: a batch of decode rows is
    then reduced by rows x chunks blocks in parallel instead of one block per row (two_pass:
    None = on CUDA only)."""
    rows, vocab = logits.shape
    while chunks > 1 and vocab % chunks:
        chunks //= 2
    if two_pass is None:
        two_pass = logits.device.type == "cuda"
    if chunks <= 1 or not two_pass:
        return logits.argmax(dim=-1)
    parts = logits.view(rows, chunks, vocab // chunks)
    inner = parts.argmax(dim=-1)                                   # first max in each chunk
    best = parts.gather(-1, inner.unsqueeze(-1)).squeeze(-1).argmax(dim=-1)  # first chunk
    return best * (vocab // chunks) + inner.gather(-1, best.unsqueeze(-1)).squeeze(-1)
