"""Greedy argmax over a batch of logits rows in two short Triton launches.

A decode step's logits are [rows, vocab] (64 x 128256 bf16 for Llama-3.2-1B: 16 MB). Torch's
argmax gives each row one block, and its two-pass form (reference.py) takes six launches.
Here programs cover (row, a chunk of the
vocabulary) so the read spreads over every SM, each leaves its chunk's (max, first index),
and one program per row picks the first index of the largest value: torch.argmax's answer.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..host import cdiv, num_sms

MAX_CHUNKS = 64  # the row pass walks a tile this wide: one compiled variant for any count
# The chunk pass's tiling: the best of a sweep of its tilings (64 x 128256 bf16 on an H100).
CHUNK_BLOCK = 4096
CHUNK_WARPS = 4
_PROGRAMS_PER_SM = 16
_DYNAMIC = ["n_cols", "stride_row", "chunk_len", "n_chunks"]


@triton.jit(do_not_specialize=_DYNAMIC)
def _chunk_max_kernel(x_ptr, val_ptr, idx_ptr, n_cols, stride_row, chunk_len, n_chunks,
                      BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    start = chunk * chunk_len
    end = tl.minimum(start + chunk_len, n_cols)
    best = tl.full((), float("-inf"), tl.float32)
    best_i = start
    offs = tl.arange(0, BLOCK)
    for off in range(start, end, BLOCK):
        cols = off + offs
        x = tl.load(x_ptr + row * stride_row + cols, mask=cols < end, other=float("-inf"))
        x = x.to(tl.float32)
        m = tl.max(x, 0)
        i = tl.argmax(x, 0, tie_break_left=True)
        take = m > best  # strictly: an equal maximum later in the row does not win
        best_i = tl.where(take, off + i, best_i)
        best = tl.maximum(best, m)
    tl.store(val_ptr + row * n_chunks + chunk, best)
    tl.store(idx_ptr + row * n_chunks + chunk, best_i)


@triton.jit(do_not_specialize=["n_chunks"])
def _row_pick_kernel(val_ptr, idx_ptr, out_ptr, n_chunks, CHUNKS_PAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, CHUNKS_PAD)
    mask = offs < n_chunks
    vals = tl.load(val_ptr + row * n_chunks + offs, mask=mask, other=float("-inf"))
    idxs = tl.load(idx_ptr + row * n_chunks + offs, mask=mask, other=2147483647)
    top = tl.max(vals, 0)
    # Chunks are in column order: the smallest index holding the maximum is the first one.
    first = tl.min(tl.where(mask & (vals == top), idxs, 2147483647), 0)
    tl.store(out_ptr + row, first.to(tl.int64))


def chunks_for(rows: int, n_cols: int, device: torch.device, block: int = CHUNK_BLOCK) -> int:
    """Vocabulary chunks per row: about _PROGRAMS_PER_SM programs per SM, at least a block
    each."""
    want = cdiv(_PROGRAMS_PER_SM * num_sms(device), max(rows, 1))
    return max(1, min(MAX_CHUNKS, want, cdiv(n_cols, block)))


def first_argmax_triton(logits: torch.Tensor, chunks: int | None = None, *,
                        block: int = CHUNK_BLOCK, num_warps: int = CHUNK_WARPS) -> torch.Tensor:
    """[rows] int64: the first index of each row's maximum (as torch.argmax(dim=-1)).
    chunks, block, num_warps: the chunk pass's tiling."""
    rows, n_cols = logits.shape
    assert logits.stride(1) == 1, "logits rows must be contiguous"
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    n_chunks = max(1, min(chunks or chunks_for(rows, n_cols, logits.device, block), MAX_CHUNKS))
    chunk_len = cdiv(cdiv(n_cols, n_chunks), block) * block
    n_chunks = cdiv(n_cols, chunk_len)  # no empty chunk
    vals = torch.empty(rows, n_chunks, dtype=torch.float32, device=logits.device)
    idxs = torch.empty(rows, n_chunks, dtype=torch.int32, device=logits.device)
    _chunk_max_kernel[(rows, n_chunks)](logits, vals, idxs, n_cols, logits.stride(0), chunk_len,
                                        n_chunks, BLOCK=block, num_warps=num_warps)
    _row_pick_kernel[(rows,)](vals, idxs, out, n_chunks, CHUNKS_PAD=MAX_CHUNKS, num_warps=2)
    return out
