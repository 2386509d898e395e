"""q/k/v's decode GEMM with RoPE in its epilogue for the families with a q/k/v bias (Qwen2/2.5)
and a per-head q/k RMSNorm (Qwen3; Gemma 3's (1 + w)): the one launch writes the queries and
the cache slots that the unfused path (the GEMM, then kernels/rope's launch) writes.

The unfused path rounds q/k/v's float32 product to the model dtype once, the bias added first
(a biased q/k/v is cuBLAS's addmm). cuBLAS sums in another order than the decode GEMM, so the
oracle here is the decode GEMM's own float32 product (its plain launch into a float32
buffer), the bias added in float32 and rounded by a Triton cast (the interpreter truncates
where a GPU rounds to nearest), then the RoPE kernel: bit for bit, the q/k norm's sum of
squares included (both kernels' sums run in the interpreter's order; on a GPU they may not:
test_qkv_rope_epilogue_gpu.py). Against torch's addmm and the PyTorch reference: within the
dtype's tolerance.

The interpreter must be on before Triton is imported: the `interpreter`-marked test runs this
file's kernel cases in a child pytest with TRITON_INTERPRET=1 (as test_triton_interpreter.py
does for the other kernels); on a CUDA machine they also run natively. The host-side tests
(which tiling a launch takes) run in the plain suite.
"""
from __future__ import annotations

import functools
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
    reason="needs CUDA, or TRITON_INTERPRET=1 (test_qkv_rope_epilogue_in_interpreter runs it so)")
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton not installed")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CHILD_TIMEOUT = 300  # the cases took about 40 s on a shared two-core machine

# (bias, q/k norm, unit offset): the families' options.
FAMILIES = {"qwen2": (True, False, False), "qwen3": (False, True, False),
            "gemma3": (False, True, True), "bias-norm": (True, True, False)}


@pytest.mark.interpreter
@needs_triton
@pytest.mark.skipif(INTERPRET, reason="the interpreted child itself")
@pytest.mark.timeout(CHILD_TIMEOUT + 30)
def test_qkv_rope_epilogue_in_interpreter() -> None:
    out = run_interpreted("-k", "not in_interpreter", str(Path(__file__).resolve()), timeout=CHILD_TIMEOUT)
    assert " passed" in out and "skipped" not in out and "failed" not in out, out[-8000:]


@functools.cache
def _cast_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def cast(src, dst, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.load(src + offs, mask=offs < n).to(dst.dtype.element_ty), mask=offs < n)

    return cast


def triton_cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t rounded to dtype by Triton's cast, the kernels' rounding (the interpreter truncates
    where torch and a GPU round to nearest)."""
    src = t.contiguous()
    out = torch.empty(t.shape, dtype=dtype, device=t.device)
    _cast_kernel()[(-(-src.numel() // 1024),)](src, out, src.numel(), BLOCK=1024)
    return out


def make_case(rows: int, dt: torch.dtype, heads: int, kv_heads: int, head_dim: int, K: int,
              bias: bool, norm: bool, unit_offset: bool, seed: int, device: str = DEVICE,
              blocks: int = 16, page: int = 4):
    """Inputs of one layer's decode step: x, q/k/v's weight as an [in, out] view of [out, in],
    its bias, the q/k norm, RoPE tables, each row's position and distinct cache slot."""
    from kernels.rope.reference import QKNorm

    gen = torch.Generator().manual_seed(seed)
    N = (heads + 2 * kv_heads) * head_dim
    x = torch.randn(rows, K, generator=gen).to(dt).to(device)
    w = (torch.randn(N, K, generator=gen) / K ** 0.5).to(dt).to(device).t()
    b = (torch.randn(N, generator=gen) * 0.5).to(dt).to(device) if bias else None
    qk = None
    if norm:  # weights off neutral (Gemma's about 0, the others about 1)
        centre = 0.0 if unit_offset else 1.0
        weights = [(centre + 0.3 * torch.randn(head_dim, generator=gen)).to(dt).to(device) for _ in range(2)]
        qk = QKNorm(*weights, 1e-6, unit_offset)
    theta = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    emb = torch.outer(torch.arange(64).float(), theta).repeat(1, 2)
    cos, sin = emb.cos().to(device), emb.sin().to(device)
    positions = torch.randint(0, 64, (rows,), generator=gen).to(device)
    slots = torch.randperm(blocks * page, generator=gen)[:rows].to(device)
    return x, w, b, qk, cos, sin, positions, slots


def two_launches(x, w, b, qk, cos, sin, positions, slots, heads, kv_heads, head_dim, block_n, block_k,
                 k_cache, v_cache, gemm=None):
    """The unfused path at the decode GEMM's rounding: the plain launch's product (float32 where
    a bias is added, rounded once after it), then the RoPE kernel. gemm: the plain launch
    (decode_gemm_triton, or decode_gemm_tma)."""
    from kernels.gemm.triton_kernel import decode_gemm_triton
    from kernels.rope.triton_kernel import rope_and_cache_triton

    gemm = gemm or decode_gemm_triton
    if b is None:
        qkv = gemm(x, w, block_n=block_n, block_k=block_k)
    else:
        y32 = torch.empty(x.shape[0], w.shape[1], dtype=torch.float32, device=x.device)
        gemm(x, w, y32, block_n=block_n, block_k=block_k)
        qkv = triton_cast(y32 + b.float(), x.dtype)
    return rope_and_cache_triton(qkv, None, cos, sin, positions, slots, k_cache, v_cache, heads,
                                 kv_heads, head_dim, qk_norm=qk)


@needs_triton
@needs_triton_device
@pytest.mark.interpreter
@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize("launch,dtype", [(launch, dtype) for launch in ("pointer", "tma") for dtype in DTYPES
                                          if not (INTERPRET and launch == "tma" and dtype == "bf16")])
@pytest.mark.parametrize("family,head_dim,block_n", [
    pytest.param(f, d, n, id=f"{f}-d{d}-n{n}") for f, (_, norm, _) in FAMILIES.items()
    for d, n in ((32, 16), (64, 32), (64, 16)) if not norm or n == d // 2])  # a norm's: whole heads
def test_fused_launch_is_the_gemm_then_rope_and_cache(rows: int, dtype: str, family: str, head_dim: int,
                                                      block_n: int, launch: str) -> None:
    """The one launch (block_n columns of each half of a head a program; half a head with a
    q/k norm), with pointer or TMA loads, writes the queries and every cache slot, bit for
    bit, that the unfused path (the same kernel's plain launch, then the RoPE kernel) writes;
    both are the reference's (a biased addmm, the norm, RoPE in PyTorch) within the dtype's
    tolerance, and no other slot is touched. (The interpreter's tl.dot reads bf16 operands as
    raw integers, kernels/host.py: dot_f32, and the TMA kernel's tiles reach it unconverted:
    bf16 TMA launches run on a GPU only.)"""
    from kernels.gemm import triton_kernel
    from kernels.gemm.rope_out import RopeOut
    from kernels.rope.reference import rope_and_cache_ref

    bias, norm, unit_offset = FAMILIES[family]
    dt = DTYPES[dtype]
    heads, kv_heads, K = 4, 2, 64
    x, w, b, qk, cos, sin, positions, slots = make_case(rows, dt, heads, kv_heads, head_dim, K, bias, norm,
                                                        unit_offset, seed=rows + head_dim)
    caches = [torch.full((16, 4, kv_heads, head_dim), 7.0, dtype=dt, device=DEVICE) for _ in range(6)]
    q = torch.full((rows, heads, head_dim), 7.0, dtype=dt, device=DEVICE)
    out = RopeOut(q, caches[0], caches[1], cos, sin, positions, slots, heads, kv_heads, head_dim,
                  bias=b, qk_norm=qk)
    assert out.fits(x, w, block_n)
    gemm = triton_kernel.decode_gemm_tma if launch == "tma" else triton_kernel.decode_gemm_triton
    assert gemm(x, w, block_n=block_n, block_k=32, rope=out) is q
    q_two = two_launches(x, w, b, qk, cos, sin, positions, slots, heads, kv_heads, head_dim, block_n, 32,
                         caches[2], caches[3], gemm)
    assert torch.equal(q, q_two)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    # The reference: today's CPU path (torch's addmm with the bias, rope_and_cache_ref).
    qkv_ref = torch.addmm(b.float(), x.float(), w.float()) if b is not None else x.float() @ w.float()
    q_ref = rope_and_cache_ref(qkv_ref.to(dt), None, cos, sin, positions, slots, caches[4], caches[5], heads,
                               kv_heads, head_dim, qk_norm=qk)
    rel = 1e-5 if dt == torch.float32 else 2e-2
    for got, want in ((q, q_ref), (caches[0], caches[4]), (caches[1], caches[5])):
        torch.testing.assert_close(got.float(), want.float(), rtol=rel, atol=rel * want.float().abs().max().item())
    written = torch.zeros(16 * 4, dtype=torch.bool)
    written[slots.cpu()] = True
    for cache in caches[:2]:
        assert bool((cache.view(16 * 4, -1)[~written.to(cache.device)] == 7.0).all()), "another slot written"


@needs_triton
@needs_triton_device
@pytest.mark.interpreter
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gemma3"])
def test_dispatch_takes_the_fused_launch_with_whole_heads_for_a_norm(family: str, monkeypatch) -> None:
    """DecodeGemm.qkv_rope: a q/k norm's launch takes half a head of each half whatever q/k/v's
    tiling (here 32 columns: 16 of each half otherwise), a bias's the tiling's half; the
    result is the unfused path's. Where half a head is no power of two (96 / 2) a q/k norm
    cannot be fused: None, and the caller's two launches run."""
    from kernels.gemm import dispatch as gemm_dispatch
    from kernels.gemm import triton_kernel
    from kernels.gemm.rope_out import RopeOut
    from kernels.tuning import Tuning

    bias, norm, unit_offset = FAMILIES[family]
    gemm = gemm_dispatch.DecodeGemm(torch.device(DEVICE), Tuning(gemm_tilings={"qkv": (32, 32, 2)},
                                                                 gemm_tma=False, pdl=False))
    if DEVICE == "cpu":  # the decode GEMM serves CUDA tensors; the interpreter runs CPU ones
        monkeypatch.setattr(gemm_dispatch.DecodeGemm, "applies", lambda self, x, w, group=None: True)
        monkeypatch.setattr(gemm_dispatch.DecodeGemm, "serves", lambda self, group: True)
    tiles = []
    real = triton_kernel.decode_gemm_triton
    monkeypatch.setattr(triton_kernel, "decode_gemm_triton",
                        lambda *a, **kw: tiles.append(kw["block_n"]) or real(*a, **kw))
    heads, kv_heads, rows = 4, 2, 3
    for head_dim in (64, 96):
        dt = torch.bfloat16
        x, w, b, qk, cos, sin, positions, slots = make_case(rows, dt, heads, kv_heads, head_dim, 64, bias, norm,
                                                            unit_offset, seed=head_dim)
        caches = [torch.zeros(16, 4, kv_heads, head_dim, dtype=dt, device=DEVICE) for _ in range(4)]
        q = torch.empty(rows, heads, head_dim, dtype=dt, device=DEVICE)
        got = gemm.qkv_rope(x, w, RopeOut(q, caches[0], caches[1], cos, sin, positions, slots, heads,
                                          kv_heads, head_dim, bias=b, qk_norm=qk))
        if norm and head_dim == 96:
            assert got is None
            continue
        assert got is q and tiles[-1] == (head_dim // 2 if norm else 16)
        q_two = two_launches(x, w, b, qk, cos, sin, positions, slots, heads, kv_heads, head_dim, 32, 32,
                             caches[2], caches[3])
        assert torch.equal(q, q_two) and torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_whole_head_tiling_fits_registers_and_shared_memory() -> None:
    """A q/k norm's launch: half a head of columns from each half (a power of two of at least
    16); K tiles cut until a stage holds no more weight than q/k/v's tiling's, stages added to
    keep the pipeline's bytes, within shared memory; 8 warps for tiles over 2048 values. None
    for a head whose half is no power of two (Qwen3's tiny 24, Phi-3's 96) or under 16."""
    from kernels.gemm.shapes import SHARED_MEMORY, whole_head_tiling, whole_head_warps

    assert whole_head_tiling((32, 256, 4), 128, 2) == (64, 64, 8)     # Qwen3-8B, bf16
    assert whole_head_tiling((32, 256, 4), 256, 2) == (128, 64, 5)    # Gemma 3 (heads of 256)
    assert whole_head_tiling((32, 256, 4), 128, 4) == (64, 64, 4)     # float32
    assert whole_head_tiling((64, 512, 2), 128, 2) == (64, 256, 2)
    for head_dim in (24, 96, 16):
        assert whole_head_tiling((32, 256, 4), head_dim, 2) is None
    for tiling in ((16, 128, 4), (32, 256, 4), (64, 512, 2), (128, 512, 8)):
        for head_dim, esize in ((64, 2), (128, 2), (256, 2), (128, 4), (256, 4)):
            half, block_k, stages = whole_head_tiling(tiling, head_dim, esize)
            assert half == head_dim // 2 and block_k >= 64 and stages >= 2
            assert stages * (64 + head_dim) * block_k * esize <= SHARED_MEMORY
    assert [whole_head_warps(128, rows) for rows in (1, 16, 17, 64)] == [4, 4, 8, 8]
    assert [whole_head_warps(256, rows) for rows in (1, 16)] == [8, 8]


def test_rope_out_fits_bias_and_norm_only_of_its_widths() -> None:
    """RopeOut.fits: a bias of q/k/v's width in x's dtype; a q/k norm only with a tile of half
    a head and weights of a head's width."""
    from kernels.gemm.rope_out import RopeOut
    from kernels.rope.reference import QKNorm

    heads, kv_heads, head_dim, rows = 4, 2, 64, 3
    N = (heads + 2 * kv_heads) * head_dim
    x = torch.empty(rows, 128, dtype=torch.bfloat16)
    w = torch.empty(N, 128, dtype=torch.bfloat16).t()

    def out(**kw) -> RopeOut:
        caches = [torch.empty(4, 16, kv_heads, head_dim, dtype=torch.bfloat16) for _ in range(2)]
        table = torch.empty(64, head_dim)
        return RopeOut(torch.empty(rows, heads, head_dim, dtype=torch.bfloat16), *caches, table, table,
                       torch.zeros(rows, dtype=torch.long), torch.zeros(rows, dtype=torch.long), heads,
                       kv_heads, head_dim, **kw)

    norm = QKNorm(torch.ones(head_dim, dtype=torch.bfloat16), torch.ones(head_dim, dtype=torch.bfloat16), 1e-6)
    assert out(bias=torch.zeros(N, dtype=torch.bfloat16)).fits(x, w, 16)
    assert not out(bias=torch.zeros(N - 1, dtype=torch.bfloat16)).fits(x, w, 16)
    assert not out(bias=torch.zeros(N)).fits(x, w, 16)  # float32 bias of a bf16 model
    assert out(qk_norm=norm).fits(x, w, 32) and not out(qk_norm=norm).fits(x, w, 16)
    half_norm = QKNorm(norm.q_weight[:32], norm.k_weight[:32], 1e-6)
    assert not out(qk_norm=half_norm).fits(x, w, 32)
    assert out().switches() == dict(BIAS=False, QK_NORM=False, UNIT_OFFSET=False)
    gemma = QKNorm(norm.q_weight, norm.k_weight, 1e-6, unit_offset=True)
    assert out(qk_norm=gemma).switches() == dict(BIAS=False, QK_NORM=True, UNIT_OFFSET=True)
