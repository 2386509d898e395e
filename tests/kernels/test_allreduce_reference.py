"""The fused all-reduce's reference (kernels/allreduce/reference.py) is the node's unfused ops:
the ranks' partial rows summed in float32 in rank order, then the residual add and RMSNorm of
kernels/norm, with a bias after the sum and Gemma's norms."""
from __future__ import annotations

import pytest
import torch

from kernels.allreduce import PeerLayout, all_reduce_add_rms_norm
from kernels.norm.reference import add_rms_norm


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("options", ["plain", "bias", "gemma"])
def test_the_reference_is_the_sum_then_the_unfused_add_and_norm(world: int, options: str) -> None:
    gen = torch.Generator().manual_seed(world)
    partials = [torch.randn(5, 48, generator=gen) for _ in range(world)]
    residual, weight = torch.randn(5, 48, generator=gen), 1 + 0.1 * torch.randn(48, generator=gen)
    kwargs = {"bias": torch.randn(48, generator=gen)} if options == "bias" else {}
    norm_kwargs = {"unit_offset": True, "out_norm": torch.randn(48, generator=gen)} if options == "gemma" else {}
    new, normed = all_reduce_add_rms_norm(partials, residual, weight, 1e-6, **kwargs, **norm_kwargs)

    total = torch.zeros(5, 48)
    for part in partials:  # in rank order
        total = total + part
    if options == "bias":
        total = total + kwargs["bias"]
    new_ops, normed_ops = add_rms_norm(residual, total, weight, 1e-6, **norm_kwargs)
    assert torch.equal(new, new_ops) and torch.equal(normed, normed_ops)
    if options != "gemma":  # the add and the norm, written out
        by_hand = residual + total
        assert torch.equal(new, by_hand)
        torch.testing.assert_close(normed, weight * by_hand * torch.rsqrt(by_hand.pow(2).mean(-1, keepdim=True) + 1e-6))


def test_bfloat16_partials_are_summed_in_float32_and_rounded_once() -> None:
    """Rounding after each addition would lose the small partials: 256 + 0.75 + 0.75 is 256
    added pairwise in bfloat16 (its step there is 2), 257.5 in float32, rounded once to 258."""
    partials = [torch.full((1, 8), v, dtype=torch.bfloat16) for v in (256.0, 0.75, 0.75)]
    residual, weight = torch.zeros(1, 8, dtype=torch.bfloat16), torch.ones(8, dtype=torch.bfloat16)
    new, _ = all_reduce_add_rms_norm(partials, residual, weight, 1e-6)
    assert new.unique().tolist() == [258.0]
    assert (partials[0] + partials[1] + partials[2]).unique().tolist() == [256.0]


def test_a_layout_holds_a_decode_step_and_refuses_what_it_cannot() -> None:
    """An 8B decode step (64 rows of 4096 bf16: 0.5 MB) fits a 1 MB slot; more rows than flags,
    more bytes than a slot, or no rows do not."""
    layout = PeerLayout(world=4, max_rows=128, slot_bytes=1 << 20)
    assert layout.fits(64, 4096, 2) and layout.fits(128, 4096, 2)
    assert not layout.fits(129, 64, 2) and not layout.fits(64, 8192, 4) and not layout.fits(0, 4096, 2)
    assert layout.flags_bytes == 128 * 4 * 4 and layout.nbytes == layout.flags_bytes + 2 * (1 << 20)
    assert PeerLayout(3, 5, 1024).flags_bytes == 256  # rounded up: the rows start aligned
