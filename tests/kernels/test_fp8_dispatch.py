"""fp8_matmul's host side on the CPU: the K tile a scale block allows, the per-row activation
quantization W8A8 uses and torch's row-wise scaled GEMM over it, and the CPU's answer (the
reference of the chosen math: weight-only, or W8A8's quantized x)."""
from __future__ import annotations

import pytest
import torch

from kernels.gemm.fp8 import (E4M3_MAX, fp8_matmul, k_tile, quantize_rows, reference_fp8_matmul,
                              reference_w8a8_matmul, scaled_mm_rowwise)


@pytest.mark.parametrize("block,block_k,expected", [
    (None, 128, 128), ((128, 128), 128, 128), ((128, 128), 256, 128), ((128, 128), 64, 64),
    ((128, 96), 128, 32), ((64, 48), 128, 16), ((128, 8), 128, None), ((1, 100), 128, None),
])
def test_k_tile_divides_the_scale_blocks_columns(block, block_k: int, expected: int | None) -> None:
    assert k_tile(block, block_k) == expected


def test_quantize_rows_scales_each_rows_largest_to_e4m3s_largest() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 256, generator=gen) * torch.logspace(-3, 3, 6).unsqueeze(1)
    x[4] = 0.0  # a row of zeros (a padded row) quantizes to zeros, not NaN
    quantized, scale = quantize_rows(x.to(torch.bfloat16))
    assert quantized.dtype == torch.float8_e4m3fn and scale.shape == (6, 1) and scale.dtype == torch.float32
    back = quantized.float() * scale
    assert torch.isfinite(back).all() and torch.equal(back[4], torch.zeros(256))
    rows = [0, 1, 2, 3, 5]
    assert torch.equal(quantized.float().abs().amax(dim=1)[rows], torch.full((5,), E4M3_MAX))
    xb = x.to(torch.bfloat16).float()
    # e4m3 keeps 3 mantissa bits: half an ulp is 2^-4 of the value, relative to the row's
    # scale near zero (subnormals step by 2^-9 of the scale).
    bound = xb.abs() * 2 ** -4 + scale * 2 ** -10
    assert ((back - xb).abs() <= bound).all()


def _case(rows: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rows + n + k)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    weight = (torch.randn(n, k, generator=gen) * 60).to(torch.float8_e4m3fn)
    return x, weight, torch.rand(n, generator=gen) * 0.02 + 1e-3


def test_w8a8_is_the_quantized_operands_product() -> None:
    """torch's row-wise scaled GEMM as scaled_mm_rowwise calls it (scale_a [M, 1], scale_b [1, N],
    the weight column-major) is the float32 product of the dequantized operands, rounded to
    bf16; and within fp8's rounding of x of the weight-only reference."""
    x, weight, scale = _case(80, 48, 96)
    try:
        y = scaled_mm_rowwise(*quantize_rows(x), weight, scale).to(x.dtype)
    except (RuntimeError, NotImplementedError) as exc:
        pytest.skip(f"this torch build has no CPU row-wise _scaled_mm: {exc}")
    quantized, row_scale = quantize_rows(x)
    emulated = (quantized.float() * row_scale) @ (weight.float() * scale.unsqueeze(1)).t()
    assert y.dtype == x.dtype and y.shape == (80, 48)
    magnitude = emulated.abs().max().item()
    torch.testing.assert_close(y.float(), emulated, rtol=2 ** -7, atol=2 ** -7 * magnitude)
    reference = reference_fp8_matmul(x, weight, scale, None).float()
    assert (y.float() - reference).abs().max().item() <= 0.1 * magnitude
    assert not torch.equal(y, reference.to(y.dtype))  # W8A8 rounds x: not the reference


@pytest.mark.parametrize("rows", [1, 100])
@pytest.mark.parametrize("w8a8", [False, True])
def test_on_the_cpu_fp8_matmul_is_the_reference(rows: int, w8a8: bool) -> None:
    """The CPU runs each math's reference; W8A8's differs from weight-only's (x rounded)."""
    x, weight, scale = _case(rows, 48, 96)
    reference = reference_w8a8_matmul if w8a8 else reference_fp8_matmul
    assert torch.equal(fp8_matmul(x, weight, scale, None, w8a8=w8a8), reference(x, weight, scale, None))
    if w8a8:
        assert not torch.equal(reference_w8a8_matmul(x, weight, scale, None),
                               reference_fp8_matmul(x, weight, scale, None))


def test_a_whole_lora_fold_is_refused_and_a_shrink_stored() -> None:
    """An FP8 GEMM adds no LoRA delta itself: a whole fold (expand) is refused, not dropped;
    a shrink-only fold has its rows stored in xa on the CPU, as the reference computes them,
    and the output is the matmul's."""
    import dataclasses

    from kernel_cases import make_gemm_lora, make_lora_case

    from kernels.gemm.fp8 import fp8_matmul, reference_fp8_matmul

    slots = [-1, 1, 1, 3, 3, -1]
    case = make_lora_case(token_slots=slots, num_slots=4, max_rank=16, ranks=[16, 8, 16, 4], h_in=64,
                          outs=[32], seed=2)
    weight = (torch.randn(32, 64, generator=torch.Generator().manual_seed(2)) * 60).clamp(-448, 448)
    weight, scale = weight.to(torch.float8_e4m3fn), torch.full((32,), 1e-2)
    whole = make_gemm_lora(case, 2)
    with pytest.raises(ValueError, match="adds no whole LoRA delta"):
        fp8_matmul(case.x, weight, scale, None, lora=whole)
    shrink = dataclasses.replace(whole, expand=False)
    y = fp8_matmul(case.x, weight, scale, None, lora=shrink)
    assert torch.equal(y, reference_fp8_matmul(case.x, weight, scale, None))
    active = torch.tensor(slots) >= 0
    assert torch.equal(shrink.xa[active], shrink.shrink(case.x)[active])
