"""Paged attention dispatcher: the Triton kernel on CUDA, the PyTorch reference elsewhere."""
from __future__ import annotations

import torch

from ._dispatch import use_triton
from .paged_attention_ref import paged_attention_ref


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float, max_query_len: int,
                    max_seq_len: int) -> torch.Tensor:
    if use_triton(q):
        try:
            from .paged_attention_triton import paged_attention_triton
        except ImportError:  # Triton absent: the reference serves
            pass
        else:
            return paged_attention_triton(q, k_cache, v_cache, block_tables, query_start_loc,
                                          seq_lens, scale, max_query_len, max_seq_len)
    return paged_attention_ref(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
                               scale, max_query_len, max_seq_len)
