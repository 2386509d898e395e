"""Paged attention: the Triton kernel (triton_kernel.py) where Triton runs, the PyTorch
reference (reference.py) elsewhere."""
from __future__ import annotations

import torch

from ..dispatch import triton_kernel
from ..tuning import DEFAULT_TUNING, Tuning
from .reference import paged_attention_ref


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float, max_query_len: int,
                    max_seq_len: int, tuning: Tuning = DEFAULT_TUNING, *,
                    out: torch.Tensor | None = None, window: int = 0,
                    softcap: float = 0.0) -> torch.Tensor:
    """[T, Hq, D] (written into `out` where given: a CUDA graph's static buffer); `window`
    and `softcap` as for reference.paged_attention_ref."""
    args = (q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, max_query_len,
            max_seq_len)
    kernel = triton_kernel(q, "kernels.attention.triton_kernel", "paged_attention_triton")
    if kernel is not None:
        return kernel(*args, tuning=tuning, out=out, window=window, softcap=softcap)
    result = paged_attention_ref(*args, window=window, softcap=softcap)
    if out is None:
        return result
    out.copy_(result)
    return out
