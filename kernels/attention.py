"""Paged attention dispatcher: the Triton kernel on CUDA, the PyTorch reference elsewhere."""
from __future__ import annotations

import os

import torch

from .paged_attention_ref import paged_attention_ref


def _use_triton(q: torch.Tensor) -> bool:
    mode = os.environ.get("LORA_KERNELS", "auto")
    if mode == "torch":
        return False
    return mode == "triton" or q.is_cuda


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float, max_query_len: int,
                    max_seq_len: int) -> torch.Tensor:
    if _use_triton(q):
        try:
            from .paged_attention_triton import paged_attention_triton
        except ImportError:  # Triton absent: the reference serves
            pass
        else:
            return paged_attention_triton(q, k_cache, v_cache, block_tables, query_start_loc,
                                          seq_lens, scale, max_query_len, max_seq_len)
    return paged_attention_ref(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
                               scale, max_query_len, max_seq_len)
