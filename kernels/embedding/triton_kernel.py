"""Token embedding lookup, with the tokens a decode graph reads from the device, in one launch.

A tied embedding is the LM head's weight seen transposed ([vocab, hidden] with a vocab-long
stride between hidden units), so a token's row is a strided column, slow for torch's gather,
which also needed four small launches choosing each row's token (the previous step's sample,
`feedback[row]`, or the host's id). Here one program per (token,
hidden span) picks the token and reads its span.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..host import cdiv

_BLOCK_H = 512
_DYNAMIC = ["hidden", "stride_v", "stride_h", "stride_o"]


@triton.jit(do_not_specialize=_DYNAMIC)
def _embed_kernel(ids_ptr, rows_ptr, feedback_ptr, weight_ptr, out_ptr, hidden,
                  stride_v, stride_h, stride_o,
                  HAS_FEEDBACK: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < hidden
    tok = tl.load(ids_ptr + t).to(tl.int64)
    if HAS_FEEDBACK:
        row = tl.load(rows_ptr + t).to(tl.int64)
        if row >= 0:
            tok = tl.load(feedback_ptr + row).to(tl.int64)
    vals = tl.load(weight_ptr + tok * stride_v + offs.to(tl.int64) * stride_h, mask=mask)
    tl.store(out_ptr + t * stride_o + offs, vals, mask=mask)


def embed_tokens_triton(weight: torch.Tensor, input_ids: torch.Tensor,
                        feedback: torch.Tensor | None = None,
                        feedback_rows: torch.Tensor | None = None) -> torch.Tensor:
    """[T, hidden] rows of `weight` ([vocab, hidden], any strides) for the tokens, see
    kernels.embedding.embed_tokens."""
    T = input_ids.shape[0]
    hidden = weight.shape[1]
    out = torch.empty(T, hidden, dtype=weight.dtype, device=weight.device)
    if T == 0:
        return out
    has_feedback = feedback is not None and feedback_rows is not None
    rows = feedback_rows if has_feedback else input_ids  # a dummy pointer when unused
    source = feedback if has_feedback else input_ids
    _embed_kernel[(T, cdiv(hidden, _BLOCK_H))](
        input_ids, rows, source, weight, out, hidden, weight.stride(0), weight.stride(1),
        out.stride(0), HAS_FEEDBACK=has_feedback, BLOCK_H=_BLOCK_H, num_warps=4)
    return out
