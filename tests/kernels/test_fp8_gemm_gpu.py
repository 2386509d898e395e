"""The weight-only FP8 GEMM natively on CUDA at Llama-3.1-8B's widths against the float32
dequantized product: decode rows (the kernel fp8_matmul launches, bit for bit), prefill rows,
replays of a CUDA graph that captured it (K-split launches summing their own splits), W8A8
prefill on Hopper; and, printed not asserted, its time against bf16 torch.mm at 64 rows
(inference_node/tuner/fp8_gemm.py's table). Skipped where no CUDA device is present."""
from __future__ import annotations

from dataclasses import asdict

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a CUDA device of compute capability 8.9 or newer (e4m3 conversions)")]

WIDTHS_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
BLOCKS = {"channel": None, "block128": (128, 128)}


def _case(rows: int, n: int, k: int, block: tuple[int, int] | None,
          seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x bf16, weight e4m3 [N, K], float32 scales): weights over e4m3's range, scales of a real
    checkpoint's size, each row or block its own."""
    gen = torch.Generator(device="cuda").manual_seed(seed + rows + n + k)
    x = torch.randn(rows, k, device="cuda", generator=gen).to(torch.bfloat16)
    weight = (torch.randn(n, k, device="cuda", generator=gen) * 60).clamp(-448, 448).to(torch.float8_e4m3fn)
    shape = (n,) if block is None else (-(-n // block[0]), -(-k // block[1]))
    scale = torch.rand(shape, device="cuda", generator=gen) * 2e-3 + 1e-4
    return x, weight, scale


def _expected(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
              block: tuple[int, int] | None) -> torch.Tensor:
    from kernels.gemm.fp8 import dequantize_fp8

    return x.float() @ dequantize_fp8(weight, scale, block).t()


def _assert_bf16_close(y: torch.Tensor, expected: torch.Tensor) -> None:
    """y (bf16) is the float32 value rounded once (an ulp: up to 2^-7 relative)."""
    assert y.dtype == torch.bfloat16 and y.shape == expected.shape
    magnitude = expected.abs().max().item()
    torch.testing.assert_close(y.float(), expected, rtol=2 ** -7, atol=2 ** -7 * magnitude)


@pytest.mark.parametrize("block", list(BLOCKS.values()), ids=list(BLOCKS))
@pytest.mark.parametrize("rows", [1, 64])
@pytest.mark.parametrize("group", list(WIDTHS_8B))
def test_decode_kernel_matches_reference_at_8b_widths(group: str, rows: int,
                                                      block: tuple[int, int] | None) -> None:
    from kernels.gemm.fp8 import DECODE_TILING, fp8_matmul
    from kernels.gemm.fp8_triton_kernel import fp8_gemm_triton

    n, k = WIDTHS_8B[group]
    x, weight, scale = _case(rows, n, k, block)
    y = fp8_gemm_triton(x, weight, scale, block, **asdict(DECODE_TILING))
    _assert_bf16_close(y, _expected(x, weight, scale, block))
    assert torch.equal(fp8_matmul(x, weight, scale, block), y)  # the dispatcher launches it


# The sweep's new designs (kernels/gemm/fp8_triton_kernel.py), as launch keywords.
DESIGNS = {"swap": dict(swap_ab=True, block_n=128),
           "swap-tma": dict(swap_ab=True, tma=True, block_n=128, num_warps=8),
           "swap-tma-prmt": dict(swap_ab=True, tma=True, widen_prmt=True, block_n=128, num_warps=8),
           "prmt": dict(widen_prmt=True)}


@pytest.mark.parametrize("design", list(DESIGNS.values()), ids=list(DESIGNS))
@pytest.mark.parametrize("block", list(BLOCKS.values()), ids=list(BLOCKS))
@pytest.mark.parametrize("rows", [1, 64])
@pytest.mark.parametrize("group", ["o", "down"])
def test_each_design_matches_reference_at_8b_widths(group: str, rows: int, block: tuple[int, int] | None,
                                                    design: dict) -> None:
    """Swap-AB, TMA and the integer e4m3 -> bf16 widening compute the reference's value (bf16
    rounding aside) natively, as the interpreter tests check them off the GPU."""
    from kernels.gemm.fp8_triton_kernel import fp8_gemm_triton

    n, k = WIDTHS_8B[group]
    x, weight, scale = _case(rows, n, k, block)
    _assert_bf16_close(fp8_gemm_triton(x, weight, scale, block, **design), _expected(x, weight, scale, block))


@pytest.mark.parametrize("block", list(BLOCKS.values()), ids=list(BLOCKS))
@pytest.mark.parametrize("group", ["o", "down"])
def test_prefill_rows_match_reference(group: str, block: tuple[int, int] | None) -> None:
    """300 rows: the prefill tiling (two full row tiles and a partial one), weight-only."""
    from kernels.gemm.fp8 import fp8_matmul

    n, k = WIDTHS_8B[group]
    x, weight, scale = _case(300, n, k, block)
    _assert_bf16_close(fp8_matmul(x, weight, scale, block), _expected(x, weight, scale, block))


@pytest.mark.parametrize("block", list(BLOCKS.values()), ids=list(BLOCKS))
@pytest.mark.parametrize("group,rows", [("o", 1), ("o", 64), ("gate_up", 64), ("down", 300)])
def test_w8a8_is_the_row_quantized_product(group: str, rows: int, block: tuple[int, int] | None) -> None:
    """w8a8 at decode and prefill rows: x quantized per row on the GPU exactly as the CPU's
    quantize_rows does (e4m3 codes and scales bit for bit: the CPU's division is correctly
    rounded, as the kernel's div.rn), then the fp8 tensor cores' product
    is the float32 product of the quantized operands (bf16 out), within fp8's rounding of x of
    the weight-only one and not equal to it; torch's row-wise scaled GEMM agrees with it."""
    from kernels.gemm.fp8 import fp8_matmul, quantize_rows, reference_w8a8_matmul, scaled_mm_rowwise, w8a8_runs
    from kernels.gemm.fp8_triton_kernel import quantize_rows_triton

    n, k = WIDTHS_8B[group]
    x, weight, scale = _case(rows, n, k, block)
    quantized, row_scale = quantize_rows_triton(x)
    expected_q, expected_scale = quantize_rows(x.cpu())
    assert torch.equal(row_scale.cpu(), expected_scale.reshape(-1))
    differ = (quantized.view(torch.uint8).cpu() != expected_q.view(torch.uint8)).nonzero()
    where = [(tuple(i), x[tuple(i)].item(), (x[tuple(i)].float() / row_scale[i[0]]).item(),
              quantized[tuple(i)].float().item(), expected_q[tuple(i)].float().item()) for i in differ[:4].tolist()]
    assert len(differ) == 0, f"{len(differ)} codes differ (index, x, x / scale, GPU, CPU): {where}"
    y = fp8_matmul(x, weight, scale, block, w8a8=True)
    emulated = reference_w8a8_matmul(x.float(), weight, scale, block)
    _assert_bf16_close(y, emulated)
    weight_only = fp8_matmul(x, weight, scale, block)
    magnitude = emulated.abs().max().item()
    assert not torch.equal(y, weight_only)
    assert (y.float() - weight_only.float()).abs().max().item() <= 0.1 * magnitude
    if block is None and w8a8_runs(x, weight):
        _assert_bf16_close(scaled_mm_rowwise(quantized, row_scale, weight, scale), emulated)


@pytest.mark.parametrize("block", list(BLOCKS.values()), ids=list(BLOCKS))
@pytest.mark.parametrize("group,rows", [("o", 1), ("o", 64), ("gate_up", 64)])
def test_decode_gemm_replays_from_a_cuda_graph(group: str, rows: int,
                                               block: tuple[int, int] | None) -> None:
    """Captured once, replayed on new rows written into the captured input: each replay is the
    new rows' product. o's 64 column tiles split K (at 1 row each tile's last split sums the
    partials, at 64 a second launch); gate/up's 448 tiles do not."""
    from kernels.gemm.fp8 import DECODE_TILING, fp8_matmul
    from kernels.gemm.fp8_triton_kernel import auto_split_k
    from kernels.host import num_sms

    n, k = WIDTHS_8B[group]
    splits = auto_split_k(n // DECODE_TILING.block_n, k // DECODE_TILING.block_k,
                          num_sms(torch.device("cuda")))
    assert (splits > 1) == (group == "o")
    x, weight, scale = _case(rows, n, k, block)
    fp8_matmul(x, weight, scale, block)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fp8_matmul(x, weight, scale, block)
    gen = torch.Generator(device="cuda").manual_seed(7)
    for _ in range(3):
        x.copy_(torch.randn(rows, k, device="cuda", generator=gen).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        _assert_bf16_close(y, _expected(x, weight, scale, block))


@pytest.mark.parametrize("w8a8", [False, True], ids=["weight-only", "w8a8"])
@pytest.mark.parametrize("rows", [1, 16, 64])
def test_split_k_graph_replays_sum_in_the_gemms_launch(rows: int, w8a8: bool,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """o's decode launch (64 column tiles, K split to fill the SMs) captured in a CUDA graph:
    up to LAST_SUMS_MAX_ROWS rows with no sum launch (each tile's last split sums the partials
    and zeroes its counter), above it with one. Every replay, on new rows, is the new rows'
    product, bit for bit the eager launch's and the sum launch's (forced: no counters), and
    leaves the counters zero."""
    from kernels.gemm import fp8_triton_kernel as fp8k
    from kernels.gemm.fp8 import DECODE_TILING, W8A8_NARROW_TILING, reference_w8a8_matmul

    launches: list[tuple] = []
    real_sum = fp8k._split_k_sum

    class Spy:
        def __getitem__(self, grid):
            launches.append(grid)
            return real_sum[grid]

    monkeypatch.setattr(fp8k, "_split_k_sum", Spy())
    n, k = WIDTHS_8B["o"]
    x, weight, scale = _case(rows, n, k, None)
    tiling = asdict(W8A8_NARROW_TILING if w8a8 else DECODE_TILING)

    def operands(rows_in: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return fp8k.quantize_rows_triton(rows_in) if w8a8 else (rows_in,)

    def gemm(*inputs: torch.Tensor) -> torch.Tensor:
        extra = dict(x_scale=inputs[1], out_dtype=torch.bfloat16) if w8a8 else {}
        return fp8k.fp8_gemm_triton(inputs[0], weight, scale, None, **tiling, **extra)

    last_sums = rows <= fp8k.LAST_SUMS_MAX_ROWS
    captured = operands(x)
    with monkeypatch.context() as patch:  # o splits K: the sum launch runs without counters
        patch.setattr(fp8k, "tile_counters", lambda device: None)
        gemm(*captured)
    assert len(launches) == 1
    gemm(*captured)  # compiles, and allocates the counters, outside the capture
    torch.cuda.synchronize()
    counters = fp8k.tile_counters(x.device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = gemm(*captured)
    assert len(launches) == (1 if last_sums else 3)  # captured: none, or the sum launch
    gen = torch.Generator(device="cuda").manual_seed(11)
    for _ in range(2):
        new = torch.randn(rows, k, device="cuda", generator=gen).to(torch.bfloat16)
        for buffer, value in zip(captured, operands(new)):
            buffer.copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        assert int(counters.count_nonzero()) == 0
        assert torch.equal(y, gemm(*captured))
        with monkeypatch.context() as patch:
            patch.setattr(fp8k, "tile_counters", lambda device: None)
            assert torch.equal(y, gemm(*captured))
        expected = (reference_w8a8_matmul(new.float(), weight, scale, None) if w8a8
                    else _expected(new, weight, scale, None))
        _assert_bf16_close(y, expected)
    assert len(launches) == (3 if last_sums else 7)


def test_fp8_decode_gemm_against_bf16_prints_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    """The benchmark at 64 rows, per-channel scales (printed; only the FP8 outputs, checked
    against the reference before timing, are asserted)."""
    from inference_node.tuner.fp8_gemm import LLAMA_3_1_8B, cuda_timer, measure, print_table
    from inference_node.tuner.trial import copy_bandwidth

    device = torch.device("cuda")
    rows = measure(LLAMA_3_1_8B, [64], None, device, cuda_timer)
    assert [r.group for r in rows] == list(WIDTHS_8B)
    with capsys.disabled():
        print_table(rows, copy_bandwidth(device), smoke=False)


@pytest.mark.parametrize("block", list(BLOCKS.values()), ids=list(BLOCKS))
@pytest.mark.parametrize("w8a8", [False, True], ids=["weight-only", "w8a8"])
@pytest.mark.parametrize("rows", [1, 64, 300])
def test_gated_gate_up_is_the_plain_launch_then_the_silu(rows: int, w8a8: bool,
                                                         block: tuple[int, int] | None) -> None:
    """At 8B's gate/up, the node's gated call (fp8_gated_silu: the SiLU in the GEMM's epilogue)
    gives, bit for bit, the plain launch of the same tiles then the SiLU kernel; and it is the
    float32 reference's SiLU(gate) * up within a bf16 ulp per rounding."""
    from kernels.activation.triton_kernel import silu_mul_triton
    from kernels.gemm import fp8
    from kernels.gemm.fp8_triton_kernel import fp8_gemm_triton, quantize_rows_triton

    n, k = WIDTHS_8B["gate_up"]
    x, weight, scale = _case(rows, n, k, block)
    gated = fp8.fp8_gated_silu(x, weight, scale, block, w8a8=w8a8)
    tiling = asdict(fp8.launch_tiling(rows, n, w8a8))
    tiling.update(split_k=1, block_n=tiling["block_n"] // 2 if tiling["block_n"] >= 128 else tiling["block_n"])
    if w8a8:
        quantized, row_scale = quantize_rows_triton(x)
        plain = fp8_gemm_triton(quantized, weight, scale, block, x_scale=row_scale, out_dtype=x.dtype,
                                **{**tiling, "widen_prmt": False})
    else:
        plain = fp8_gemm_triton(x, weight, scale, block, **tiling)
    assert torch.equal(gated, silu_mul_triton(plain))
    reference = fp8.reference_w8a8_matmul(x.float(), weight, scale, block) if w8a8 else _expected(x, weight, scale, block)
    gate, up = reference.chunk(2, dim=1)
    _assert_bf16_close(gated, torch.nn.functional.silu(gate) * up)


@pytest.mark.parametrize("w8a8", [False, True], ids=["weight-only", "w8a8"])
@pytest.mark.parametrize("rows,adapters", [(64, 32), (9, 3)])
@pytest.mark.parametrize("group,slices", [("qkv", 3), ("o", 1), ("gate_up", 2), ("down", 1)])
def test_lora_shrink_in_the_launch_at_8b_widths(group: str, slices: int, rows: int, adapters: int,
                                                w8a8: bool) -> None:
    """fp8_matmul with a shrink-only fold at 8B widths and the node's decode tilings (K split
    where they split it): the output is the launch without it, bit for bit, and each adapter
    row's x @ A.T in xa is the reference's in float32; rows without an adapter untouched."""
    import dataclasses

    from kernel_cases import grouped_slots, make_gemm_lora, make_lora_case

    from kernels.gemm.fp8 import fp8_matmul

    n, k = WIDTHS_8B[group]
    outs = [n // slices] * slices
    gen = torch.Generator().manual_seed(rows)
    slots = grouped_slots(gen, rows, list(range(adapters)))
    case = make_lora_case(token_slots=slots, num_slots=adapters, max_rank=16, h_in=k, outs=outs,
                          dtype=torch.bfloat16, device="cuda", seed=rows).poison_free_rows()
    lora = dataclasses.replace(make_gemm_lora(case, adapters), expand=False)
    _, weight, scale = _case(len(slots), n, k, None)
    y = fp8_matmul(case.x, weight, scale, None, w8a8=w8a8, lora=lora)
    assert torch.equal(y.view(torch.int16), fp8_matmul(case.x, weight, scale, None, w8a8=w8a8).view(torch.int16))
    active = (torch.tensor(slots) >= 0).cuda()
    assert torch.isnan(lora.xa[~active]).all()
    expected = lora.shrink(case.x)
    magnitude = expected[active].abs().max().item()
    torch.testing.assert_close(lora.xa[active], expected[active], rtol=1e-3, atol=1e-3 * magnitude)
