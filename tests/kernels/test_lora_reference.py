"""The PyTorch LoRA reference (CPU serving path, oracle of the Triton kernels) against a
per-token loop, and the batch metadata it runs on."""
from __future__ import annotations

import pytest
import torch

from kernel_cases import make_lora_case, naive_expand, naive_shrink, random_slots
from kernels.lora import add_lora, lora_expand, lora_shrink
from kernels.lora.meta import LoraBatchMeta
from kernels.lora.reference import lora_expand_ref, lora_shrink_ref

QKV = [576, 192, 192]       # SmolLM2-like fused q/k/v slices
GATE_UP = [1536, 1536]


def _tol(dtype: torch.dtype) -> dict:
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)


# ---------------------------------------------------------------------------------------------
# LoraBatchMeta

def test_meta_groups_tokens_by_slot_stably_and_skips_no_adapter() -> None:
    meta = LoraBatchMeta.build([3, -1, 0, 3, 3, -1, 0, 7], "cpu")
    assert meta.token_slots.tolist() == [3, -1, 0, 3, 3, -1, 0, 7]
    assert meta.sorted_token_ids.tolist() == [2, 6, 0, 3, 4, 7]
    assert meta.segment_slots.tolist() == [0, 3, 7]
    assert meta.segment_starts.tolist() == [0, 2, 5]
    assert meta.segment_lens.tolist() == [2, 3, 1]
    assert (meta.num_segments, meta.max_segment_len, meta.num_active_tokens) == (3, 3, 6)
    assert meta.segments == ((0, 0, 2, -1), (3, 2, 3, -1), (7, 5, 1, 7))
    for t in (meta.token_slots, meta.sorted_token_ids, meta.segment_slots,
              meta.segment_starts, meta.segment_lens):
        assert t.dtype == torch.int32


def test_meta_is_one_device_buffer() -> None:
    meta = LoraBatchMeta.build(torch.tensor([1, 1, -1, 0]), torch.device("cpu"))
    ptr = meta.token_slots.untyped_storage().data_ptr()
    for t in (meta.sorted_token_ids, meta.segment_slots, meta.segment_starts, meta.segment_lens):
        assert t.untyped_storage().data_ptr() == ptr
    assert meta.segments == ((0, 0, 1, 3), (1, 1, 2, 0))  # contiguous runs keep their start


def test_meta_views_start_16_byte_aligned_whatever_the_counts() -> None:
    """Triton specialises kernels on pointer alignment: views at offsets that follow a step's
    token and segment counts would compile new kernel variants in the middle of serving."""
    gen = torch.Generator().manual_seed(3)
    for tokens in range(1, 40):
        slots = torch.randint(-1, 9, (tokens,), generator=gen)
        meta = LoraBatchMeta.build(slots, torch.device("cpu"))
        for t in (meta.token_slots, meta.sorted_token_ids, meta.segment_slots,
                  meta.segment_starts, meta.segment_lens):
            assert t.data_ptr() % 16 == 0, (tokens, meta)
        assert meta.token_slots.tolist() == slots.tolist()
        assert meta.segment_lens.sum().item() == meta.num_active_tokens == meta.sorted_token_ids.numel()


@pytest.mark.parametrize("slots", [[], [-1, -1, -1]])
def test_meta_without_active_tokens(slots: list[int]) -> None:
    meta = LoraBatchMeta.build(slots, "cpu")
    assert (meta.num_segments, meta.max_segment_len, meta.num_active_tokens) == (0, 0, 0)
    assert meta.token_slots.numel() == len(slots) and meta.sorted_token_ids.numel() == 0


# ---------------------------------------------------------------------------------------------
# shrink / expand against the per-token loop

CASES = {
    # name: (token_slots, num_slots, max_rank, ranks, h_in, outs)
    "qkv_mixed_ranks": ([2, -1, 0, 2, 2, -1, 0, 1, 3, 3, 0], 5, 16, [16, 8, 4, 1, 12], 576, QKV),
    "gate_up_empty_segments": ([5, 5, 1, -1, 5, 1], 8, 8, None, 576, GATE_UP),
    "single_adapter_contiguous": ([4] * 9, 6, 16, None, 96, [64]),
    "single_token_decode": ([1], 2, 32, [32, 7], 128, [128, 32, 32]),
    "all_no_adapter": ([-1] * 5, 3, 16, None, 64, [64, 16]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_reference_matches_per_token_loop(name: str, dtype: torch.dtype) -> None:
    slots, S, R, ranks, h_in, outs = CASES[name]
    case = make_lora_case(token_slots=slots, num_slots=S, max_rank=R, ranks=ranks, h_in=h_in,
                          outs=outs, dtype=dtype, y_pad=3, seed=len(name))
    h = lora_shrink_ref(case.x, case.a, case.meta, case.scaling, case.slots)
    assert h.shape == (len(outs), len(slots), R) and h.dtype == torch.float32
    torch.testing.assert_close(h, naive_shrink(case), rtol=1e-5, atol=1e-5)

    y = case.y.clone()
    lora_expand_ref(h, case.b, case.meta, y, case.offsets, case.slots)
    expected = naive_expand(case, h)
    torch.testing.assert_close(y, expected, **_tol(dtype))
    inactive = [t for t, s in enumerate(slots) if s < 0]
    assert torch.equal(y[inactive], case.y[inactive])  # slot -1 untouched, bit for bit
    assert torch.equal(y[:, sum(outs):], case.y[:, sum(outs):])  # columns past the slices too
    active = [t for t, s in enumerate(slots) if s >= 0]
    if active:
        assert not torch.equal(y[active], case.y[active])


def test_random_batches_match_per_token_loop() -> None:
    gen = torch.Generator().manual_seed(1)
    for trial in range(12):
        S = int(torch.randint(1, 6, (1,), generator=gen))
        R = int(torch.randint(1, 20, (1,), generator=gen))
        ranks = torch.randint(0, R + 1, (S,), generator=gen).tolist()
        used = torch.randperm(S, generator=gen)[: int(torch.randint(0, S + 1, (1,), generator=gen))]
        T = int(torch.randint(0, 30, (1,), generator=gen))
        slots = random_slots(gen, T, S, used.tolist())
        outs = torch.randint(1, 70, (int(torch.randint(1, 4, (1,), generator=gen)),),
                             generator=gen).tolist()
        case = make_lora_case(token_slots=slots, num_slots=S, max_rank=R, ranks=ranks,
                              h_in=int(torch.randint(1, 50, (1,), generator=gen)), outs=outs,
                              seed=trial)
        h = lora_shrink_ref(case.x, case.a, case.meta, case.scaling, case.slots)
        torch.testing.assert_close(h, naive_shrink(case), rtol=1e-5, atol=1e-5)
        y = case.y.clone()
        lora_expand_ref(h, case.b, case.meta, y, case.offsets, case.slots)
        torch.testing.assert_close(y, naive_expand(case, h), rtol=1e-5, atol=1e-5)


def test_a_slot_reads_only_its_own_rows() -> None:
    """A slot's run is as long as its rank; every other row belongs to other adapters. With
    every row but slot 1's NaN, its tokens' h and delta stay finite and unchanged, and h is
    zero past its rank."""
    case = make_lora_case(token_slots=[1, 1, 1], num_slots=2, max_rank=8, ranks=[8, 3],
                          h_in=32, outs=[16, 8])
    h = lora_shrink_ref(case.x, case.a, case.meta, case.scaling, case.slots)
    y = case.y.clone()
    lora_expand_ref(h, case.b, case.meta, y, case.offsets, case.slots)
    assert torch.count_nonzero(h[:, :, 3:]) == 0 and torch.count_nonzero(h[:, :, :3]) == 2 * 3 * 3
    for i in range(2):
        mine = torch.zeros(case.a[i].shape[0], dtype=torch.bool)
        first = int(case.rows[i, 1])
        mine[first:first + 3] = True
        case.a[i][~mine] = float("nan")
        case.b[i][~mine] = float("nan")
    h2 = lora_shrink_ref(case.x, case.a, case.meta, case.scaling, case.slots)
    y2 = case.y.clone()
    lora_expand_ref(h2, case.b, case.meta, y2, case.offsets, case.slots)
    assert torch.equal(h2, h) and torch.equal(y2, y)


def test_add_lora_on_cpu_uses_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kernels.dispatch.interpreting", lambda: False)  # as outside the interpreter
    case = make_lora_case(token_slots=[1, -1, 0, 1], num_slots=2, max_rank=4, h_in=24,
                          outs=[10, 6])
    y = case.y.clone()
    add_lora(case.x, y, case.a, case.b, case.meta, case.scaling, case.offsets, case.slots)
    torch.testing.assert_close(y, naive_expand(case, naive_shrink(case)), rtol=1e-5, atol=1e-5)
    h = lora_shrink(case.x, case.a, case.meta, case.scaling, case.slots)
    y2 = case.y.clone()
    lora_expand(h, case.b, case.meta, y2, case.offsets, case.slots)
    assert torch.equal(y, y2)


def test_add_lora_without_active_tokens_is_a_no_op() -> None:
    case = make_lora_case(token_slots=[-1, -1], num_slots=2, max_rank=4, h_in=8, outs=[8])
    y = case.y.clone()
    add_lora(case.x, y, case.a, case.b, case.meta, case.scaling, case.offsets, case.slots)
    assert torch.equal(y, case.y)
