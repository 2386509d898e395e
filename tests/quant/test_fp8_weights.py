"""FP8 weights as the loader builds them (kernels/gemm/fp8_weight.py): quantizing at load
keeps one scale per output channel (amax / 448), and fusing parts or cutting a shard's rows or
columns moves bytes and scales without requantizing: the dequantized result is, bit for bit,
the matching part of the whole's, block edges or not."""
from __future__ import annotations

import pytest
import torch

from kernels.gemm.fp8 import dequantize_fp8
from kernels.gemm.fp8_weight import FP8_MAX, Fp8Weight, fuse, quantize_fp8, slice_columns, slice_rows


def _deq(w: Fp8Weight) -> torch.Tensor:
    return dequantize_fp8(w.weight, w.scale, w.block)


def _random(n: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * (1 + torch.arange(n)[:, None])


def test_per_channel_scales_are_each_rows_amax_over_448() -> None:
    w = _random(6, 10, 0)
    w[3] = 0.0
    q = quantize_fp8(w)
    assert q.weight.dtype == torch.float8_e4m3fn and q.block is None and q.scale.dtype == torch.float32
    assert torch.equal(q.scale[[0, 1, 2, 4, 5]], w.abs().amax(dim=1)[[0, 1, 2, 4, 5]] / FP8_MAX)
    assert q.scale[3] > 0 and torch.isfinite(_deq(q)).all() and not _deq(q)[3].any()
    # e4m3 keeps 3 mantissa bits: each value within half a step (1/16 relative) of its own
    err = (_deq(q) - w).abs()
    assert (err <= w.abs() / 16 + q.scale[:, None] * 2 ** -9).all()
    assert q.weight.float().abs().amax(dim=1)[[0, 1, 2, 4, 5]].eq(FP8_MAX).all()  # each row's amax hits 448


@pytest.mark.parametrize("block", [(4, 4), (3, 5)])
def test_block_scales_are_each_tiles_amax_over_448(block: tuple[int, int]) -> None:
    w = _random(10, 11, 1)
    q = quantize_fp8(w, block)
    bn, bk = block
    assert q.scale.shape == (-(-10 // bn), -(-11 // bk))
    for i in range(q.scale.shape[0]):
        for j in range(q.scale.shape[1]):
            assert q.scale[i, j] == w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].abs().max() / FP8_MAX


@pytest.mark.parametrize("block, outs", [(None, (8, 4, 4)), ((4, 4), (8, 4, 4)), ((4, 4), (6, 3, 3)),
                                         ((4, 3), (5, 8))])
def test_fused_parts_dequantize_to_the_parts_stacked(block, outs) -> None:
    parts = [quantize_fp8(_random(n, 10, i), block) for i, n in enumerate(outs)]
    fused = fuse(parts)
    assert torch.equal(_deq(fused), torch.cat([_deq(p) for p in parts]))
    if block is not None and any(n % block[0] for n in outs[:-1]):
        assert fused.block == (1, block[1])  # spread per row: the parts' tiles do not line up
    else:
        assert fused.block == block


@pytest.mark.parametrize("block", [None, (4, 4), (4, 3)])
@pytest.mark.parametrize("lo, hi", [(0, 5), (5, 10), (4, 8), (8, 10)])
def test_a_shards_rows_or_columns_dequantize_to_the_wholes(block, lo, hi) -> None:
    whole = quantize_fp8(_random(10, 10, 2), block)
    rows = slice_rows(whole.weight[lo:hi], whole.scale, whole.block, 10, lo, hi)
    cols = slice_columns(whole.weight[:, lo:hi].contiguous(), whole.scale, whole.block, 10, lo, hi)
    assert torch.equal(_deq(rows), _deq(whole)[lo:hi])
    assert torch.equal(_deq(cols), _deq(whole)[:, lo:hi])
    # and the parts of a fused group cut per shard fuse back exactly
    assert torch.equal(_deq(fuse([rows, slice_rows(whole.weight[:lo + 1], whole.scale, whole.block, 10, 0, lo + 1)])),
                       torch.cat([_deq(whole)[lo:hi], _deq(whole)[:lo + 1]]))
