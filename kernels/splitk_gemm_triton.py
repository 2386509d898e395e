"""x @ W for a decode batch, split over K, leaving the splits' float32 partial sums unreduced.

At decode a projection is a weight stream: 64 rows against megabytes of weights. cuBLAS
splits K across programs to fill the GPU and then launches a reduction (or serialises on a
workspace), and its small projections run far from copy bandwidth. Here each program streams a
[K / SPLITS, BLOCK_N] slab of W once and writes its partial [M, BLOCK_N] in float32; the op
that reads the projection's output next (the residual add + norm, kernels/norm_triton.py)
sums the partials while loading the row, so there is no reduction launch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _splitk_gemm_kernel(
    x_ptr, w_ptr, part_ptr, M,
    stride_xm, stride_wk, stride_ps, stride_pm,
    K_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = split * K_SPLIT + tl.arange(0, BLOCK_K)
    mask_m = offs_m[:, None] < M
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_k[:, None].to(tl.int64) * stride_wk + offs_n[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, K_SPLIT, BLOCK_K):
        x = tl.load(x_ptrs, mask=mask_m, other=0.0)
        w = tl.load(w_ptrs)
        acc = tl.dot(x, w, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    p_ptrs = part_ptr + split * stride_ps + offs_m[:, None] * stride_pm + offs_n[None, :]
    tl.store(p_ptrs, acc, mask=mask_m)


def splitk_gemm_triton(x: torch.Tensor, w: torch.Tensor, splits: int, *, block_n: int = 64,
                       block_k: int = 128, num_warps: int = 4, num_stages: int = 3
                       ) -> torch.Tensor:
    """[splits, M, N] float32 partial sums of x [M, K] @ w [K, N] (w row-major, [in, out])."""
    M, K = x.shape
    N = w.shape[1]
    assert w.shape[0] == K and w.stride(1) == 1 and x.stride(1) == 1
    assert N % block_n == 0 and K % (splits * block_k) == 0, "tiles must divide the weight"
    part = torch.empty(splits, M, N, dtype=torch.float32, device=x.device)
    if M == 0:
        return part
    _splitk_gemm_kernel[(N // block_n, splits)](
        x, w, part, M, x.stride(0), w.stride(0), part.stride(0), part.stride(1),
        K_SPLIT=K // splits, BLOCK_M=max(16, triton.next_power_of_2(M)), BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
    )
    return part
