"""The weight-only FP8 GEMM (kernels/gemm/fp8_triton_kernel.py) against the PyTorch reference
(kernels/gemm/fp8.py) on small odd shapes: per-channel and block scales, N and K tails that no
tile divides, scale blocks narrower than a program's columns, K split over programs, decode
and prefill row counts, and the dispatcher's choice of the kernel.

Triton's interpreter decodes float8_e4m3fn loads exactly (every finite code; probe: the 256
byte values through tl.load and .to(float32 / bfloat16)), so the kernel's production path runs
here unchanged. The interpreter's tl.dot takes float32 operands (kernels/host.py: dot_f32), so
the bf16 tensor-core path is left to the GPU tests (test_fp8_gemm_gpu.py).

The interpreter must be on before Triton is imported: the `interpreter`-marked test below runs
this file in a child pytest with TRITON_INTERPRET=1 (as test_triton_interpreter.py does for the
other kernels); on a CUDA machine the cases also run natively. The compile tests run in the
parent: Triton's compiler for sm_90, no GPU needed.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from test_triton_interpreter import run_interpreted

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
needs_triton_device = pytest.mark.skipif(
    not INTERPRET and not torch.cuda.is_available(),
    reason="needs CUDA, or TRITON_INTERPRET=1 (test_fp8_gemm_in_interpreter runs it that way)")
pytestmark = [pytest.mark.interpreter,
              pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                 reason="Triton not installed")]

CHILD_TIMEOUT = 300  # the cases took about 20 s on a shared two-core machine


@pytest.mark.skipif(INTERPRET, reason="the interpreted child itself")
@pytest.mark.timeout(CHILD_TIMEOUT + 30)
def test_fp8_gemm_in_interpreter() -> None:
    out = run_interpreted("-k", "not in_interpreter and not for_hopper and not integer_widening",
                          str(Path(__file__).resolve()),
                          timeout=CHILD_TIMEOUT)
    assert " passed" in out and "skipped" not in out, out[-8000:]


# (x type, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_SCALES, PARTIAL, EVEN_K, warps, stages,
#  SWAP_AB, TMA, WIDEN_PRMT)
HOPPER_VARIANTS = [
    ("bf16", 64, 64, 128, False, True, True, 4, 4, False, False, False),  # decode: 64 rows, K split
    ("bf16", 16, 64, 128, True, False, True, 4, 4, False, False, False),  # one row tile, block scales
    ("fp16", 64, 64, 128, False, False, True, 4, 4, False, False, False),
    ("bf16", 128, 128, 64, True, False, False, 8, 4, False, False, False),  # prefill, a K tail
    ("bf16", 64, 128, 128, False, True, True, 4, 4, True, False, False),  # swap-AB, pointer loads
    ("bf16", 64, 128, 128, False, True, True, 8, 4, True, True, False),   # swap-AB, TMA
    ("bf16", 16, 64, 128, True, False, True, 4, 4, True, True, True),     # + integer widening
    ("bf16", 64, 128, 256, False, True, True, 8, 3, True, True, True),
    ("bf16", 64, 64, 128, False, False, False, 4, 4, False, True, True),  # TMA without swap, a K tail
    ("fp16", 64, 64, 128, True, True, True, 4, 4, True, True, False),
    ("fp8e4nv", 64, 64, 128, False, True, True, 4, 4, True, True, False),  # W8A8 decode
    ("fp8e4nv", 16, 64, 128, True, False, True, 4, 4, True, True, False),  # W8A8, block scales
    ("fp8e4nv", 128, 128, 64, False, False, True, 8, 4, False, False, False),  # W8A8 prefill
    # gate/up with its SiLU in the epilogue (GATED: never split)
    ("fp8e4nv", 64, 64, 128, False, False, True, 4, 4, True, True, False, True),   # W8A8 decode
    ("bf16", 64, 64, 128, False, False, True, 4, 4, True, True, True, True),       # weight-only
    ("fp8e4nv", 16, 64, 128, True, False, True, 4, 4, True, True, False, True),    # block scales
    # launched under PDL (base decode steps: Tuning.fp8_pdl): weights asked of L2, then the wait
    ("fp8e4nv", 64, 64, 256, False, True, True, 4, 3, True, True, False, False, True),  # W8A8 decode
    ("bf16", 64, 64, 128, False, False, True, 4, 4, True, True, True, True, True),      # gated
    # the kernel after it let launch once the K loop is done (Tuning.fp8_trigger)
    ("fp8e4nv", 64, 64, 256, False, True, True, 4, 3, True, True, False, False, True, True),
    ("fp8e4nv", 64, 64, 128, False, False, True, 4, 4, True, True, False, True, False, True),
]


def _variant_id(v: tuple) -> str:
    flags = "".join(name for name, on in zip(("-swap", "-tma", "-prmt", "-gated", "-pdl"), v[9:]) if on)
    trigger = "-trigger" if len(v) > 14 and v[14] else ""
    return f"{v[0]}-m{v[1]}-n{v[2]}-k{v[3]}-w{v[7]}{flags}{trigger}"


@pytest.mark.skipif(INTERPRET, reason="compiles: the interpreter has no compiler")
@pytest.mark.parametrize("variant", HOPPER_VARIANTS, ids=[_variant_id(v) for v in HOPPER_VARIANTS])
def test_kernel_compiles_for_hopper_with_its_loads_pipelined(variant: tuple) -> None:
    """Triton's compiler (which the interpreter skips) takes every variant for sm_90 without a
    GPU, as at run time where the launch's pointers and strides are 16-divisible (the hints
    given here): its loads go through cp.async (the software pipeline over num_stages), or with
    TMA through bulk tensor copies; with SWAP_AB the widened weight is wgmma's register operand
    (no shared-memory round trip; without it, wgmma reads the widened weight from shared
    memory, or under 64 rows Ampere's mma.sync runs); with WIDEN_PRMT no conversion goes
    through f16; split over K, the tile's last program sums the splits; GATED, each K tile
    multiplies gate's and up's weights and the epilogue computes the SiLU (ex2); with TRIGGER
    the kernel after it may launch before this one ends."""
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels.gemm.fp8_triton_kernel import _fp8_gemm_kernel, _split_k_sum

    (x_type, block_m, block_n, block_k, block_scales, partial, even_k, warps, stages, swap, tma,
     prmt), gated, pdl = variant[:12], len(variant) > 12 and variant[12], len(variant) > 13 and variant[13]
    trigger = len(variant) > 14 and variant[14]
    constexprs = dict(K=4096 if even_k else 4000, K_PER_SPLIT=1024, BLOCK_M=block_m, BLOCK_N=block_n,
                      BLOCK_K=block_k, BLOCK_SCALES=block_scales, SCALE_BN=128, SCALE_BK=128,
                      DOT_F32=False, PARTIAL=partial, EVEN_K=even_k, SWAP_AB=swap, TMA=tma,
                      WIDEN_PRMT=prmt, W8A8=x_type == "fp8e4nv", SPLIT_K=4 if partial else 1,
                      LAST_SUMS=partial, GATED=gated, PDL=pdl, PREFETCH_K=512 if pdl else 0,
                      TRIGGER=trigger)
    if x_type != "fp8e4nv":
        constexprs.update(xs_ptr=None)
    if not partial:
        constexprs.update(counter_ptr=None)
    out_type = "bf16" if x_type == "fp8e4nv" else x_type
    types = {"x_ptr": f"*{x_type}", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "xs_ptr": "*fp32",
             "out_ptr": "*fp32" if partial else f"*{out_type}", "y_ptr": f"*{out_type}",
             "counter_ptr": "*i32"}
    if tma:
        types.update(x_desc=f"tensordesc<{x_type}[{block_m},{block_k}]>",
                     w_desc=f"tensordesc<fp8e4nv[{block_n},{block_k}]>")
    else:
        constexprs.update(x_desc=None, w_desc=None)
    aligned = ("x_ptr", "w_ptr", "s_ptr", "out_ptr", "y_ptr", "N", "stride_xm", "stride_wn",
               "stride_om", "stride_split")
    fn = _fp8_gemm_kernel
    # constexprs left out take their defaults (a kernel's options added later, off)
    constexprs = {p.name: p.default for p in fn.params if p.is_constexpr and p.has_default} | constexprs
    signature = {p.name: "constexpr" if p.name in constexprs else types.get(p.name, "i32") for p in fn.params}
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=warps, num_stages=stages))
    ptx, ttgir = compiled.asm["ptx"], compiled.asm["ttgir"]
    assert "cubin" in compiled.asm
    assert ("cp.async.bulk.tensor" in ptx) if tma else ("cp.async.cg" in ptx)
    # PDL: the program asks L2 for its first weight lines, then waits for the kernel ahead
    assert ("prefetch.global.L2" in ptx and "griddepcontrol.wait" in ptx) == pdl
    assert ("griddepcontrol.launch_dependents" in ptx) == trigger
    dots = [line for line in ttgir.splitlines() if "ttng.warp_group_dot " in line]
    if not dots:  # x @ W.T with fewer than 64 rows: wgmma's M is 64, so Ampere's mma.sync
        assert not swap and block_m < 64 and "mma.sync" in ptx
    operand_types = [line.split("} : ", 1)[1] for line in dots]  # "A type * B type -> acc"
    assert ("ex2.approx" in ptx) == gated and (len(dots) % 2 == 0 if gated else True)
    register_a = [t.startswith("tensor<") and " * !ttg.memdesc" in t for t in operand_types]
    # swap-AB widens W into wgmma's register operand; W8A8 has nothing to widen: both from
    # shared memory, as loaded
    assert all(register_a) if swap and x_type != "fp8e4nv" else not any(register_a)
    if x_type == "fp8e4nv":  # both operands e4m3 into the MMA: no widening at all
        assert dots and all("f8E4M3FN" in t.split("->")[0] for t in operand_types), operand_types
        assert "e4m3" in ptx.split("wgmma.mma_async", 1)[1].split("\n", 1)[0]
        assert "cvt.rn.f16x2.e4m3x2" not in ptx
    elif prmt:
        assert "fma.rn.bf16x2" in ptx and "cvt.bf16.f16" not in ptx and "e4m3x2" not in ptx
    elif x_type == "bf16":
        assert "cvt.rn.f16x2.e4m3x2" in ptx
    # Split: the tile's last program to arrive (a GPU-scope acquire-release count, reset after)
    # sums the partials, read past L1 (.cg: other SMs wrote them); the sum launch is the
    # fallback where the counters do not reach
    atomics = [op for line in ptx.splitlines() for op in line.split() if op.startswith("atom.")]
    assert atomics == (["atom.global.gpu.acq_rel.add.u32", "atom.global.gpu.relaxed.exch.b32"]
                       if partial else []), atomics
    assert ("ld.global.cg" in ptx) == partial
    if partial:
        sum_signature = {"part_ptr": "*fp32", "y_ptr": f"*{out_type}", "numel": "i32",
                         "SPLIT_K": "constexpr", "BLOCK": "constexpr"}
        summed = triton.compile(ASTSource(_split_k_sum, sum_signature, dict(SPLIT_K=4, BLOCK=1024)),
                                target=GPUTarget("cuda", 90, 32))
        assert "cubin" in summed.asm


@pytest.mark.skipif(INTERPRET, reason="compiles: the interpreter has no compiler")
@pytest.mark.parametrize("one_pass,pdl", [(True, False), (False, False), (True, True)],
                         ids=["one-pass", "two-pass", "one-pass-pdl"])
def test_row_quantizer_compiles_for_hopper_with_its_rounding_kept(one_pass: bool, pdl: bool) -> None:
    """The W8A8 row quantizer compiles for sm_90: divisions correctly rounded (div.rn), the
    rounding's add and subtract kept (not folded away), e4m3 packed by the hardware's
    conversion; under PDL it lets the GEMM after it launch, then waits for the kernel ahead."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels.gemm.fp8_triton_kernel import _quantize_rows_kernel

    signature = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "K": "i32", "stride_xm": "i32",
                 "stride_qm": "i32", "BLOCK": "constexpr", "ONE_PASS": "constexpr", "PDL": "constexpr"}
    constexprs = dict(BLOCK=4096 if one_pass else 2048, ONE_PASS=one_pass, PDL=pdl)
    compiled = triton.compile(ASTSource(_quantize_rows_kernel, signature, constexprs),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    ptx = compiled.asm["ptx"]
    assert "div.rn.f32" in ptx and "div.full" not in ptx and "div.approx" not in ptx
    assert "add.f32" in ptx and "sub.f32" in ptx and "cvt.rn.satfinite.e4m3x2.f32" in ptx
    assert ("griddepcontrol.launch_dependents" in ptx and "griddepcontrol.wait" in ptx) == pdl


def _run_ptx(asm: str, registers: dict[str, int]) -> dict[str, int]:
    """The straight-line PTX of E4M3_TO_BF16_ASM run on 32-bit values: prmt (default mode),
    shr, and, or, mov and fma.rn.bf16x2 (each lane rounded to bf16 from the exact value)."""
    def value(token: str) -> int:
        return int(token, 0) if token[0].isdigit() else registers[token]

    def bf16x2(word: int) -> torch.Tensor:
        return torch.tensor([word & 0xFFFF, word >> 16], dtype=torch.int32).to(torch.int16).view(torch.bfloat16)

    for line in asm.strip().strip("{}").split(";"):
        line = line.strip()
        if not line or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        dst, *src = [a.strip() for a in args.split(",")]
        a = [value(t) for t in src]
        if op == "prmt.b32":
            pool = a[0].to_bytes(4, "little") + a[1].to_bytes(4, "little")
            out = bytes(pool[(a[2] >> (4 * i)) & 0x7] for i in range(4))
            registers[dst] = int.from_bytes(out, "little")
        elif op == "shr.b32":
            registers[dst] = a[0] >> a[1]
        elif op == "and.b32":
            registers[dst] = a[0] & a[1]
        elif op == "or.b32":
            registers[dst] = a[0] | a[1]
        elif op == "mov.b32":
            registers[dst] = a[0]
        elif op == "fma.rn.bf16x2":
            exact = bf16x2(a[0]).double() * bf16x2(a[1]).double() + bf16x2(a[2]).double()
            lanes = exact.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
            registers[dst] = int(lanes[0]) | int(lanes[1]) << 16
        else:
            raise AssertionError(f"unexpected instruction {op}")
    return registers


@pytest.mark.skipif(INTERPRET, reason="no kernel: the asm's arithmetic, checked on the host")
def test_the_integer_widening_is_exact_for_every_e4m3_code() -> None:
    """E4M3_TO_BF16_ASM (the GPU-only WIDEN_PRMT path, which the interpreter cannot run) maps
    each of four packed e4m3 bytes, in order, to its bf16 value exactly: all 254 finite codes,
    subnormals and both zeros included (NaN codes excepted: no weight holds one)."""
    from kernels.gemm.fp8_triton_kernel import E4M3_TO_BF16_ASM

    codes = torch.arange(256, dtype=torch.int32)
    expected = codes.to(torch.uint8).view(torch.float8_e4m3fn).to(torch.bfloat16)
    finite = ~expected.isnan()
    got = []
    for word in codes.reshape(64, 4).tolist():
        packed = word[0] | word[1] << 8 | word[2] << 16 | word[3] << 24
        out = _run_ptx(E4M3_TO_BF16_ASM.value, {"$2": packed})
        got += [out["$0"] & 0xFFFF, out["$0"] >> 16, out["$1"] & 0xFFFF, out["$1"] >> 16]
    got_bf16 = torch.tensor(got, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    assert torch.equal(got_bf16[finite].view(torch.int16), expected[finite].view(torch.int16))
    assert int(finite.sum()) == 254


def make_case(rows: int, n: int, k: int, block: tuple[int, int] | None, dtype: torch.dtype,
              seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, weight, scale): weights spread over e4m3's range (subnormals to 448), scales of a
    real checkpoint's size (around 1e-2), each block or row its own."""
    gen = torch.Generator().manual_seed(seed + rows * 7 + n * 13 + k)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    weight = (torch.randn(n, k, generator=gen) * 60).clamp(-448, 448).to(torch.float8_e4m3fn)
    shape = (n,) if block is None else (-(-n // block[0]), -(-k // block[1]))
    scale = torch.rand(shape, generator=gen) * 0.02 + 1e-3
    return x.to(DEVICE), weight.to(DEVICE), scale.to(DEVICE)


def assert_matches_reference(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                             scale: torch.Tensor, block: tuple[int, int] | None) -> None:
    """y is the reference's value up to float32 summation order, then one rounding to x's
    dtype (a bf16 ulp: 2^-8 relative)."""
    from kernels.gemm.fp8 import reference_fp8_matmul

    expected = reference_fp8_matmul(x, weight, scale, block)
    assert y.shape == expected.shape and y.dtype == x.dtype
    magnitude = expected.float().abs().max().item()
    rel = 1e-5 if x.dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(y.float().cpu(), expected.float().cpu(), rtol=rel, atol=rel * magnitude)


# (rows, N, K, kernel keywords): N past the last full column tile, K past the last K tile.
SHAPES = [
    (1, 72, 200, dict(block_n=32, block_k=64)),
    (7, 72, 200, dict(block_n=32, block_k=64, split_k=3)),
    (64, 100, 160, dict(block_n=16, block_k=32)),
    (7, 48, 256, dict(block_n=16, block_k=32, split_k=None)),  # auto: splits to fill the SMs
    (37, 40, 96, dict(block_m=16, block_n=32, block_k=32, split_k=2)),  # rows over 3 row tiles
]
# per-channel; scale blocks wider and narrower than block_n; one scale a row per 32 columns (the
# loader's spread block scales of fused groups and shards off block edges)
BLOCKS = [None, (32, 64), (16, 32), (1, 32)]


# The launch options on top of each shape's tiling: today's x @ W.T, swap-AB, swap-AB with TMA
# (and the integer widening, which runs on a compiled GPU only: here Triton's conversion).
LAUNCHES = [{}, dict(swap_ab=True), dict(swap_ab=True, tma=True, widen_prmt=True)]


@needs_triton_device
@pytest.mark.parametrize("launch", LAUNCHES, ids=["xwt", "swap", "swap-tma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block", BLOCKS, ids=["channel", "block32x64", "block16x32", "block1x32"])
@pytest.mark.parametrize("rows,n,k,tiling", SHAPES, ids=[f"m{s[0]}-n{s[1]}-k{s[2]}" for s in SHAPES])
def test_kernel_matches_reference(rows: int, n: int, k: int, tiling: dict,
                                  block: tuple[int, int] | None, dtype: torch.dtype,
                                  launch: dict) -> None:
    from kernels.gemm.fp8_triton_kernel import fp8_gemm_triton

    if block is not None and block[1] % tiling["block_k"]:
        tiling = {**tiling, "block_k": block[1]}
    x, weight, scale = make_case(rows, n, k, block, dtype)
    y = fp8_gemm_triton(x, weight, scale, block, **tiling, **launch)
    assert_matches_reference(y, x, weight, scale, block)


@needs_triton_device
@pytest.mark.parametrize("block", [None, (32, 64), (1, 32)], ids=["channel", "block32x64", "block1x32"])
@pytest.mark.parametrize("rows,n,k", [(1, 72, 208), (7, 100, 160), (64, 40, 96)])
def test_tma_tiles_past_the_edges_read_as_zero(rows: int, n: int, k: int,
                                               block: tuple[int, int] | None) -> None:
    """Where TMA runs (here: K a multiple of 16, 16-byte aligned rows), its descriptors are
    built and the tiles past N, past K and past the batch's rows read as zeros: the swap-AB and
    x @ W.T launches give the reference's values, split over K or not."""
    from kernels.gemm.fp8_triton_kernel import descriptors, fp8_gemm_triton

    x, weight, scale = make_case(rows, n, k, block, torch.bfloat16)
    assert all(d is not None for d in descriptors(x, weight, 16, 32, 32))
    for swap_ab in (False, True):
        for split_k in (1, 2):
            y = fp8_gemm_triton(x, weight, scale, block, block_n=32, block_k=32, split_k=split_k,
                                swap_ab=swap_ab, tma=True)
            assert_matches_reference(y, x, weight, scale, block)


@needs_triton_device
def test_split_k_partials_sum_to_the_unsplit_result() -> None:
    """Each K split's partial, summed in split order, is the whole K range's value (to float32
    summation order): no column is dropped or counted twice at the splits' edges."""
    from kernels.gemm.fp8_triton_kernel import fp8_gemm_triton

    x, weight, scale = make_case(5, 32, 16 * 11, (16, 16), torch.float32)
    whole = fp8_gemm_triton(x, weight, scale, (16, 16), block_n=16, block_k=16, split_k=1)
    for split in (2, 3, 4, 11, 40):  # 40: clamped to the 11 K tiles
        y = fp8_gemm_triton(x, weight, scale, (16, 16), block_n=16, block_k=16, split_k=split)
        torch.testing.assert_close(y, whole, rtol=1e-5, atol=1e-5 * whole.abs().max().item())


class _LaunchSpy:
    """A kernel whose launches are recorded (their grids) and then run."""

    def __init__(self, kernel) -> None:
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


@needs_triton_device
@pytest.mark.parametrize("launch", LAUNCHES[:2] + [dict(swap_ab=True, tma=True)],
                         ids=["xwt", "swap", "swap-tma"])
@pytest.mark.parametrize("w8a8", [False, True], ids=["weight-only", "w8a8"])
def test_split_k_summed_by_each_tiles_last_program(w8a8: bool, launch: dict,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Split over K, the tile's last program to arrive sums its splits' partials into y, with
    no sum launch after the GEMM's: the sum launch's bits (float32 out, where a different
    order would show), and the counters left zero, so the same launch again (as a graph's
    replay) gives the same bits, and a new x its own product. 3 row tiles of 16 (the last
    partial), 3 column tiles of 32 (the last partial), 7 K tiles of 32 (the last partial) in 3
    splits; where the counters are missing (a capture before their allocation) or hold fewer
    tiles, or a tile has more than LAST_SUMS_MAX_ROWS rows, the sum launch runs instead."""
    from kernels import host
    from kernels.gemm import fp8_triton_kernel as fp8k

    sums = _LaunchSpy(fp8k._split_k_sum)
    monkeypatch.setattr(fp8k, "_split_k_sum", sums)
    block = (32, 64)
    x, weight, scale = make_case(37, 72, 208, block, torch.float32)
    x2 = make_case(37, 72, 208, block, torch.float32, seed=1)[0]
    keywords = dict(block_m=16, block_n=32, block_k=32, split_k=3, **launch)
    if launch.get("tma"):
        assert all(d is not None for d in fp8k.descriptors(x, weight, 16, 32, 32))

    def gemm(rows: torch.Tensor) -> torch.Tensor:
        if not w8a8:
            return fp8k.fp8_gemm_triton(rows, weight, scale, block, **keywords)
        quantized, row_scale = fp8k.quantize_rows_triton(rows)
        return fp8k.fp8_gemm_triton(quantized, weight, scale, block, x_scale=row_scale,
                                    out_dtype=torch.float32, **keywords)

    counters = fp8k.tile_counters(torch.device(DEVICE))  # "cuda": the current device's
    assert counters is fp8k.tile_counters(x.device)
    first = gemm(x)
    assert sums.grids == [] and int(counters.count_nonzero()) == 0
    again = gemm(x)
    assert int(counters.count_nonzero()) == 0
    other = gemm(x2)
    assert sums.grids == [] and int(counters.count_nonzero()) == 0
    (assert_matches_w8a8_reference if w8a8 else assert_matches_reference)(first, x, weight, scale, block)
    (assert_matches_w8a8_reference if w8a8 else assert_matches_reference)(other, x2, weight, scale, block)

    with monkeypatch.context() as patch:
        patch.setattr(fp8k, "tile_counters", lambda device: None)
        summed = gemm(x)
        summed_other = gemm(x2)
    assert len(sums.grids) == 2
    small = torch.zeros(8, dtype=torch.int32, device=DEVICE)  # 9 tiles: one too many
    monkeypatch.setitem(host._ARRIVAL_COUNTS, (x.device, "fp8_gemm"), small)
    assert torch.equal(gemm(x).view(torch.int32), summed.view(torch.int32))
    assert len(sums.grids) == 3 and int(small.count_nonzero()) == 0
    assert fp8k.LAST_SUMS_MAX_ROWS == 16
    keywords["block_m"] = 32  # 2 row tiles of 32, 6 tiles in all: counters enough, rows not
    taller = gemm(x)
    assert len(sums.grids) == 4 and int(small.count_nonzero()) == 0
    (assert_matches_w8a8_reference if w8a8 else assert_matches_reference)(taller, x, weight, scale, block)
    for y, expected in ((first, summed), (again, summed), (other, summed_other)):
        assert y.dtype == torch.float32
        assert torch.equal(y.view(torch.int32), expected.view(torch.int32))


@needs_triton_device
def test_a_per_tensor_scale_broadcast_by_a_stride_0_view() -> None:
    """The loader broadcasts a per-tensor scale to [N]: an expanded view (stride 0) reads as
    that scale on every row."""
    from kernels.gemm.fp8_triton_kernel import fp8_gemm_triton

    x, weight, _ = make_case(3, 40, 64, None, torch.float32)
    scale = torch.tensor([0.0125], device=DEVICE).expand(40)
    assert scale.stride(0) == 0
    y = fp8_gemm_triton(x, weight, scale, None, block_n=16, block_k=32)
    assert_matches_reference(y, x, weight, scale, None)


@needs_triton_device
@pytest.mark.parametrize("rows", [1, 7, 64, 100])  # 100: past DECODE_ROWS, the prefill tiling
@pytest.mark.parametrize("block", [None, (128, 128), (1, 128), (128, 1)],
                         ids=["channel", "block128", "block1x128", "block128x1"])
def test_fp8_matmul_runs_the_kernel_at_decode_and_prefill_rows(
        rows: int, block: tuple[int, int] | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where Triton runs, fp8_matmul launches the kernel (decode tiling up to DECODE_ROWS rows,
    prefill tiling above) and gives the reference's values; with w8a8 W8A8's tilings over
    the per-row quantized x, giving reference_w8a8_matmul's. Scale blocks one column wide (the
    loader's spread of a shard off a block edge) no K tile divides: the references run them,
    no launch."""
    from kernels.gemm import fp8, fp8_triton_kernel

    launches = []
    real = fp8_triton_kernel.fp8_gemm_triton

    def spy(*args, **kwargs):
        launches.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(fp8_triton_kernel, "fp8_gemm_triton", spy)
    x, weight, scale = make_case(rows, 144, 136, block, torch.bfloat16)
    assert_matches_reference(fp8.fp8_matmul(x, weight, scale, block), x, weight, scale, block)
    y = fp8.fp8_matmul(x, weight, scale, block, w8a8=True)
    assert_matches_w8a8_reference(y, x, weight, scale, block)
    decode = rows <= fp8.DECODE_ROWS
    plain = fp8.DECODE_TILING if decode else fp8.PREFILL_TILING
    w8a8 = fp8.W8A8_NARROW_TILING if decode else fp8.W8A8_PREFILL_TILING
    expected = [] if block == (128, 1) else [
        (t.block_n, fp8.k_tile(block, t.block_k), quantized) for t, quantized in ((plain, False), (w8a8, True))]
    assert [(kw["block_n"], kw["block_k"], kw.get("x_scale") is not None) for kw in launches] == expected


@needs_triton_device
@pytest.mark.parametrize("w8a8", [False, True])
def test_rows_past_decode_split_k_where_their_tiles_leave_sms_idle(w8a8: bool) -> None:
    """Past DECODE_ROWS a launch of few tiles (one row tile of 100, two column tiles, for
    the interpreter's 4 SMs) splits K: summed by its own launch, or left to the next kernel
    (SplitSums), it is the reference's product."""
    from kernels.gemm import fp8

    x, weight, scale = make_case(100, 256, 2048, None, torch.bfloat16)
    check = assert_matches_w8a8_reference if w8a8 else assert_matches_reference
    check(fp8.fp8_matmul(x, weight, scale, None, w8a8=w8a8), x, weight, scale, None)
    left = fp8.fp8_matmul(x, weight, scale, None, w8a8=w8a8, leave_sums=True)
    assert isinstance(left, fp8.SplitSums) and left.parts.shape[0] >= 2
    check(left.total(), x, weight, scale, None)


@needs_triton_device
def test_pdl_asked_only_at_decode_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp8_matmul(pdl=True) launches the GEMM with PDL and its weight prefetch up to
    DECODE_ROWS rows, plainly past them (where waiting programs cost more than they hide)."""
    from kernels.gemm import fp8, fp8_triton_kernel

    launches = []
    real = fp8_triton_kernel.fp8_gemm_triton

    def spy(*args, **kwargs):
        launches.append((args[0].shape[0], kwargs.get("pdl", False), kwargs.get("prefetch_k", 0)))
        return real(*args, **kwargs)

    monkeypatch.setattr(fp8_triton_kernel, "fp8_gemm_triton", spy)
    for rows in (8, fp8.DECODE_ROWS, fp8.DECODE_ROWS + 1):
        x, weight, scale = make_case(rows, 64, 256, None, torch.bfloat16)
        for w8a8 in (False, True):
            fp8.fp8_matmul(x, weight, scale, None, w8a8=w8a8, pdl=True)
    decode = (True, fp8.PDL_PREFETCH_K)
    assert launches == [(8, *decode)] * 2 + [(fp8.DECODE_ROWS, *decode)] * 2 + [(fp8.DECODE_ROWS + 1, False, 0)] * 2


def assert_matches_w8a8_reference(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                                  scale: torch.Tensor, block: tuple[int, int] | None) -> None:
    """y is reference_w8a8_matmul's value up to float32 summation order and one rounding."""
    from kernels.gemm.fp8 import reference_w8a8_matmul

    expected = reference_w8a8_matmul(x, weight, scale, block)
    assert y.shape == expected.shape and y.dtype == x.dtype
    rel = 1e-5 if x.dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(y.float().cpu(), expected.float().cpu(), rtol=rel,
                               atol=rel * expected.float().abs().max().item())


@needs_triton_device
@pytest.mark.parametrize("rows,k", [(1, 200), (7, 4100), (64, 96)])
def test_rows_quantized_as_the_reference_does(rows: int, k: int) -> None:
    """quantize_rows_triton gives quantize_rows' e4m3 codes and scales, bit for bit: K past
    one program's block (4100), a row of zeros (its tiny scale), a row past e4m3's range."""
    from kernels.gemm.fp8 import quantize_rows
    from kernels.gemm.fp8_triton_kernel import quantize_rows_triton

    x, _, _ = make_case(rows, 16, k, None, torch.bfloat16)
    x[0] *= 1000.0
    x[0, :3] = torch.tensor([-1e-9, 1e-9, -0.0])  # round to -0, +0, -0 (the sign kept)
    if rows > 1:
        x[1] = 0.0
    expected, expected_scale = quantize_rows(x)
    for block in (None, 2048):  # the row in registers at once, and in steps read twice
        quantized, scale = quantize_rows_triton(x, block=block)
        assert torch.equal(scale.cpu(), expected_scale.reshape(-1).cpu())
        assert torch.equal(quantized.view(torch.uint8).cpu(), expected.view(torch.uint8).cpu())


@needs_triton_device
@pytest.mark.parametrize("launch", LAUNCHES[:2] + [dict(swap_ab=True, tma=True)],
                         ids=["xwt", "swap", "swap-tma"])
@pytest.mark.parametrize("block", [None, (32, 64)], ids=["channel", "block32x64"])
@pytest.mark.parametrize("rows,n,k,tiling", SHAPES[:3], ids=[f"m{s[0]}-n{s[1]}-k{s[2]}" for s in SHAPES[:3]])
def test_w8a8_kernel_matches_its_reference(rows: int, n: int, k: int, tiling: dict,
                                           block: tuple[int, int] | None, launch: dict) -> None:
    """The GEMM over e4m3 x and its row scales (W8A8) gives the quantized x's product with the
    dequantized weight: each row's scale and each column's (or block's) applied once."""
    from kernels.gemm.fp8_triton_kernel import fp8_gemm_triton, quantize_rows_triton

    if block is not None and block[1] % tiling["block_k"]:
        tiling = {**tiling, "block_k": block[1]}
    x, weight, scale = make_case(rows, n, k, block, torch.bfloat16)
    quantized, row_scale = quantize_rows_triton(x)
    y = fp8_gemm_triton(quantized, weight, scale, block, x_scale=row_scale, out_dtype=x.dtype,
                        **tiling, **launch)
    assert_matches_w8a8_reference(y, x, weight, scale, block)


@needs_triton_device
@pytest.mark.parametrize("launch", LAUNCHES[:2] + [dict(swap_ab=True, tma=True)],
                         ids=["xwt", "swap", "swap-tma"])
@pytest.mark.parametrize("block", [None, (32, 64), (1, 32)], ids=["channel", "block32x64", "block1x32"])
@pytest.mark.parametrize("w8a8", [False, True], ids=["weight-only", "w8a8"])
@pytest.mark.parametrize("rows", [7, 64])
def test_gated_launch_is_the_plain_launch_then_the_silu(rows: int, w8a8: bool,
                                                        block: tuple[int, int] | None,
                                                        launch: dict) -> None:
    """gate/up's GEMM with SiLU(gate) * up in its epilogue gives, bit for bit, its plain launch
    then the SiLU kernel: each half's own scales, the row scales under W8A8, a half of 40
    columns that no 32-column tile divides (the mask keeps up's rows out of gate's tile)."""
    from kernels.activation.triton_kernel import silu_mul_triton
    from kernels.gemm.fp8_triton_kernel import fp8_gemm_triton, quantize_rows_triton

    half, k = 40, 128
    x, weight, scale = make_case(rows, 2 * half, k, block, torch.bfloat16)
    tiling = dict(block_n=32, block_k=32, split_k=1, **launch)
    operand, extra = x, {}
    if w8a8:
        operand, row_scale = quantize_rows_triton(x)
        extra = dict(x_scale=row_scale, out_dtype=x.dtype)
    gated = fp8_gemm_triton(operand, weight, scale, block, gated=True, **tiling, **extra)
    two_launches = silu_mul_triton(fp8_gemm_triton(operand, weight, scale, block, **tiling, **extra))
    assert gated.shape == (rows, half)
    assert torch.equal(gated.view(torch.int16), two_launches.view(torch.int16))


@needs_triton_device
@pytest.mark.parametrize("w8a8", [False, True], ids=["weight-only", "w8a8"])
def test_fp8_gated_silu_runs_the_gated_launch_with_the_nodes_tiling(w8a8: bool) -> None:
    """The node's call (fp8_gated_silu) takes a norm's e4m3 copy where given and matches the
    two calls it replaces (fp8_matmul, then the SiLU kernel) to a bf16 ulp: its tiles are
    half as wide where the plain tiling's are 128 or more, which sums in another order."""
    from kernels.activation.triton_kernel import silu_mul_triton
    from kernels.gemm import fp8

    half, k = 96, 256
    x, weight, scale = make_case(64, 2 * half, k, None, torch.bfloat16)
    rows = fp8.Fp8Rows(x, *fp8.quantize_rows(x)) if w8a8 else None
    if rows is not None:
        rows = fp8.Fp8Rows(x, rows.fp8, rows.scale.reshape(-1))
    got = fp8.fp8_gated_silu(x, weight, scale, None, w8a8=w8a8, rows=rows)
    expected = silu_mul_triton(fp8.fp8_matmul(x, weight, scale, None, w8a8=w8a8))
    torch.testing.assert_close(got.float(), expected.float(), rtol=2 ** -7,
                               atol=2 ** -7 * expected.float().abs().max().item())


@needs_triton_device
@pytest.mark.parametrize("w8a8", [False, True], ids=["weight-only", "w8a8"])
def test_splits_left_to_sum_are_the_summed_output(w8a8: bool) -> None:
    """leave_sums: a K-split launch hands back its partials (SplitSums) instead of launching
    their sum, and their total() is the output the launch writes otherwise, bit for bit; an
    unsplit launch writes its output as ever."""
    from kernels.gemm.fp8 import SplitSums
    from kernels.gemm.fp8_triton_kernel import fp8_gemm_triton, quantize_rows_triton

    x, weight, scale = make_case(48, 40, 256, None, torch.bfloat16)
    extra = {}
    if w8a8:
        x, row_scale = quantize_rows_triton(x)
        extra = dict(x_scale=row_scale, out_dtype=torch.bfloat16)
    tiling = dict(block_n=16, block_k=32, split_k=3, **extra)
    left = fp8_gemm_triton(x, weight, scale, None, leave_sums=True, **tiling)
    assert isinstance(left, SplitSums) and left.parts.shape == (3, 48, 40) and left.shape == (48, 40)
    summed = fp8_gemm_triton(x, weight, scale, None, **tiling)
    assert torch.equal(left.total().view(torch.int16), summed.view(torch.int16))
    unsplit = fp8_gemm_triton(x, weight, scale, None, leave_sums=True, **{**tiling, "split_k": 1})
    assert isinstance(unsplit, torch.Tensor)


def test_w8a8_decode_splits_k_as_far_as_it_pays() -> None:
    """At 8B's widths on 132 SMs (64-column tiles, 256-column K steps), the W8A8 decode tiling
    splits q/k/v not at all (96 programs), o in two (128), down in four (no split streams more
    than 4096 columns of K); the plain rule fills every SM."""
    from dataclasses import asdict

    from kernels.gemm.fp8 import W8A8_NARROW_TILING as narrow
    from kernels.gemm.fp8_triton_kernel import auto_split_k

    rule = dict(fill=narrow.split_fill, max_tiles=narrow.split_columns // narrow.block_k)
    assert [auto_split_k(n // 64, k // 256, 132, **rule) for n, k in ((6144, 4096), (4096, 4096), (4096, 14336))] \
        == [1, 2, 4]
    assert [auto_split_k(n // 64, k // 256, 132) for n, k in ((6144, 4096), (4096, 4096), (4096, 14336))] == [2, 4, 4]
    assert {"split_fill", "split_columns"} <= set(asdict(narrow))


@needs_triton_device
def test_x_with_a_row_stride_of_its_own() -> None:
    """x a column slice of a wider buffer (rows not adjacent) reads its own columns only."""
    from kernels.gemm.fp8 import fp8_matmul

    x, weight, scale = make_case(9, 48, 64, None, torch.bfloat16)
    wide = torch.randn(9, 100, device=DEVICE).to(torch.bfloat16)
    wide[:, 10:74] = x
    view = wide[:, 10:74]
    assert view.stride(0) == 100
    assert_matches_reference(fp8_matmul(view, weight, scale, None), x, weight, scale, None)


@needs_triton_device
def test_the_bench_sweep_checks_each_tiling_against_the_reference() -> None:
    """inference_node/tuner/fp8_gemm.py's --sweep path: each tiling's launch (the kernel with
    those keywords, K tiles narrowed to the scale blocks) is checked before it is timed."""
    from inference_node.tuner import fp8_gemm
    from kernels.gemm.fp8 import DECODE_TILING, Fp8Tiling
    from kernels.tuning_table import ModelShape

    shape = ModelShape(hidden=64, intermediate=96, heads=2, kv_heads=1, head_dim=32)
    tilings = [Fp8Tiling(block_n=16, block_k=32, split_k=2),
               Fp8Tiling(block_n=32, block_k=64, split_k=1, swap_ab=True, tma=True, widen_prmt=True)]
    timer = fp8_gemm.wall_timer if INTERPRET else fp8_gemm.cuda_timer
    rows = fp8_gemm.measure(shape, [3], (32, 32), torch.device(DEVICE), timer, copies=1, tilings=tilings)
    assert [(r.group, r.n, r.k) for r in rows] == [(g, n, k) for g, (n, k) in shape.gemms().items()]
    assert all(r.tiling in (DECODE_TILING, *tilings) and r.fp8_us > 0 for r in rows)
    assert all([t for t, _ in r.swept] == [DECODE_TILING, *tilings] for r in rows)
    lines: list[str] = []
    fp8_gemm.print_table(rows, None, smoke=True, out=lines.append)
    per_tiling = lines[next(i for i, line in enumerate(lines) if "fp8 us per tiling" in line):]
    assert [line.split(")")[0] + ")" for line in per_tiling[1:]] == ["(64, 128, auto)", "(16, 32, 2)", "(32, 64, 1)"]
    assert "w4 s4 swap tma prmt" in per_tiling[3]


def test_the_sweep_grid_covers_each_design() -> None:
    """The --sweep grid times each new design against today's default: swap-AB with pointer
    and TMA loads, the integer widening with and without swap-AB, 8 warps, wider tiles; each
    tiling once, and within one H200 call's budget (about 20)."""
    from inference_node.tuner.fp8_gemm import sweep_tilings
    from kernels.gemm.fp8 import DECODE_TILING

    grid = sweep_tilings()
    assert DECODE_TILING not in grid and len(set(grid)) == len(grid) <= 20
    designs = {(t.swap_ab, t.tma, t.widen_prmt) for t in grid}
    assert {(False, False, True), (True, False, False), (True, True, False), (True, True, True)} <= designs
    assert {t.block_n for t in grid} >= {64, 128, 256} and {t.num_warps for t in grid} == {4, 8}


@needs_triton_device
def test_the_tuners_w8a8_columns_check_and_time_the_nodes_call() -> None:
    """tuner/fp8_gemm.py with W8A8: each row gets the quantizer's, the node's call's and the
    fastest checked W8A8 GEMM's times, and that GEMM's tiling."""
    from inference_node.tuner import fp8_gemm
    from kernels.tuning_table import ModelShape

    shape = ModelShape(hidden=64, intermediate=192, heads=4, kv_heads=2, head_dim=16)
    rows = fp8_gemm.measure(shape, [3], None, torch.device(DEVICE), fp8_gemm.wall_timer, copies=1,
                            w8a8_tilings=())
    assert [r.group for r in rows] == ["qkv", "o", "gate_up", "down"]
    for row in rows:
        assert row.quantize_us > 0 and row.w8a8_node_us > 0 and 0 < row.w8a8_us < float("inf"), row
        assert row.w8a8_tiling.swap_ab and row.note == "", row


@needs_triton_device
@pytest.mark.parametrize("rows,used,segments,split_k", [(1, [2], 1, 1), (9, [3, 0, 2], 4, 2),
                                                        (33, [1, 4, 0, 5, 2, 6], 8, 3),
                                                        (100, [1, 4, 0, 5, 2, 6], 8, 1)])
@pytest.mark.parametrize("w8a8", [False, True], ids=["weight-only", "w8a8"])
@pytest.mark.parametrize("slices", [1, 2, 3])
def test_the_launch_shrinks_a_lora_beside_its_tiles(rows: int, used: list[int], segments: int,
                                                    split_k: int, w8a8: bool, slices: int) -> None:
    """A shrink-only fold (GemmLora expand False) in the FP8 GEMM's launch: programs in front
    of the tiles store each adapter row's x @ A.T (of the 16-bit rows, under W8A8 too) into
    xa as the fold's reference does, for every slice, over segment tables padded past the
    step's adapters, rows up to two row tiles and K splits; rows without an adapter keep
    xa's NaN; the GEMM's output is the launch without it, bit for bit."""
    import dataclasses

    from kernel_cases import grouped_slots, make_gemm_lora, make_lora_case

    from kernels.gemm.fp8_triton_kernel import fp8_gemm_triton, quantize_rows_triton

    gen = torch.Generator().manual_seed(rows + slices)
    slots = grouped_slots(gen, rows, used)
    tokens = len(slots)
    outs = [32, 16, 16][:slices]
    case = make_lora_case(token_slots=slots, num_slots=7, max_rank=16, ranks=[16, 8, 16, 4, 16, 16, 12],
                          h_in=128, outs=outs, dtype=torch.bfloat16, device=DEVICE,
                          seed=rows).poison_free_rows()
    lora = dataclasses.replace(make_gemm_lora(case, segments), expand=False)
    x16, weight, scale = case.x, *make_case(tokens, sum(outs), 128, None, torch.bfloat16)[1:]
    extra = {}
    x = x16
    if w8a8:
        x, row_scale = quantize_rows_triton(x16)
        extra = dict(x_scale=row_scale, out_dtype=torch.bfloat16)
    tiling = dict(block_n=16, block_k=32, split_k=split_k, swap_ab=True, tma=True, **extra)
    plain = fp8_gemm_triton(x, weight, scale, None, **tiling)
    y = fp8_gemm_triton(x, weight, scale, None, lora=lora, x16=x16, **tiling)
    assert torch.equal(y.view(torch.int16), plain.view(torch.int16))
    active = torch.tensor(slots) >= 0
    got = lora.xa.cpu()
    assert torch.isnan(got[~active]).all()
    expected = lora.shrink(x16).cpu()
    torch.testing.assert_close(got[active], expected[active], rtol=1e-4, atol=1e-4)


@needs_triton_device
def test_fp8_matmul_hands_the_shrink_to_the_launch_or_stores_its_reference() -> None:
    """fp8_matmul(lora=...) stores the same rows of xa whether its launch shrinks (a fitting
    fold) or the reference does beside it (a rank the tensor cores do not take)."""
    import dataclasses

    from kernel_cases import grouped_slots, make_gemm_lora, make_lora_case

    from kernels.gemm.fp8 import fp8_matmul

    gen = torch.Generator().manual_seed(5)
    slots = grouped_slots(gen, 12, [1, 3])
    case = make_lora_case(token_slots=slots, num_slots=4, max_rank=16, ranks=[16, 8, 16, 4], h_in=128,
                          outs=[48], dtype=torch.bfloat16, device=DEVICE, seed=5)
    _, weight, scale = make_case(len(slots), 48, 128, None, torch.bfloat16)
    active = torch.tensor(slots) >= 0
    for max_rank in (16, 12):  # 12: no tensor-core tile, the reference
        lora = dataclasses.replace(make_gemm_lora(case, 4), expand=False, max_rank=max_rank)
        y = fp8_matmul(case.x, weight, scale, None, w8a8=True, lora=lora)
        plain = fp8_matmul(case.x, weight, scale, None, w8a8=True)
        assert torch.equal(y.view(torch.int16), plain.view(torch.int16))
        torch.testing.assert_close(lora.xa.cpu()[active][:, :max_rank],
                                   lora.shrink(case.x).cpu()[active], rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(INTERPRET, reason="compiles: the interpreter has no compiler")
@pytest.mark.parametrize("w8a8", [False, True], ids=["weight-only", "w8a8"])
def test_the_launch_with_shrink_programs_compiles_for_hopper(w8a8: bool) -> None:
    """The decode launch with a LoRA shrink's programs in front of its tiles compiles for
    sm_90 (split K, swap-AB over TMA, the last program summing): the tiles keep their
    pipelined bulk tensor copies and wgmma, and the shrink's bf16 products are tensor-core
    MMAs too, stored in float32."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels.gemm.fp8_triton_kernel import _fp8_gemm_kernel

    x_type = "fp8e4nv" if w8a8 else "bf16"
    constexprs = dict(K=4096, K_PER_SPLIT=1024, BLOCK_M=64, BLOCK_N=64, BLOCK_K=256 if w8a8 else 128,
                      BLOCK_SCALES=False, SCALE_BN=1, SCALE_BK=1, DOT_F32=False, PARTIAL=True, EVEN_K=True,
                      SWAP_AB=True, TMA=True, WIDEN_PRMT=not w8a8, W8A8=w8a8, SPLIT_K=4, LAST_SUMS=True,
                      GATED=False, PDL=False, PREFETCH_K=0, TRIGGER=True, SHRINK_UNITS=96, SHRINK_COLS=24,
                      R=16, N_SLICES=3, A_ROWS=512, SHRINK_K=128, SHRINK_F32=False)
    if not w8a8:
        constexprs.update(xs_ptr=None)
    types = {"x_ptr": f"*{x_type}", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "xs_ptr": "*fp32",
             "out_ptr": "*fp32", "y_ptr": "*bf16", "counter_ptr": "*i32", "lx_ptr": "*bf16",
             "la_ptr": "*bf16", "lxa_ptr": "*fp32", "lscale_ptr": "*fp32", "ltable_ptr": "*i32",
             "x_desc": f"tensordesc<{x_type}[64,{constexprs['BLOCK_K']}]>",
             "w_desc": f"tensordesc<fp8e4nv[64,{constexprs['BLOCK_K']}]>"}
    aligned = ("x_ptr", "w_ptr", "s_ptr", "out_ptr", "y_ptr", "N", "stride_xm", "stride_wn", "stride_om",
               "stride_split", "lx_ptr", "la_ptr", "lxa_ptr", "stride_lxm", "stride_lxa")
    fn = _fp8_gemm_kernel
    signature = {p.name: "constexpr" if p.name in constexprs else types.get(p.name, "i32") for p in fn.params}
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=4, num_stages=3))
    ptx = compiled.asm["ptx"]
    assert "cp.async.bulk.tensor" in ptx and "wgmma.mma_async" in ptx
    assert "griddepcontrol.launch_dependents" in ptx
    shrink_mma = [line for line in ptx.splitlines() if ("mma.sync" in line or "wgmma.mma_async" in line)
                  and "bf16" in line]
    assert shrink_mma, "the shrink's products are not tensor-core MMAs"
