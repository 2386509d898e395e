"""Paged attention, PyTorch reference (the CPU path and the oracle of the Triton kernel).

One call serves a whole mixed batch: sequences in prefill (many new tokens) and in decode
(one new token) side by side, each reading its keys and values through its block table.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def paged_attention_ref(
    q: torch.Tensor,               # [T, Hq, D]: new tokens of all sequences, concatenated
    k_cache: torch.Tensor,         # [num_blocks, block_size, Hkv, D] (any strides)
    v_cache: torch.Tensor,         # [num_blocks, block_size, Hkv, D] (any strides)
    block_tables: torch.Tensor,    # [B, max_blocks] int32 (unused entries: any valid block)
    query_start_loc: torch.Tensor, # [B + 1] int32: sequence b's queries are q[start[b]:start[b+1]]
    seq_lens: torch.Tensor,        # [B] int32: context length of b, its new tokens included
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal attention of each new token over its sequence's cached keys.

    Query i of sequence b (of q_len_b) sits at position seq_len_b - q_len_b + i and attends
    keys 0..that position, or with a sliding `window` (> 0) only the last `window` of them,
    itself included (transformers' sliding_window). `softcap` > 0 caps the scaled scores at
    softcap * tanh(score / softcap) before the mask and softmax (Gemma 2). Returns [T, Hq, D]
    in q's dtype. max_query_len and max_seq_len are host integers so that no device
    synchronisation is needed.
    """
    T, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    batch = block_tables.shape[0]
    device = q.device
    starts = query_start_loc[:-1].long()
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()

    # Gather every sequence's context keys/values into a padded [B, S, Hkv, D] tensor.
    positions = torch.arange(max_seq_len, device=device)
    blocks = block_tables.long()[:, (positions // block_size).clamp(max=block_tables.shape[1] - 1)]
    offsets = (positions % block_size)[None, :]
    keys = k_cache[blocks, offsets]        # [B, S, Hkv, D], whatever the caches' strides
    values = v_cache[blocks, offsets]
    # Positions past a sequence's context read other blocks (its table's padding, blocks of
    # another request), and so may positions before every query's window (blocks the request
    # gave back): zeroed, since a masked weight of 0 times a NaN there is still NaN, and one
    # request's non-finite KV must not reach another's output.
    outside = positions[None, :] >= seq_lens.long()[:, None]
    if window > 0:
        first_visible = seq_lens.long() - q_lens - window + 1  # the first query's first key
        outside |= positions[None, :] < first_visible[:, None]
    outside = outside[:, :, None, None]
    keys = keys.masked_fill(outside, 0)
    values = values.masked_fill(outside, 0)

    # Scatter queries into a padded [B, Qmax, Hq, D] tensor.
    q_pos = torch.arange(max_query_len, device=device)
    q_valid = q_pos[None, :] < q_lens[:, None]
    q_index = (starts[:, None] + q_pos[None, :]).clamp(max=T - 1)
    queries = q[q_index]

    # Causal mask: key j visible to query i iff j <= its absolute position (and j < seq_len).
    abs_pos = seq_lens.long()[:, None] - q_lens[:, None] + q_pos[None, :]
    mask = positions[None, None, :] <= abs_pos[:, :, None]
    if window > 0:
        mask &= positions[None, None, :] > abs_pos[:, :, None] - window
    mask &= q_valid[:, :, None]
    mask[:, :, 0] |= ~q_valid  # padded queries attend one key so softmax stays finite

    groups = num_heads // num_kv_heads
    keys = keys.repeat_interleave(groups, dim=2) if groups > 1 else keys
    values = values.repeat_interleave(groups, dim=2) if groups > 1 else values
    qf, kf, vf = queries.transpose(1, 2).float(), keys.transpose(1, 2).float(), values.transpose(1, 2).float()
    if softcap > 0:  # SDPA has no soft-cap: the scores written out (as transformers' eager path)
        scores = torch.matmul(qf, kf.transpose(2, 3)) * scale
        scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~mask[:, None], float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1), vf)
    else:
        out = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask[:, None], scale=scale)
    out = out.transpose(1, 2).to(q.dtype)  # [B, Qmax, Hq, D]
    del batch
    return out[q_valid]
