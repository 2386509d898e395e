"""x @ W.T for a projection whose weight W [N, K] is stored as float8_e4m3fn with float32 scales:
one per output row (per-channel; a per-tensor scale is broadcast to [N] by the loader), or
one per [block_n, block_k] tile of W (Hugging Face's fine-grained FP8). The scales multiply
the fp8 values (dequant W = fp8 * scale), as the checkpoints' `weight_scale` /
`weight_scale_inv` tensors mean them.

`fp8_matmul` is the one entry point the model calls; the reference below is what CPU nodes
run and what the GPU kernel is checked against. No host synchronisation on any path: the
decode graphs capture it.
"""
from __future__ import annotations

import torch


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor,
                   block: tuple[int, int] | None) -> torch.Tensor:
    """The float32 [N, K] matrix `weight` [N, K] (fp8) and `scale` stand for: scale [N] per
    row when block is None, else scale [ceil(N/bn), ceil(K/bk)] per tile (edge tiles
    partial)."""
    w = weight.float()
    if block is None:
        return w * scale.float().unsqueeze(1)
    n, k = w.shape
    bn, bk = block
    per_element = scale.float().repeat_interleave(bn, dim=0).repeat_interleave(bk, dim=1)
    return w * per_element[:n, :k]


def reference_fp8_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                         block: tuple[int, int] | None) -> torch.Tensor:
    """x [M, K] @ dequant(weight [N, K]).T in float32, returned in x's dtype."""
    return (x.float() @ dequantize_fp8(weight, scale, block).t()).to(x.dtype)


def fp8_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               block: tuple[int, int] | None) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32) @ dequant(weight [N, K] float8_e4m3fn).T -> [M, N] in x's
    dtype, float32 accumulation. scale: float32 [N] when block is None, else
    [ceil(N/block[0]), ceil(K/block[1])]."""
    return reference_fp8_matmul(x, weight, scale, block)
