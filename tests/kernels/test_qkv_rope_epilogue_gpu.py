"""On a GPU, at real widths (Qwen3-8B: q/k norm; Qwen2.5-7B: q/k/v bias; Gemma-3-12B: q/k norm
(1 + w), heads of 256): q/k/v's decode GEMM with the bias, the q/k norm, RoPE and the KV-cache
write in its epilogue, launched by the node's dispatcher (DecodeGemm.qkv_rope: TMA and PDL on
Hopper, then pointer loads), writes what the unfused path writes: the plain launch (its
float32 product with the bias added and rounded once, as a biased matmul rounds), then the
RoPE kernel (kernels/rope).

Bit for bit with a bias alone, and for every value head. With a q/k norm the two launches sum
a head's squares in different orders (the GEMM's accumulator layout against the RoPE kernel's
flat one), so a row's float32 rstd may differ in its last bit and a query or key element by a
bf16 rounding step: checked to within 2 steps at the head's largest element, on at most 1% of
the elements (the interpreter's test, test_qkv_rope_epilogue.py, is bit for bit). Both are
also today's node path (cuBLAS's addmm for a biased q/k/v, then the RoPE kernel) within bf16
tolerance.

    python -m pytest -q -m gpu tests/kernels/test_qkv_rope_epilogue_gpu.py
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# hidden, q heads, kv heads, head_dim, bias, q/k norm, unit offset (Gemma's 1 + w)
SHAPES = {
    "qwen3-8b": (4096, 32, 8, 128, False, True, False),
    "qwen2.5-7b": (3584, 28, 4, 128, True, False, False),
    "gemma3-12b": (3840, 16, 8, 256, False, True, True),
}
PAGE, BLOCKS, POSITIONS = 16, 256, 32768


def make_case(shape: str, rows: int, seed: int):
    from kernels.rope.reference import QKNorm

    hidden, heads, kv_heads, head_dim, bias, norm, unit_offset = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    N = (heads + 2 * kv_heads) * head_dim
    x = torch.randn(rows, hidden, generator=gen, **bf16)
    w = (torch.randn(N, hidden, generator=gen, **bf16) / hidden ** 0.5).t()  # [in, out] view, as loaded
    b = torch.randn(N, generator=gen, **bf16) * 0.5 if bias else None
    qk = None
    if norm:
        centre = 0.0 if unit_offset else 1.0
        qk = QKNorm(*(centre + 0.3 * torch.randn(head_dim, generator=gen, **bf16) for _ in range(2)), 1e-6,
                    unit_offset)
    theta = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2, device="cuda").float() / head_dim))
    emb = torch.outer(torch.arange(POSITIONS, device="cuda").float(), theta).repeat(1, 2)
    positions = torch.randint(0, POSITIONS, (rows,), generator=gen, device="cuda")
    slots = torch.randperm(BLOCKS * PAGE, generator=gen, device="cuda")[:rows]
    return x, w, b, qk, emb.cos(), emb.sin(), positions, slots


def assert_within_rounding(got: torch.Tensor, want: torch.Tensor, heads_dim: int) -> None:
    """got [T, H, D] equals want but for bf16 rounding steps of a row's rstd: each element within
    2 steps at its head's largest element, at most 1% of elements differing."""
    got, want = got.float().reshape(-1, heads_dim), want.float().reshape(-1, heads_dim)
    scale = want.abs().amax(dim=1, keepdim=True)
    step = torch.exp2(torch.floor(torch.log2(scale.clamp(min=1e-30))) - 7)  # bf16's at the head's max
    diff = (got - want).abs()
    assert bool((diff <= 2 * step).all()), (diff / step).max().item()
    assert (diff > 0).float().mean().item() <= 0.01, (diff > 0).float().mean().item()


@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointer"])
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_fused_qkv_rope_is_the_gemm_then_rope_and_cache(shape: str, rows: int, tma: bool,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from kernels.gemm import DecodeGemm, RopeOut
    from kernels.gemm import triton_kernel
    from kernels.rope.triton_kernel import rope_and_cache_triton
    from kernels.tuning import DEFAULT_TUNING

    if tma and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs Hopper or newer")
    hidden, heads, kv_heads, head_dim, bias, norm, unit_offset = SHAPES[shape]
    x, w, b, qk, cos, sin, positions, slots = make_case(shape, rows, seed=rows)
    caches = [torch.full((BLOCKS, PAGE, kv_heads, head_dim), 7.0, device="cuda", dtype=torch.bfloat16)
              for _ in range(6)]
    q = torch.empty(rows, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    name = "decode_gemm_tma" if tma else "decode_gemm_triton"
    launches = []
    real = getattr(triton_kernel, name)
    monkeypatch.setattr(triton_kernel, name, lambda *a, **kw: launches.append(kw) or real(*a, **kw))
    gemm = DecodeGemm(torch.device("cuda"), DEFAULT_TUNING.replace(gemm_tma=tma))
    got = gemm.qkv_rope(x, w, RopeOut(q, caches[0], caches[1], cos, sin, positions, slots, heads, kv_heads,
                                      head_dim, bias=b, qk_norm=qk))
    assert got is q and len(launches) == 1, "the fused launch did not run"
    launch = {k: v for k, v in launches[0].items() if k != "rope"}
    assert (launch["block_n"] == head_dim // 2) if norm else (launch["block_n"] <= head_dim // 2)
    # The unfused path at the same tiling: the plain launch, the bias added to its float32
    # product and rounded once, then the RoPE kernel.
    if b is None:
        qkv = real(x, w, **launch)
    else:
        y32 = torch.empty(rows, w.shape[1], device="cuda", dtype=torch.float32)
        real(x, w, y32, **launch)
        qkv = (y32 + b.float()).to(torch.bfloat16)
    q_two = rope_and_cache_triton(qkv, None, cos, sin, positions, slots, caches[2], caches[3], heads,
                                  kv_heads, head_dim, qk_norm=qk)
    # Today's node path: cuBLAS's biased matmul, or the plain decode GEMM, then the RoPE kernel.
    today = torch.addmm(b, x, w) if b is not None else gemm(x, w, group="qkv")
    q_today = rope_and_cache_triton(today, None, cos, sin, positions, slots, caches[4], caches[5], heads,
                                    kv_heads, head_dim, qk_norm=qk)
    torch.cuda.synchronize()
    written = torch.zeros(BLOCKS * PAGE, dtype=torch.bool, device="cuda")
    written[slots] = True
    for cache in caches[:2]:
        assert bool((cache.view(BLOCKS * PAGE, -1)[~written] == 7.0).all()), "another slot written"
    assert torch.equal(caches[1], caches[3]), "values differ"
    if norm:
        assert_within_rounding(q, q_two, head_dim)
        assert_within_rounding(caches[0][slots // PAGE, slots % PAGE], caches[2][slots // PAGE, slots % PAGE],
                               head_dim)
    else:
        assert torch.equal(q, q_two) and torch.equal(caches[0], caches[2])
    for fused, unfused in ((q, q_today), (caches[0], caches[4]), (caches[1], caches[5])):
        torch.testing.assert_close(fused.float(), unfused.float(), rtol=2e-2,
                                   atol=2e-2 * unfused.float().abs().max().item())
