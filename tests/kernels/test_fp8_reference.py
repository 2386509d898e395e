"""The FP8 matmul's reference against the dequantization written out element by element: per
row scales, and block scales where the weight's dims are and are not multiples of the block."""
from __future__ import annotations

import pytest
import torch

from kernels.gemm.fp8 import dequantize_fp8, fp8_matmul


def _weight(n: int, k: int) -> torch.Tensor:
    return (torch.randn(n, k, generator=torch.Generator().manual_seed(n * k)) * 100).to(torch.float8_e4m3fn)


def test_per_channel_scales_multiply_each_row() -> None:
    w = _weight(6, 5)
    scale = torch.arange(1, 7, dtype=torch.float32) / 8
    expected = torch.stack([w[i].float() * scale[i] for i in range(6)])
    assert torch.equal(dequantize_fp8(w, scale, None), expected)


@pytest.mark.parametrize("n,k", [(8, 8), (10, 7)])
def test_block_scales_multiply_each_tile_edges_partial(n: int, k: int) -> None:
    w, block = _weight(n, k), (4, 4)
    scale = torch.rand(-(-n // 4), -(-k // 4)) + 0.5
    expected = torch.empty(n, k)
    for i in range(n):
        for j in range(k):
            expected[i, j] = w[i, j].float() * scale[i // 4, j // 4]
    assert torch.equal(dequantize_fp8(w, scale, block), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_is_x_times_dequantized_transpose_in_x_dtype(dtype: torch.dtype) -> None:
    w, scale = _weight(10, 7), torch.rand(3, 2) + 0.5
    x = torch.randn(3, 7).to(dtype)
    y = fp8_matmul(x, w, scale, (4, 4))
    assert y.dtype == dtype and y.shape == (3, 10)
    expected = (x.float() @ dequantize_fp8(w, scale, (4, 4)).t()).to(dtype)
    assert torch.equal(y, expected)
