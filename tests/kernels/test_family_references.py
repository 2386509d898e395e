"""The PyTorch references of the families' quirks (the CPU path and the Triton kernels'
oracles) against transformers' own modules, bit for bit in float32 and bfloat16."""
from __future__ import annotations

import pytest
import torch

from kernels.activation import silu_mul
from kernels.norm import add_rms_norm, rms_norm
from kernels.rope import QKNorm, rope_and_cache_ref

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


@DTYPES
@pytest.mark.parametrize("family", ["gemma2", "gemma3", "qwen3"])
def test_rms_norm_is_the_family_norm(family: str, dtype: torch.dtype) -> None:
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    cls = {"gemma2": Gemma2RMSNorm, "gemma3": Gemma3RMSNorm, "qwen3": Qwen3RMSNorm}[family]
    torch.manual_seed(0)
    hf = cls(96, eps=1e-6).to(dtype)
    with torch.no_grad():
        hf.weight.normal_(0.0, 0.5)
    x = (torch.randn(7, 96) * 3).to(dtype)
    ours = rms_norm(x, hf.weight.detach(), 1e-6, unit_offset=family.startswith("gemma"))
    assert torch.equal(ours, hf(x).detach())


@DTYPES
def test_gelu_tanh_gating_is_gemmas_mlp(dtype: torch.dtype) -> None:
    from transformers.activations import ACT2FN

    torch.manual_seed(1)
    gate_up = (torch.randn(5, 2 * 48) * 2).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = ACT2FN["gelu_pytorch_tanh"](gate) * up
    assert torch.equal(silu_mul(gate_up, activation="gelu_tanh"), expected)
    assert not torch.equal(silu_mul(gate_up), expected)


@DTYPES
def test_out_norm_is_gemmas_norms_around_a_sublayer(dtype: torch.dtype) -> None:
    """Gemma: hidden + post_norm(sublayer out), then pre_norm of that for the next sublayer."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    torch.manual_seed(2)
    post, pre = Gemma2RMSNorm(64).to(dtype), Gemma2RMSNorm(64).to(dtype)
    with torch.no_grad():
        post.weight.normal_(0.0, 0.5)
        pre.weight.normal_(0.0, 0.5)
    hidden, out = torch.randn(4, 64).to(dtype), torch.randn(4, 64).to(dtype)
    new_hidden, x = add_rms_norm(hidden, out, pre.weight.detach(), 1e-6, unit_offset=True,
                                 out_norm=post.weight.detach())
    expected_hidden = hidden + post(out).detach()
    assert torch.equal(new_hidden, expected_hidden)
    assert torch.equal(x, pre(expected_hidden).detach())


@DTYPES
def test_qk_norm_before_rope_is_qwen3_attention(dtype: torch.dtype) -> None:
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

    torch.manual_seed(3)
    T, hq, hkv, d = 6, 4, 2, 16
    q_norm, k_norm = Qwen3RMSNorm(d, 1e-6).to(dtype), Qwen3RMSNorm(d, 1e-6).to(dtype)
    with torch.no_grad():
        q_norm.weight.normal_(1.0, 0.3)
        k_norm.weight.normal_(1.0, 0.3)
    qkv = torch.randn(T, (hq + 2 * hkv) * d).to(dtype)
    positions = torch.arange(3, 3 + T)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(32).float(), inv)
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    k_cache = torch.zeros(4, 8, hkv, d, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.arange(T) + 5
    norm = QKNorm(q_norm.weight.detach(), k_norm.weight.detach(), 1e-6)
    q = rope_and_cache_ref(qkv, None, cos, sin, positions, slots, k_cache, v_cache, hq, hkv, d, qk_norm=norm)

    q_hf, k_hf, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q_hf = q_norm(q_hf.view(T, hq, d)).detach().transpose(0, 1)[None]
    k_hf = k_norm(k_hf.view(T, hkv, d)).detach().transpose(0, 1)[None]
    q_hf, k_hf = apply_rotary_pos_emb(q_hf.float(), k_hf.float(), cos[positions][None], sin[positions][None])
    torch.testing.assert_close(q.float(), q_hf[0].transpose(0, 1).to(dtype).float(), rtol=0, atol=0)
    page = k_cache.shape[1]
    stored = k_cache[slots // page, slots % page]
    torch.testing.assert_close(stored.float(), k_hf[0].transpose(0, 1).to(dtype).float(), rtol=0, atol=0)
