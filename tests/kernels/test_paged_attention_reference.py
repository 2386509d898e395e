"""The PyTorch paged attention reference (CPU path, oracle of the Triton kernel) against a
per-token, per-head loop over the block table."""
from __future__ import annotations

import pytest
import torch

from kernel_cases import make_attention_case, naive_attention
from kernels.attention import paged_attention
from kernels.attention.reference import paged_attention_ref

CASES = {
    # name: (q_lens, seq_lens, Hq, Hkv, D, page)
    "mixed_prefill_decode_gqa": ([5, 1, 1, 3], [13, 20, 1, 3], 4, 2, 16, 4),
    "decode_only_mqa": ([1, 1, 1], [7, 16, 33], 6, 1, 8, 8),
    "chunked_prefill_mha": ([9, 2], [9, 30], 2, 2, 16, 16),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_reference_matches_per_token_loop(name: str, dtype: torch.dtype) -> None:
    q_lens, seq_lens, hq, hkv, d, page = CASES[name]
    case = make_attention_case(q_lens=q_lens, seq_lens=seq_lens, num_heads=hq, num_kv_heads=hkv,
                               head_dim=d, page=page, dtype=dtype, seed=len(name))
    out = paged_attention_ref(*case.args())
    assert out.shape == case.q.shape and out.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out, naive_attention(case), **tol)


def test_dispatcher_uses_reference_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kernels.dispatch.interpreting", lambda: False)  # as outside the interpreter
    case = make_attention_case(q_lens=[3, 1], seq_lens=[3, 9], num_heads=4, num_kv_heads=2,
                               head_dim=8, page=4)
    assert torch.equal(paged_attention(*case.args()), paged_attention_ref(*case.args()))


def test_non_finite_kv_outside_a_sequence_does_not_reach_its_output() -> None:
    """NaN in every cache slot outside sequence 0's context (as after another request's
    forward went non-finite): sequence 0's output is unchanged and finite."""
    case = make_attention_case(q_lens=[1, 1], seq_lens=[5, 9], num_heads=4, num_kv_heads=2,
                               head_dim=8, page=4)
    clean = paged_attention_ref(*case.args())
    table = case.block_tables[0].long()
    own = torch.zeros(case.k_cache.shape[:2], dtype=torch.bool)
    for pos in range(5):
        own[table[pos // 4], pos % 4] = True
    case.k_cache[~own] = float("nan")
    case.v_cache[~own] = float("nan")
    out = paged_attention_ref(*case.args())
    assert torch.isfinite(out[0]).all()
    torch.testing.assert_close(out[0], clean[0])
    assert not torch.isfinite(out[1]).all()  # sequence 1's own context holds NaN: it shows


@pytest.mark.parametrize("window, softcap", [(5, 0.0), (0, 2.0), (6, 1.5), (1, 0.0), (64, 0.0)])
@pytest.mark.parametrize("name", list(CASES))
def test_reference_window_and_softcap_match_per_token_loop(name: str, window: int, softcap: float) -> None:
    """A sliding window (keys within the last `window` positions, the query's own included)
    and soft-capped scores, as transformers' Mistral and Gemma 2 compute them."""
    q_lens, seq_lens, hq, hkv, d, page = CASES[name]
    case = make_attention_case(q_lens=q_lens, seq_lens=seq_lens, num_heads=hq, num_kv_heads=hkv,
                               head_dim=d, page=page, seed=len(name))
    out = paged_attention_ref(*case.args(), window=window, softcap=softcap)
    torch.testing.assert_close(out, naive_attention(case, window, softcap), rtol=1e-5, atol=1e-5)
    if window < max(seq_lens) or softcap:
        assert not torch.allclose(out, paged_attention_ref(*case.args()), atol=1e-3)


def test_non_finite_kv_before_every_window_does_not_reach_the_output() -> None:
    """Blocks a windowed request gave back (wholly before its first query's window) may hold
    another request's NaN: its output is unchanged."""
    window, page = 6, 4
    case = make_attention_case(q_lens=[2, 1], seq_lens=[17, 9], num_heads=4, num_kv_heads=2,
                               head_dim=8, page=page)
    clean = paged_attention_ref(*case.args(), window=window)
    first_visible = 17 - 2 - window + 1  # position 10: blocks 0 and 1 are wholly before it
    for block in range(first_visible // page):
        b = case.block_tables[0, block].long()
        case.k_cache[b] = float("nan")
        case.v_cache[b] = float("nan")
    out = paged_attention_ref(*case.args(), window=window)
    torch.testing.assert_close(out[:2], clean[:2])
    assert torch.isfinite(out[:2]).all()
