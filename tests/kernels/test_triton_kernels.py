"""Triton kernels against the PyTorch reference on random small shapes.

Runs where Triton can execute: natively on CUDA, or on CPU tensors in Triton's interpreter.
The interpreter must be switched on before Triton is imported, so on a CPU-only machine this
module is skipped in the main pytest process and run by test_triton_interpreter.py in a
subprocess with TRITON_INTERPRET=1 (run it directly with the same env var to debug).
"""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernel_cases import (assert_one_variant_per_tiling, grouped_slots, make_attention_case, make_gemm_lora,
                          make_lora_case, naive_delta, naive_expand, random_slots,
                          record_specialisations)

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
pytestmark = pytest.mark.skipif(
    not INTERPRET and not torch.cuda.is_available(),
    reason="needs CUDA, or TRITON_INTERPRET=1 (test_triton_interpreter.py runs it that way)")

EXAMPLES = 60 if INTERPRET else 100
HYPO = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def assert_close_scaled(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """Relative tolerance, with an absolute floor scaled to the tensor's magnitude."""
    rel = 1e-4 if dtype == torch.float32 else 2e-2
    floor = rel * max(1.0, expected.float().abs().max().item()) if expected.numel() else rel
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), rtol=rel, atol=floor)


def check_lora(case, dtype: torch.dtype, split_k: int | None,
               slice_off: list[tuple[int, int]] = ()) -> None:
    """Shrink, expand and the fused two-launch add against the reference. slice_off: (slice,
    slot) pairs the per-slice ranks switch off: the kernels must skip them even though the
    slot's rows there hold data."""
    from kernels.lora.reference import lora_expand_ref, lora_shrink_ref
    from kernels.lora.triton_kernel import add_lora_triton, lora_expand_triton, lora_shrink_triton

    per_slice = case.ranks.repeat(len(case.a), 1)
    for i, slot in slice_off:
        per_slice[i, slot] = 0
    slots = case.slots_with(per_slice)
    h_ref = lora_shrink_ref(case.x, case.a, case.meta, case.scaling, slots)
    h = lora_shrink_triton(case.x, case.a, case.meta, case.scaling, slots, split_k=split_k)
    assert h.shape == h_ref.shape and h.dtype == torch.float32
    assert_close_scaled(h, h_ref, dtype)
    inactive = [t for t, s in enumerate(case.token_slots) if s < 0]
    assert torch.count_nonzero(h[:, inactive]) == 0

    y_ref, y = case.y.clone(), case.y.clone()
    lora_expand_ref(h_ref, case.b, case.meta, y_ref, case.offsets, slots)
    assert_close_scaled(y_ref, naive_expand(case, h_ref.cpu(), slots), dtype)  # the oracle's oracle
    lora_expand_triton(h_ref, case.b, case.meta, y, case.offsets, slots)
    assert_close_scaled(y, y_ref, dtype)
    assert torch.equal(y[inactive], case.y[inactive])  # slot -1 rows untouched, bit for bit
    width = sum(b.shape[1] for b in case.b)
    assert torch.equal(y[:, width:], case.y[:, width:])  # and columns past the slices

    fused = case.y.clone()  # the serving path: split partials straight into the expand
    add_lora_triton(case.x, fused, case.a, case.b, case.meta, case.scaling, case.offsets, slots)
    assert_close_scaled(fused, y_ref, dtype)
    assert torch.equal(fused[inactive], case.y[inactive])
    assert torch.equal(fused[:, width:], case.y[:, width:])

    # The side-stream path: the delta written (not added) into a zeroed float32 buffer, the
    # partial sums in a static workspace; twice, as two layers of one step write it.
    from kernels.lora import lora_workspace_numel
    delta_ref = torch.zeros(case.y.shape, dtype=torch.float32, device=case.y.device)
    lora_expand_ref(h_ref, case.b, case.meta, delta_ref, case.offsets, slots, accumulate=False)
    workspace = torch.full((lora_workspace_numel(case.x.shape[0], len(case.a), case.max_rank),),
                           float("nan"), device=case.y.device)
    delta = torch.zeros_like(delta_ref)
    for _ in range(2):
        add_lora_triton(case.x, delta, case.a, case.b, case.meta, case.scaling, case.offsets, slots,
                        accumulate=False, workspace=workspace)
        assert_close_scaled(delta, delta_ref, dtype)
        assert torch.count_nonzero(delta[inactive]) == 0
        assert torch.count_nonzero(delta[:, width:]) == 0


def check_lora_packed(case, dtype: torch.dtype, slice_ranks: list[list[int]],
                      pad_segments: int = 0, lead: int = 1) -> None:
    """The segment-table path (rows grouped by slot, as the decode graphs order them): slot,
    rows and per-slice (rank, first arena row) come from one table row; `lead` other
    modules' pairs sit before this projection's (rank_col), filled with values that would be
    wrong here. The kernels get no per-slot tables of ranks or rows (they must use the table)."""
    from kernels.lora import lora_workspace_numel
    from kernels.lora.meta import MODULE_COLUMNS, SEGMENT_TABLE_RANKS, LoraBatchMeta
    from kernels.lora.reference import lora_expand_ref, lora_shrink_ref
    from kernels.lora.rows import SlotRows
    from kernels.lora.triton_kernel import add_lora_triton

    n_slices = len(case.a)
    slots = case.slots_with(slice_ranks)
    # Tables the kernels must not read on this path: ranks and rows that are all wrong.
    decoy = SlotRows(torch.full_like(slots.ranks, 1), torch.zeros_like(slots.rows), case.max_rank)
    meta = LoraBatchMeta.build(case.token_slots, case.x.device)
    if pad_segments:
        meta = meta.padded_for_graph(meta.num_segments + pad_segments, len(case.token_slots))
    meta = meta.with_segment_table(case.module_rows(slots, lead=lead, tail=1), meta.num_segments)
    rank_col = SEGMENT_TABLE_RANKS + MODULE_COLUMNS * lead
    y_ref = case.y.clone()
    lora_expand_ref(lora_shrink_ref(case.x, case.a, meta, case.scaling, slots), case.b, meta, y_ref,
                    case.offsets, slots)
    inactive = [t for t, s in enumerate(case.token_slots) if s < 0]
    y = case.y.clone()
    add_lora_triton(case.x, y, case.a, case.b, meta, case.scaling, case.offsets, decoy,
                    rank_col=rank_col)
    assert_close_scaled(y, y_ref, dtype)
    assert torch.equal(y[inactive], case.y[inactive])

    delta_ref = torch.zeros(case.y.shape, dtype=torch.float32, device=case.y.device)
    lora_expand_ref(lora_shrink_ref(case.x, case.a, meta, case.scaling, slots), case.b, meta, delta_ref,
                    case.offsets, slots, accumulate=False)
    workspace = torch.full((lora_workspace_numel(case.x.shape[0], n_slices, case.max_rank),),
                           float("nan"), device=case.y.device)
    delta = torch.zeros_like(delta_ref)
    for _ in range(2):  # two layers of one step write the same delta buffer
        add_lora_triton(case.x, delta, case.a, case.b, meta, case.scaling, case.offsets, decoy,
                        accumulate=False, workspace=workspace, rank_col=rank_col)
        assert_close_scaled(delta, delta_ref, dtype)
        assert torch.count_nonzero(delta[inactive]) == 0


# ---------------------------------------------------------------------------------------------
# LoRA shrink / expand

@st.composite
def lora_problems(draw):
    S = draw(st.integers(1, 5))
    R = draw(st.integers(1, 40))
    ranks = draw(st.lists(st.integers(0, R), min_size=S, max_size=S))
    used = draw(st.lists(st.integers(0, S - 1), unique=True, max_size=S))
    T = draw(st.integers(0, 40))
    seed = draw(st.integers(0, 2**16))
    slots = random_slots(torch.Generator().manual_seed(seed), T, S, used,
                         none_fraction=draw(st.sampled_from([0.0, 0.3])))
    outs = draw(st.lists(st.integers(1, 150), min_size=1, max_size=3))
    return dict(token_slots=slots, num_slots=S, max_rank=R, ranks=ranks,
                h_in=draw(st.integers(1, 160)), outs=outs, seed=seed,
                y_pad=draw(st.integers(0, 5)))


@HYPO
@given(problem=lora_problems(), dtype=st.sampled_from(list(DTYPES)), switch_off=st.booleans(),
       split_k=st.sampled_from([None, 1, 2, 5]), data=st.data())
def test_lora_random_shapes(problem: dict, dtype: str, switch_off: bool,
                            split_k: int | None, data) -> None:
    case = make_lora_case(**problem, dtype=DTYPES[dtype], device=DEVICE)
    pairs = [(i, s) for i in range(len(case.a)) for s in range(problem["num_slots"])]
    slice_off = data.draw(st.lists(st.sampled_from(pairs), unique=True, max_size=4)) if switch_off else []
    check_lora(case, DTYPES[dtype], split_k, slice_off)


@HYPO
@given(problem=lora_problems(), dtype=st.sampled_from(list(DTYPES)), pad=st.sampled_from([0, 3]),
       data=st.data())
def test_lora_segment_table_random_shapes(problem: dict, dtype: str, pad: int, data) -> None:
    """Rows grouped by slot (slot -1 rows first, as DecodeGraphs.ordered sorts them), segments
    and per-slice ranks read from the segment table, padded with empty segments or not."""
    problem["token_slots"] = sorted(problem["token_slots"])
    case = make_lora_case(**problem, dtype=DTYPES[dtype], device=DEVICE)
    S = problem["num_slots"]
    slice_ranks = [[data.draw(st.integers(0, problem["ranks"][s])) for s in range(S)]
                   for _ in case.a]
    check_lora_packed(case, DTYPES[dtype], slice_ranks, pad_segments=pad)


def test_segment_table_refuses_rows_that_are_not_contiguous() -> None:
    from kernels.lora.meta import LoraBatchMeta

    meta = LoraBatchMeta.build([0, 1, 0], DEVICE)
    with pytest.raises(ValueError, match="contiguous"):
        meta.with_segment_table([[4, 0], [4, 4]])


def graph_meta(token_slots: list[int], buckets: int, device: str):
    """Metadata as a decode CUDA graph sees it: empty segments up to the bucket, every
    segment sized for the whole batch."""
    from kernels.lora.meta import LoraBatchMeta

    return LoraBatchMeta.build(token_slots, device).padded_for_graph(buckets, len(token_slots))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("slots,buckets", [
    ([3, 0, 3, 1, 0, 2, 3, 1, 0, 0, 2, 1, 3, 3, 0, 1, 2, 2, 1, 0], 4),  # 4 adapters, 5 rows each
    ([1] * 37, 1),                                                       # one adapter, > 2 row tiles
    ([2, 0, -1, 2, 0, 1], 8),                                            # padded buckets, empty segments
], ids=["four_adapters", "one_adapter_many_rows", "empty_buckets"])
def test_lora_decode_graph_metadata(slots: list[int], buckets: int, dtype: str) -> None:
    case = make_lora_case(token_slots=slots, num_slots=4, max_rank=16, ranks=[16, 8, 16, 4],
                          h_in=200, outs=[96, 32, 32], dtype=DTYPES[dtype], device=DEVICE, y_pad=3)
    case.meta = graph_meta(slots, buckets, DEVICE)
    check_lora(case, DTYPES[dtype], split_k=None, slice_off=[(1, 0), (2, 3)])


@pytest.mark.parametrize("per_segment", [True, False], ids=["per_segment", "per_row_tile"])
def test_lora_every_tiling_matches_reference(per_segment: bool) -> None:
    """Both row strategies, odd K/N tiles and split counts give the reference's result."""
    from kernels.lora.reference import lora_expand_ref, lora_shrink_ref
    from kernels.lora.triton_kernel import LoraTiling, lora_expand_triton, lora_shrink_partials

    slots = [1, 0, 1, 1, -1, 2, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2]
    case = make_lora_case(token_slots=slots, num_slots=3, max_rank=8, h_in=100, outs=[70, 20],
                          device=DEVICE)
    case.meta = graph_meta(slots, 4, DEVICE)
    y_ref = case.y.clone()
    lora_expand_ref(lora_shrink_ref(case.x, case.a, case.meta, case.scaling, case.slots), case.b,
                    case.meta, y_ref, case.offsets, case.slots)
    for block_k, block_n, per_sm, n_span in ((16, 32, 1, 0), (64, 16, 8, 48)):
        tiling = LoraTiling(16, per_segment, block_k=block_k, block_n=block_n,
                            programs_per_sm=per_sm, n_span=n_span)
        y = case.y.clone()
        h = lora_shrink_partials(case.x, case.a, case.meta, case.scaling, case.slots, zero=False,
                                 tiling=tiling)
        lora_expand_triton(h, case.b, case.meta, y, case.offsets, case.slots, tiling=tiling)
        assert_close_scaled(y, y_ref, torch.float32)


def test_lora_prefill_sized_step_uses_row_tiles() -> None:
    """More tokens than the decode tiling takes: 64-row tiles, one per program."""
    from kernels.lora.triton_kernel import DECODE_SHAPED_TOKENS, choose_tiling

    slots = [0] * 150 + [1] * 130 + [-1] * 5
    case = make_lora_case(token_slots=slots, num_slots=2, max_rank=8, h_in=48, outs=[40, 24],
                          device=DEVICE)
    assert case.meta.num_active_tokens > DECODE_SHAPED_TOKENS
    tiling = choose_tiling(case.meta, 8, 40)
    assert (tiling.block_m, tiling.per_segment) == (64, False)
    check_lora(case, torch.float32, split_k=None, slice_off=[(1, 1)])


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("outs,h_in", [([576, 192, 192], 576), ([1536, 1536], 576)],
                         ids=["qkv", "gate_up"])
def test_lora_fused_slices_mixed_ranks_empty_segments(outs: list[int], h_in: int,
                                                      dtype: str) -> None:
    # Slots 1 and 4 hold adapters but no token of this batch uses them (empty segments).
    slots = [2, -1, 0, 2, 2, -1, 0, 3, 3, 0, 2, -1]
    case = make_lora_case(token_slots=slots, num_slots=5, max_rank=16, ranks=[16, 8, 4, 1, 12],
                          h_in=h_in, outs=outs, dtype=DTYPES[dtype], device=DEVICE, y_pad=7)
    check_lora(case, DTYPES[dtype], split_k=None)
    check_lora(case, DTYPES[dtype], split_k=3)


@pytest.mark.parametrize("slots", [[], [-1, -1, -1]], ids=["empty_batch", "no_adapter"])
def test_lora_without_active_tokens(slots: list[int]) -> None:
    case = make_lora_case(token_slots=slots, num_slots=2, max_rank=8, h_in=32, outs=[16, 8],
                          device=DEVICE)
    check_lora(case, torch.float32, split_k=None)


def test_lora_unaligned_slice_buffers_and_strided_views() -> None:
    """Slices that are views at odd element offsets of one buffer (no 16-element alignment
    between them), x and y that are column views of wider tensors."""
    from kernels.lora.meta import LoraBatchMeta

    case = make_lora_case(token_slots=[1, 0, -1, 1], num_slots=2, max_rank=8, h_in=40,
                          outs=[24, 8], device=DEVICE)
    flat = torch.zeros(3 + sum(t.numel() + 1 for t in case.a + case.b), device=DEVICE)
    views, at = [], 3
    for t in case.a + case.b:
        v = flat[at:at + t.numel()].view(t.shape)
        v.copy_(t)
        views.append(v)
        at += t.numel() + 1  # odd gaps: relative offsets are not multiples of 16
    case.a, case.b = views[:2], views[2:]
    wide_x = torch.randn(4, 50, device=DEVICE)
    wide_x[:, 5:45] = case.x
    case.x = wide_x[:, 5:45]
    wide_y = torch.randn(4, 40, device=DEVICE)
    wide_y[:, 2:34] = case.y
    case.y = wide_y[:, 2:34]
    case.meta = LoraBatchMeta.build(case.token_slots, DEVICE)
    check_lora(case, torch.float32, split_k=None)


def test_lora_kernels_compile_no_new_variant_as_the_batch_changes(monkeypatch) -> None:
    """Under Poisson arrivals each step mixes sequences and adapters differently; a launch
    argument that Triton specialises and that follows the mix (rows per segment, H_in splits,
    metadata pointers) compiles a new kernel variant in the middle of serving, for seconds
    while every request waits. Only the constexpr tilings may differ between steps."""
    from kernels.lora import triton_kernel as lora_triton
    from kernels.lora.triton_kernel import add_lora_triton

    keys = record_specialisations(monkeypatch, lora_triton, {
        "_lora_shrink_kernel": lora_triton._SHRINK_DYNAMIC,
        "_lora_expand_kernel": lora_triton._EXPAND_DYNAMIC})
    gen = torch.Generator().manual_seed(11)
    sizes = [1, 2, 3, 5, 16, 17, 31, 64, 100, 257, 300]
    for step, tokens in enumerate(sizes + [int(t) for t in torch.randint(1, 300, (6,), generator=gen)]):
        used = [int(s) for s in torch.randperm(8, generator=gen)[:1 + step % 8]]
        slots = random_slots(gen, tokens, 8, used)
        if not any(s >= 0 for s in slots):
            slots[0] = used[0]
        case = make_lora_case(token_slots=slots, num_slots=8, max_rank=16, h_in=64, outs=[64, 32, 32],
                              device=DEVICE, seed=step)
        add_lora_triton(case.x, case.y, case.a, case.b, case.meta, case.scaling, case.offsets, case.slots)
    assert_one_variant_per_tiling(keys, {"_lora_shrink_kernel", "_lora_expand_kernel"})


def test_dispatcher_picks_triton_where_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA, or on CPU tensors in Triton's interpreter, the dispatcher runs the kernel."""
    import kernels.lora as lora
    import kernels.lora.triton_kernel as lora_triton
    from kernels.lora.reference import lora_expand_ref, lora_shrink_ref

    calls = []
    real = lora_triton.add_lora_triton
    monkeypatch.setattr(lora_triton, "add_lora_triton",
                        lambda *a, **k: calls.append("add") or real(*a, **k))
    case = make_lora_case(token_slots=[0, -1, 1, 0], num_slots=2, max_rank=8, h_in=32,
                          outs=[16, 8], device=DEVICE)
    y = case.y.clone()
    lora.add_lora(case.x, y, case.a, case.b, case.meta, case.scaling, case.offsets, case.slots)
    assert calls == ["add"]
    y_ref = case.y.clone()
    lora_expand_ref(lora_shrink_ref(case.x, case.a, case.meta, case.scaling, case.slots), case.b,
                    case.meta, y_ref, case.offsets, case.slots)
    assert_close_scaled(y, y_ref, torch.float32)


# ---------------------------------------------------------------------------------------------
# Paged attention

def check_attention(case, dtype: torch.dtype, window: int = 0, softcap: float = 0.0, **knobs) -> None:
    from kernels.attention.reference import paged_attention_ref
    from kernels.attention.triton_kernel import paged_attention_triton_impl

    out = paged_attention_triton_impl(*case.args(), window=window, softcap=softcap, **knobs)
    ref = paged_attention_ref(*case.args(), window=window, softcap=softcap)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    rel = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float().cpu(), ref.float().cpu(), rtol=rel, atol=rel)


ATTENTION_CASES = {
    # name: (q_lens, seq_lens, Hq, Hkv, D, page)
    "mixed_prefill_decode_gqa": ([5, 1, 1, 3], [13, 20, 1, 3], 4, 2, 32, 8),
    "long_prefill_many_query_tiles": ([40, 1], [45, 37], 4, 1, 16, 16),
    "decode_only_group3_headdim24": ([1, 1, 1], [7, 50, 33], 6, 2, 24, 4),
    "fresh_prefills_mha_page5": ([6, 11], [6, 11], 2, 2, 16, 5),
    "decode_long_contexts_many_splits": ([1, 1], [700, 1300], 4, 2, 32, 16),
}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("num_splits", [1, 3, 40])
@pytest.mark.parametrize("name", list(ATTENTION_CASES))
@pytest.mark.parametrize("head_major", [False, True], ids=["token_major", "head_major"])
def test_paged_attention_cases(name: str, num_splits: int, dtype: str, head_major: bool) -> None:
    q_lens, seq_lens, hq, hkv, d, page = ATTENTION_CASES[name]
    case = make_attention_case(q_lens=q_lens, seq_lens=seq_lens, num_heads=hq, num_kv_heads=hkv,
                               head_dim=d, page=page, dtype=DTYPES[dtype], device=DEVICE,
                               seed=len(name), head_major=head_major)
    check_attention(case, DTYPES[dtype], num_splits=num_splits, block_n=16)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window, softcap", [(7, 0.0), (0, 1.5), (20, 2.0), (1, 0.0)])
@pytest.mark.parametrize("name", ["mixed_prefill_decode_gqa", "long_prefill_many_query_tiles",
                                  "decode_long_contexts_many_splits"])
def test_paged_attention_window_and_softcap(name: str, window: int, softcap: float, num_splits: int,
                                            dtype: str) -> None:
    """Sliding windows (Mistral, Gemma's local layers) and soft-capped scores (Gemma 2), with
    the blocks wholly behind each sequence's first window holding NaN (given back and reused
    by another request): never read."""
    q_lens, seq_lens, hq, hkv, d, page = ATTENTION_CASES[name]
    case = make_attention_case(q_lens=q_lens, seq_lens=seq_lens, num_heads=hq, num_kv_heads=hkv,
                               head_dim=d, page=page, dtype=DTYPES[dtype], device=DEVICE, seed=len(name))
    if window:
        for b, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
            behind = max(seq_len - q_len - window + 1, 0) // page
            for j in range(behind):
                block = case.block_tables[b, j].long()
                case.k_cache[block] = float("nan")
                case.v_cache[block] = float("nan")
    check_attention(case, DTYPES[dtype], window=window, softcap=softcap, num_splits=num_splits, block_n=16)


@st.composite
def attention_problems(draw):
    batch = draw(st.integers(1, 4))
    q_lens = draw(st.lists(st.sampled_from([1, 1, 2, 5, 17]), min_size=batch, max_size=batch))
    ctx = draw(st.lists(st.integers(0, 40), min_size=batch, max_size=batch))
    hkv = draw(st.integers(1, 2))
    return dict(q_lens=q_lens, seq_lens=[q + c for q, c in zip(q_lens, ctx)],
                num_heads=hkv * draw(st.sampled_from([1, 2, 3, 4])), num_kv_heads=hkv,
                head_dim=draw(st.sampled_from([8, 16, 32])), page=draw(st.sampled_from([3, 4, 16])),
                seed=draw(st.integers(0, 2**16)))


@HYPO
@given(problem=attention_problems(), dtype=st.sampled_from(list(DTYPES)),
       num_splits=st.sampled_from([None, 1, 2]), block_n=st.sampled_from([16, 32]))
def test_paged_attention_random(problem: dict, dtype: str, num_splits: int | None,
                                block_n: int) -> None:
    case = make_attention_case(**problem, dtype=DTYPES[dtype], device=DEVICE)
    check_attention(case, DTYPES[dtype], num_splits=num_splits, block_n=block_n)


def test_attention_compiles_no_new_variant_as_the_batch_changes(monkeypatch) -> None:
    """Split counts, block-table widths and token counts change from step to step; only the
    constexpr tilings (query tile, split or not) may give the kernels new variants."""
    from kernels.attention import triton_kernel as pat

    keys = record_specialisations(monkeypatch, pat, {
        "_paged_attention_kernel": pat._ATTENTION_DYNAMIC, "_merge_splits_kernel": pat._MERGE_DYNAMIC})
    gen = torch.Generator().manual_seed(5)
    for step in range(12):
        batch = 1 + step % 5
        seq_lens = [int(n) for n in torch.randint(1, 120, (batch,), generator=gen)]
        q_lens = [1] * batch  # decode-shaped: the query tile stays the same
        case = make_attention_case(q_lens=q_lens, seq_lens=seq_lens, num_heads=4, num_kv_heads=2,
                                   head_dim=16, page=4, device=DEVICE, seed=step)
        for splits in (1, 2 + step % 3, 5 + step % 4, 9 + 3 * step):  # from 2 to 40 splits
            check_attention(case, torch.float32, num_splits=splits)
    assert_one_variant_per_tiling(keys, {"_paged_attention_kernel", "_merge_splits_kernel"})
    # The split count is not a tiling: split or not; the merge compiles once for every count.
    assert len(keys["_paged_attention_kernel"]) == 2, list(keys["_paged_attention_kernel"])
    assert len(keys["_merge_splits_kernel"]) == 1, list(keys["_merge_splits_kernel"])


def test_attention_dispatcher_picks_triton_where_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    import kernels.attention.triton_kernel as pat
    from kernels.attention import paged_attention

    calls = []
    real = pat.paged_attention_triton
    monkeypatch.setattr(pat, "paged_attention_triton",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    case = make_attention_case(q_lens=[3, 1], seq_lens=[3, 9], num_heads=4, num_kv_heads=2,
                               head_dim=16, page=4, device=DEVICE)
    out = paged_attention(*case.args())
    assert calls == [1]
    from kernels.attention.reference import paged_attention_ref
    torch.testing.assert_close(out.cpu(), paged_attention_ref(*case.args()).cpu(),
                               rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# RoPE + KV-cache write

def random_lora_delta(gen: torch.Generator, tokens: int, outs: list[int], dtype: torch.dtype,
                      slots: int = 3, rank: int = 8, splits: int = 2):
    """A LoraDelta as a decode step hands one on: random slots per row (some -1), random ranks
    per (slice, slot) (some 0), each slot's run of B rows in an arena of rank rows with a row
    of NaN after every run and NaN in the sums past each rank and on rows without an adapter:
    an op that reads a row past a rank, or sums it should not, spreads NaN."""
    from kernels.lora.delta import LoraDelta

    token_slots = torch.randint(-1, slots, (tokens,), generator=gen, dtype=torch.int32)
    ranks = torch.randint(0, rank + 1, (len(outs), slots), generator=gen)
    rows_total = sum(rank + 1 for _ in range(slots))
    b_all = torch.full((rows_total, sum(outs)), float("nan"))
    firsts = torch.zeros(len(outs), slots, dtype=torch.int32)
    col = 0
    for i, n in enumerate(outs):
        order, at = torch.randperm(slots, generator=gen).tolist(), 0
        for slot in order:
            r = int(ranks[i, slot])
            firsts[i, slot] = at
            b_all[at:at + r, col:col + n] = torch.randn(r, n, generator=gen) * 0.2
            at += r + 1  # a NaN row after the run
        col += n
    token_rows = torch.zeros(tokens, 2 * len(outs), dtype=torch.int32)
    partials = torch.randn(splits, len(outs), tokens, rank, generator=gen)
    for t, slot in enumerate(token_slots.tolist()):
        for i in range(len(outs)):
            live = int(ranks[i, slot]) if slot >= 0 else 0
            token_rows[t, 2 * i:2 * i + 2] = torch.tensor([live, int(firsts[i, slot]) if slot >= 0 else 0])
            partials[:, i, t, live:] = float("nan")
    b_all = b_all.to(dtype).to(DEVICE)
    offsets = [sum(outs[:i]) for i in range(len(outs))]
    b = tuple(b_all[:, off:off + n] for off, n in zip(offsets, outs))
    return LoraDelta(partials.to(DEVICE), b, token_rows.to(DEVICE))


def maybe_expanded(delta, expanded: bool):
    """The delta as the side stream hands it on when it expanded it already (expanded=True):
    the kernels then add LoraDelta.expanded instead of expanding the partial sums."""
    if delta is None or not expanded:
        return delta
    return dataclasses.replace(delta, expanded=delta.dense().contiguous())


@HYPO
@given(tokens=st.integers(1, 9), kv_heads=st.integers(1, 3), group=st.sampled_from([1, 2, 3, 4]),
       head_dim=st.sampled_from([8, 24, 64]), with_delta=st.booleans(), expanded=st.booleans(),
       dtype=st.sampled_from(list(DTYPES)), seed=st.integers(0, 2**16), head_major=st.booleans(),
       qk_norm=st.sampled_from(["none", "qwen3", "gemma3"]))
def test_rope_and_cache_matches_reference(tokens: int, kv_heads: int, group: int, head_dim: int,
                                          with_delta: bool, expanded: bool, dtype: str, seed: int,
                                          head_major: bool, qk_norm: str) -> None:
    """Rotated queries and the cache slots written equal the reference, the other slots are
    untouched, with and without a LoRA delta to expand, with each head normalised first where
    the family does (Qwen3's w, Gemma 3's 1 + w); q, k and v are column views of a wider
    projection output, as the fused q/k/v matmul gives them."""
    from kernels.rope.reference import QKNorm, rope_and_cache_ref
    from kernels.rope.triton_kernel import rope_and_cache_triton

    gen = torch.Generator().manual_seed(seed)
    heads, dt = kv_heads * group, DTYPES[dtype]
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(tokens, width + 5, generator=gen).to(dt)[:, :width].to(DEVICE)
    outs = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    delta = maybe_expanded(random_lora_delta(gen, tokens, outs, dt) if with_delta else None, expanded)
    positions = torch.randint(0, 50, (tokens,), generator=gen).to(DEVICE)
    theta = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(64).float(), theta)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(DEVICE), emb.sin().to(DEVICE)
    blocks, page = 6, 4
    slots = torch.randperm(blocks * page, generator=gen)[:tokens].to(DEVICE)
    caches = [torch.randn(blocks, page, kv_heads, head_dim, generator=gen).to(dt).to(DEVICE)
              for _ in range(2)]
    if head_major:  # stored [blocks, Hkv, page, D], seen through transposed views (KVCache)
        caches = [c.transpose(1, 2).contiguous().transpose(1, 2) for c in caches]
    ref_caches = [c.clone() for c in caches]
    norm = None
    if qk_norm != "none":
        gemma = qk_norm == "gemma3"
        weights = [((0.0 if gemma else 1.0) + 0.3 * torch.randn(head_dim, generator=gen)).to(dt).to(DEVICE)
                   for _ in range(2)]
        norm = QKNorm(*weights, 1e-6, unit_offset=gemma)
    q = rope_and_cache_triton(qkv, delta, cos, sin, positions, slots, *caches, heads, kv_heads, head_dim,
                              qk_norm=norm)
    q_ref = rope_and_cache_ref(qkv, delta, cos, sin, positions, slots, *ref_caches, heads, kv_heads,
                               head_dim, qk_norm=norm)
    rel = 1e-5 if dt == torch.float32 else 2e-2  # bf16: a rounding step apart at most
    torch.testing.assert_close(q.float().cpu(), q_ref.float().cpu(), rtol=rel, atol=rel)
    for got, want in zip(caches, ref_caches):
        torch.testing.assert_close(got.float().cpu(), want.float().cpu(), rtol=rel, atol=rel)
    untouched = torch.ones(blocks * page, dtype=torch.bool)
    untouched[slots.cpu()] = False
    for got, before in zip(caches, [c.clone() for c in ref_caches]):
        flat_got = got.reshape(blocks * page, -1).cpu()[untouched]
        assert torch.equal(flat_got, before.reshape(blocks * page, -1).cpu()[untouched])


# ---------------------------------------------------------------------------------------------
# Residual add + RMSNorm, SiLU * up, with a LoRA delta expanded in

@HYPO
@given(tokens=st.integers(1, 9), hidden=st.sampled_from([24, 64, 200, 2304]),
       with_delta=st.booleans(), expanded=st.booleans(), dtype=st.sampled_from(list(DTYPES)),
       seed=st.integers(0, 2**16))
def test_add_rms_norm_matches_reference(tokens: int, hidden: int, with_delta: bool,
                                        expanded: bool, dtype: str, seed: int) -> None:
    """The new residual stream and the normalised rows equal the reference on the expanded
    delta (a row wider than one tile takes several passes: 2304 > 2048)."""
    from kernels.norm.reference import add_rms_norm
    from kernels.norm.triton_kernel import add_rms_norm_triton

    gen = torch.Generator().manual_seed(seed)
    dt = DTYPES[dtype]
    res = torch.randn(tokens, hidden, generator=gen).to(dt).to(DEVICE)
    out = torch.randn(tokens, hidden + 3, generator=gen).to(dt)[:, :hidden].to(DEVICE)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dt).to(DEVICE)
    delta = maybe_expanded(random_lora_delta(gen, tokens, [hidden], dt) if with_delta else None,
                           expanded)
    new, x = add_rms_norm_triton(res, out, weight, 1e-5, delta)
    new_ref, x_ref = add_rms_norm(res, out, weight, 1e-5, delta.dense() if delta else None)
    assert not new.isnan().any() and not x.isnan().any()
    assert_close_scaled(new, new_ref, dt)
    assert_close_scaled(x, x_ref, dt)


@HYPO
@given(tokens=st.integers(1, 9), hidden=st.sampled_from([24, 200, 2304]), with_delta=st.booleans(),
       expanded=st.booleans(), split=st.booleans(), dtype=st.sampled_from(list(DTYPES)),
       seed=st.integers(0, 2**16))
def test_gemma_norms_around_a_sublayer_match_reference(tokens: int, hidden: int, with_delta: bool,
                                                       expanded: bool, split: bool, dtype: str,
                                                       seed: int) -> None:
    """Gemma's add + norm: the sublayer's output (with its delta) normalised by its own (1 + w)
    norm, added, and the sum normalised by (1 + w); a ColumnSplit the delta carries is not
    taken (the output's norm needs its whole row first)."""
    from kernels.lora.delta import ColumnSplit
    from kernels.norm.reference import add_rms_norm
    from kernels.norm.triton_kernel import add_rms_norm_triton

    gen = torch.Generator().manual_seed(seed)
    dt = DTYPES[dtype]
    res = torch.randn(tokens, hidden, generator=gen).to(dt).to(DEVICE)
    out = (3 * torch.randn(tokens, hidden + 3, generator=gen)).to(dt)[:, :hidden].to(DEVICE)
    weight = (0.3 * torch.randn(hidden, generator=gen)).to(dt).to(DEVICE)
    out_norm = (0.3 * torch.randn(hidden, generator=gen)).to(dt).to(DEVICE)
    delta = maybe_expanded(random_lora_delta(gen, tokens, [hidden], dt) if with_delta else None, expanded)
    if delta is not None and split:
        delta = dataclasses.replace(delta, column_split=ColumnSplit.allocate(16, 16, hidden, torch.device(DEVICE)))
    new, x = add_rms_norm_triton(res, out, weight, 1e-6, delta, unit_offset=True, out_norm=out_norm)
    new_ref, x_ref = add_rms_norm(res, out, weight, 1e-6, delta.dense() if delta else None,
                                  unit_offset=True, out_norm=out_norm)
    assert not new.isnan().any() and not x.isnan().any()
    assert_close_scaled(new, new_ref, dt)
    assert_close_scaled(x, x_ref, dt)


@HYPO
@given(tokens=st.integers(1, 9), hidden=st.sampled_from([24, 64, 200, 2304]),
       block=st.sampled_from([8, 16, 64, 512]), expanded=st.booleans(),
       dtype=st.sampled_from(list(DTYPES)), seed=st.integers(0, 2**16))
def test_add_rms_norm_split_over_columns_matches_reference(tokens: int, hidden: int, block: int,
                                                           expanded: bool, dtype: str, seed: int) -> None:
    """Rows spread over programs of `block` columns (a ColumnSplit) give the reference's
    results, the same new residual stream as one program a row (bit for bit in bf16, and with
    the delta expanded; float32 sums over the rank round apart on an H200), and leave every
    row's arrival count at zero, so the next launch on the same scratch (or a graph replay)
    is right too: three launches on one scratch, with new inputs for the last."""
    from kernels.lora.delta import ColumnSplit
    from kernels.norm.reference import add_rms_norm
    from kernels.norm.triton_kernel import add_rms_norm_triton

    gen = torch.Generator().manual_seed(seed)
    dt = DTYPES[dtype]
    split = ColumnSplit.allocate(block, 16, 4096, torch.device(DEVICE))
    for launch in range(3):
        if launch != 1:  # launch 1 repeats launch 0's inputs
            res = torch.randn(tokens, hidden, generator=gen).to(dt).to(DEVICE)
            out = torch.randn(tokens, hidden + 3, generator=gen).to(dt)[:, :hidden].to(DEVICE)
            weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dt).to(DEVICE)
            delta = maybe_expanded(random_lora_delta(gen, tokens, [hidden], dt), expanded)
        split_delta = dataclasses.replace(delta, column_split=split)
        new, x = add_rms_norm_triton(res, out, weight, 1e-5, split_delta)
        assert int(split.arrivals.count_nonzero()) == 0, split.arrivals
        new_row, _ = add_rms_norm_triton(res, out, weight, 1e-5, delta)
        new_ref, x_ref = add_rms_norm(res, out, weight, 1e-5, delta.dense())
        assert not x.isnan().any()
        if dt == torch.bfloat16 or expanded:
            assert torch.equal(new, new_row)
        else:  # float32 rows keep the rank sum's last bits, whose order each kernel's layout picks
            assert_close_scaled(new, new_row, dt)
        assert_close_scaled(new, new_ref, dt)
        assert_close_scaled(x, x_ref, dt)


def test_column_split_fits_only_what_its_scratch_holds() -> None:
    """Launches wider or taller than the scratch fall back to one program a row."""
    from kernels.lora.delta import ColumnSplit

    split = ColumnSplit.allocate(64, 8, 2048, torch.device(DEVICE))
    assert split.sums.shape == (8, 32) and split.arrivals.dtype == torch.int32
    assert split.fits(8, 2048) and split.fits(1, 2000)
    assert not split.fits(9, 2048) and not split.fits(8, 2049)
    with pytest.raises(AssertionError):
        ColumnSplit.allocate(48, 8, 2048, torch.device(DEVICE))


@HYPO
@given(tokens=st.integers(1, 9), inter=st.sampled_from([24, 64, 200, 1536]),
       with_delta=st.booleans(), expanded=st.booleans(), dtype=st.sampled_from(list(DTYPES)),
       seed=st.integers(0, 2**16), activation=st.sampled_from(["silu", "gelu_tanh"]))
def test_silu_mul_matches_reference(tokens: int, inter: int, with_delta: bool, expanded: bool,
                                    dtype: str, seed: int, activation: str) -> None:
    """act(gate) * up, SiLU or Gemma's GeLU-tanh, equals the reference on the expanded gate/up
    delta (1536 columns take two programs per row)."""
    from kernels.activation.reference import silu_mul
    from kernels.activation.triton_kernel import silu_mul_triton

    gen = torch.Generator().manual_seed(seed)
    dt = DTYPES[dtype]
    gate_up = (2 * torch.randn(tokens, 2 * inter + 5, generator=gen)).to(dt)[:, :2 * inter].to(DEVICE)
    delta = maybe_expanded(random_lora_delta(gen, tokens, [inter, inter], dt) if with_delta else None,
                           expanded)
    act = silu_mul_triton(gate_up, delta, activation=activation)
    ref = silu_mul(gate_up, delta.dense() if delta else None, activation)
    assert not act.isnan().any()
    assert_close_scaled(act, ref, dt)  # bf16: g + delta may round a step apart, times up


def assert_quantized_rows(rows, plain: torch.Tensor, dtype: torch.dtype) -> None:
    """rows (Fp8Rows) hold about `plain`, the kernel's output without quantizing (a compiled
    variant of its own: float32 sums may round apart), and their own e4m3 copy and scales
    exactly as quantize_rows makes them."""
    from kernels.gemm.fp8 import Fp8Rows, quantize_rows

    assert isinstance(rows, Fp8Rows)
    assert_close_scaled(rows.x, plain, dtype)
    q_ref, s_ref = quantize_rows(rows.x)
    assert torch.equal(rows.scale.cpu(), s_ref.reshape(-1).cpu())
    assert torch.equal(rows.fp8.view(torch.uint8).cpu(), q_ref.view(torch.uint8).cpu())


@settings(max_examples=12 if INTERPRET else 60, deadline=None, derandomize=True, database=None)
@given(tokens=st.integers(1, 5), hidden=st.sampled_from([24, 200, 2304]), with_delta=st.booleans(),
       expanded=st.booleans(), split=st.booleans(), dtype=st.sampled_from(list(DTYPES)),
       seed=st.integers(0, 2**16))
def test_add_rms_norm_writes_its_rows_in_e4m3_too(tokens: int, hidden: int, with_delta: bool,
                                                  expanded: bool, split: bool, dtype: str, seed: int) -> None:
    """quantize=True: the residual stream and normed rows, plus their e4m3 copy and row
    scales equal to quantize_rows of those rows, one program a row or a ColumnSplit's many
    (two launches on one scratch: its arrival counts come back to zero)."""
    from kernels.lora.delta import ColumnSplit
    from kernels.norm.triton_kernel import add_rms_norm_triton

    gen = torch.Generator().manual_seed(seed)
    dt = DTYPES[dtype]
    res = (4 * torch.randn(tokens, hidden, generator=gen)).to(dt).to(DEVICE)
    out = torch.randn(tokens, hidden, generator=gen).to(dt).to(DEVICE)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dt).to(DEVICE)
    delta = maybe_expanded(random_lora_delta(gen, tokens, [hidden], dt) if with_delta or split else None,
                           expanded)
    if split:
        delta = dataclasses.replace(delta, column_split=ColumnSplit.allocate(64, 16, 4096, torch.device(DEVICE)))
    new_plain, x_plain = add_rms_norm_triton(res, out, weight, 1e-5, delta)
    for _ in range(2 if split else 1):
        new, rows = add_rms_norm_triton(res, out, weight, 1e-5, delta, quantize=True)
        assert_close_scaled(new, new_plain, dt)
        assert_quantized_rows(rows, x_plain, dt)
        if split:
            assert int(delta.column_split.arrivals.count_nonzero()) == 0


@settings(max_examples=12 if INTERPRET else 60, deadline=None, derandomize=True, database=None)
@given(tokens=st.integers(1, 5), hidden=st.sampled_from([24, 200, 2304]), with_delta=st.booleans(),
       expanded=st.booleans(), split=st.booleans(), out_norm=st.booleans(), quantize=st.booleans(),
       k_splits=st.sampled_from([2, 3]), seed=st.integers(0, 2**16))
def test_add_rms_norm_sums_a_split_gemms_partials_as_its_sum_launch(
        tokens: int, hidden: int, with_delta: bool, expanded: bool, split: bool, out_norm: bool,
        quantize: bool, k_splits: int, seed: int) -> None:
    """Given a K-split FP8 GEMM's float32 partials (SplitSums), the add + norm writes, bit for
    bit, what it writes after the GEMM's sum launch: one program a row or a ColumnSplit's many,
    with a LoRA delta or not, Gemma's output norm, the e4m3 copy."""
    from kernels.gemm.fp8 import Fp8Rows, SplitSums
    from kernels.gemm.fp8_triton_kernel import split_k_total
    from kernels.lora.delta import ColumnSplit
    from kernels.norm.triton_kernel import add_rms_norm_triton

    gen = torch.Generator().manual_seed(seed)
    dt = torch.bfloat16
    res = (4 * torch.randn(tokens, hidden, generator=gen)).to(dt).to(DEVICE)
    parts = torch.randn(k_splits, tokens, hidden, generator=gen).to(DEVICE)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dt).to(DEVICE)
    delta = maybe_expanded(random_lora_delta(gen, tokens, [hidden], dt) if with_delta or split else None,
                           expanded)
    if split:
        delta = dataclasses.replace(delta, column_split=ColumnSplit.allocate(64, 16, 4096, torch.device(DEVICE)))
    options = dict(out_norm=(1 + 0.1 * torch.randn(hidden, generator=gen)).to(dt).to(DEVICE) if out_norm else None,
                   quantize=quantize)
    want = add_rms_norm_triton(res, split_k_total(parts, dt), weight, 1e-5, delta, **options)
    got = add_rms_norm_triton(res, SplitSums(parts, dt), weight, 1e-5, delta, **options)
    for g, w in zip(got, want):
        if isinstance(w, Fp8Rows):
            assert torch.equal(g.fp8.view(torch.uint8), w.fp8.view(torch.uint8)) and torch.equal(g.scale, w.scale)
            g, w = g.x, w.x
        assert torch.equal(g.view(torch.int16), w.view(torch.int16))


def test_shrink_partials_are_zero_past_each_rank_and_on_slices_switched_off() -> None:
    """In an uninitialised workspace, every row with an adapter gets all R columns of every
    split and slice written, zeros past its rank and on a slice its adapter leaves alone (even
    where its rows hold data), and no row outside a slot's run is read: every row no slot
    owns is NaN."""
    from kernels.lora.reference import lora_shrink_ref
    from kernels.lora.triton_kernel import lora_shrink_partials

    case = make_lora_case(token_slots=[2, -1, 0, 0, 1, -1, 2], num_slots=3, max_rank=8,
                          ranks=[4, 8, 2], h_in=96, outs=[32, 16, 16], device=DEVICE).poison_free_rows()
    per_slice = case.ranks.repeat(3, 1)
    per_slice[1, 1] = 0  # slot 1's adapter skips slice 1: its rows there must not be read
    slots = case.slots_with(per_slice)
    workspace = torch.full((4096,), float("nan"), device=DEVICE)
    partials = lora_shrink_partials(case.x, case.a, case.meta, case.scaling, slots,
                                    zero=False, split_k=3, workspace=workspace)
    active = [t for t, s in enumerate(case.token_slots) if s >= 0]
    got = partials[:, :, active].cpu()
    assert not got.isnan().any()
    want = lora_shrink_ref(case.x, case.a, case.meta, case.scaling, slots)[:, active].cpu()
    torch.testing.assert_close(got.sum(0), want, rtol=1e-4, atol=1e-4)
    for row, t in enumerate(active):
        slot = case.token_slots[t]
        for i in range(3):
            live = int(per_slice[i, slot])
            assert torch.equal(got[:, i, row, live:], torch.zeros_like(got[:, i, row, live:]))


# -- greedy argmax --------------------------------------------------------------------------------
@pytest.mark.parametrize("rows,vocab,chunks", [(1, 5, None), (3, 2048, 1), (7, 6001, 3), (64, 49152, None),
                                               (5, 40000, 64), (2, 130, 5)])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_argmax_takes_the_first_maximum_like_torch(rows: int, vocab: int, chunks: int | None,
                                                   dtype: str) -> None:
    """Small integer logits tie within and across chunks: the first index of the maximum, as
    torch.argmax, whichever chunk it lies in; a row of equal values gives 0, a row of -inf too."""
    from kernels.sampling.triton_kernel import first_argmax_triton

    gen = torch.Generator().manual_seed(vocab + rows)
    logits = torch.randint(0, 4, (rows, vocab), generator=gen).to(DTYPES[dtype])
    logits[0, -1] = 9  # the maximum in the last chunk's last block
    if rows > 2:
        logits[1] = 0
        logits[2] = float("-inf")
    logits = logits.to(DEVICE)
    got = first_argmax_triton(logits, chunks)
    assert got.dtype == torch.int64
    assert torch.equal(got.cpu(), logits.cpu().argmax(dim=-1))


def test_argmax_reads_rows_of_a_strided_view() -> None:
    """Decode graphs pass logits[:n] of a padded buffer; a row stride past the vocabulary."""
    from kernels.sampling.triton_kernel import first_argmax_triton

    base = torch.randn(6, 3000, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    view = base[1:5, :2500]
    assert torch.equal(first_argmax_triton(view).cpu(), view.cpu().argmax(dim=-1))


# -- token embedding --------------------------------------------------------------------------------
@pytest.mark.parametrize("tied", [True, False], ids=["tied_transposed_view", "contiguous"])
@pytest.mark.parametrize("with_feedback", [True, False])
def test_embedding_gather_matches_the_reference(tied: bool, with_feedback: bool) -> None:
    """Rows of a [vocab, hidden] weight, contiguous or the LM head seen transposed; tokens from
    the ids, or from the feedback buffer where a row is given."""
    from kernels.embedding import embed_tokens_ref
    from kernels.embedding.triton_kernel import embed_tokens_triton

    gen = torch.Generator().manual_seed(3)
    vocab, hidden, T = 1000, 600, 9  # hidden spans two programs, the second one partial
    weight = torch.randn(vocab, hidden, generator=gen).to(torch.bfloat16)
    weight = (weight.t().contiguous().t() if tied else weight).to(DEVICE)
    ids = torch.randint(0, vocab, (T,), generator=gen)
    feedback = rows = None
    if with_feedback:
        feedback = torch.randint(0, vocab, (5,), generator=gen).to(DEVICE)
        rows = torch.tensor([-1, 0, 4, -1, 2, 2, -1, 3, 1]).to(DEVICE)
        ids[rows.cpu() >= 0] = -1  # never read where the feedback serves (PENDING_TOKEN)
    ids = ids.to(DEVICE)
    got = embed_tokens_triton(weight, ids, feedback, rows)
    expected = embed_tokens_ref(weight, ids.clamp(min=0), feedback, rows)
    assert torch.equal(got.cpu(), expected.cpu())


@pytest.mark.parametrize("rows", [1, 7, 16, 33, 64])
@pytest.mark.parametrize("out_in", [True, False], ids=["out_in_view", "in_out"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_decode_gemm_matches_torch_mm(rows: int, out_in: bool, dtype: str) -> None:
    """Both weight layouts, batches below and at a tile's rows: y = x @ W, rows past M unwritten."""
    from kernels.gemm.triton_kernel import decode_gemm_triton

    torch.manual_seed(rows)
    dt = DTYPES[dtype]
    K, N = 256, 96
    x = torch.randn(rows, K, device=DEVICE, dtype=dt)
    w_out_in = torch.randn(N, K, device=DEVICE, dtype=dt) / 16
    w = w_out_in.t() if out_in else w_out_in.t().contiguous()
    out = torch.full((rows + 3, N), 7.0, device=DEVICE, dtype=dt)
    decode_gemm_triton(x, w, out[:rows], block_n=16, block_k=64)
    assert_close_scaled(out[:rows], x.float() @ w.float(), dt)
    assert bool((out[rows:] == 7.0).all()), "rows past the batch were written"


@pytest.mark.parametrize("rows", [1, 33])
@pytest.mark.parametrize("split_k", [2, 4])
def test_k_split_decode_gemm_leaves_partials_that_sum_to_the_product(rows: int, split_k: int) -> None:
    """split_k: the launch hands back float32 partials [split_k, rows, N] (SplitSums), each
    the product over its K range, which the add + norm after o or down sums as the plain
    launch's output; the output buffer is not written."""
    from kernels.gemm.fp8 import SplitSums
    from kernels.gemm.triton_kernel import decode_gemm_triton
    from kernels.norm.triton_kernel import add_rms_norm_triton

    torch.manual_seed(rows + split_k)
    dt = torch.bfloat16
    K, N = 256, 64
    x = torch.randn(rows, K, device=DEVICE, dtype=dt)
    w = (torch.randn(N, K, device=DEVICE, dtype=dt) / 16).t()
    left = decode_gemm_triton(x, w, block_n=32, block_k=32, split_k=split_k)
    assert isinstance(left, SplitSums) and left.parts.shape == (split_k, rows, N)
    assert left.parts.dtype == torch.float32 and left.dtype == dt
    step = K // split_k
    for s in range(split_k):
        part = x[:, s * step:(s + 1) * step].float() @ w[s * step:(s + 1) * step].float()
        torch.testing.assert_close(left.parts[s], part, rtol=1e-4, atol=1e-4)
    assert_close_scaled(left.total(), x.float() @ w.float(), dt)
    hidden = torch.randn(rows, N, device=DEVICE, dtype=dt)
    weight = torch.rand(N, device=DEVICE, dtype=dt) + 0.5
    got = add_rms_norm_triton(hidden, left, weight, 1e-5)
    want = add_rms_norm_triton(hidden, left.total(), weight, 1e-5)  # the sum launch, then the norm
    for g, e in zip(got, want):
        assert torch.equal(g, e)
    with pytest.raises(AssertionError, match="each split"):
        decode_gemm_triton(x, w, block_n=32, block_k=128, split_k=4)


@pytest.mark.parametrize("rows", [1, 33])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gated_decode_gemm_is_the_gemm_then_the_silu(rows: int, dtype: str) -> None:
    """gate/up's GEMM with SiLU(gate) * up in its epilogue writes, bit for bit, what its plain
    launch then the SiLU kernel write (the base step's two launches), and no more columns."""
    from kernels.activation.reference import silu_mul
    from kernels.activation.triton_kernel import silu_mul_triton
    from kernels.gemm.triton_kernel import decode_gemm_triton

    torch.manual_seed(rows)
    dt = DTYPES[dtype]
    K, I = 128, 48
    x = torch.randn(rows, K, device=DEVICE, dtype=dt)
    w = (torch.randn(2 * I, K, device=DEVICE, dtype=dt) / 8).t()  # [gate; up] as [out, in]
    out = torch.full((rows, I + 5), 7.0, device=DEVICE, dtype=dt)
    decode_gemm_triton(x, w, out[:, :I], block_n=16, block_k=64, gated=True)
    two_launches = silu_mul_triton(decode_gemm_triton(x, w, block_n=16, block_k=64))
    assert torch.equal(out[:, :I], two_launches)
    assert bool((out[:, I:] == 7.0).all()), "columns past the activation were written"
    assert_close_scaled(out[:, :I], silu_mul(x.float() @ w.float()), dt)


@pytest.mark.parametrize("rows", [1, 33])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [32, 96])
def test_rope_decode_gemm_is_the_gemm_then_rope_and_cache(rows: int, dtype: str, head_dim: int) -> None:
    """q/k/v's GEMM with RoPE and the KV-cache write in its epilogue (each program one head's
    paired columns) writes the queries and the cache slots the plain launch then the RoPE
    kernel write, and touches no other slot. Heads of 96 (Phi-3): three tiles of 16 columns
    take each half of a head."""
    from kernels.gemm.rope_out import RopeOut
    from kernels.gemm.triton_kernel import decode_gemm_triton
    from kernels.rope.reference import rope_and_cache_ref
    from kernels.rope.triton_kernel import rope_and_cache_triton

    gen = torch.Generator().manual_seed(rows)
    dt = DTYPES[dtype]
    heads, kv_heads, K = 4, 2, 64
    N = (heads + 2 * kv_heads) * head_dim
    x = torch.randn(rows, K, generator=gen).to(dt).to(DEVICE)
    w = (torch.randn(N, K, generator=gen) / 8).to(dt).to(DEVICE).t()
    theta = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    emb = torch.outer(torch.arange(64).float(), theta).repeat(1, 2)
    cos, sin = emb.cos().to(DEVICE), emb.sin().to(DEVICE)
    positions = torch.randint(0, 64, (rows,), generator=gen).to(DEVICE)
    slots = torch.randperm(16 * 4, generator=gen)[:rows].to(DEVICE)
    caches = [torch.full((16, 4, kv_heads, head_dim), 7.0, dtype=dt, device=DEVICE) for _ in range(4)]
    q = torch.full((rows, heads, head_dim), 7.0, dtype=dt, device=DEVICE)
    out = RopeOut(q, caches[0], caches[1], cos, sin, positions, slots, heads, kv_heads, head_dim)
    assert decode_gemm_triton(x, w, block_n=16, block_k=32, rope=out) is q
    qkv = decode_gemm_triton(x, w, block_n=16, block_k=32)
    q_two = rope_and_cache_triton(qkv, None, cos, sin, positions, slots, caches[2], caches[3],
                                  heads, kv_heads, head_dim)
    assert torch.equal(q, q_two)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    ref_caches = [c.clone().fill_(7.0) for c in caches[:2]]
    q_ref = rope_and_cache_ref((x.float() @ w.float()).to(dt), None, cos, sin, positions, slots,
                               *ref_caches, heads, kv_heads, head_dim)
    assert_close_scaled(q, q_ref, dt)
    for got, want in zip(caches[:2], ref_caches):
        assert_close_scaled(got, want, dt)


def test_decode_gemm_serves_only_decode_shapes() -> None:
    """The dispatcher: decode-shaped CUDA inputs go to the Triton GEMM, prefill-sized ones and
    CPU to cuBLAS; both give x @ W. The tuning names the groups it serves."""
    from kernels.gemm import DecodeGemm
    from kernels.tuning import Tuning

    gemm = DecodeGemm(torch.device(DEVICE))
    w = torch.randn(256, 64, device=DEVICE)
    for rows in (3, 64, 65):
        x = torch.randn(rows, 256, device=DEVICE)
        assert gemm.applies(x, w) == (DEVICE == "cuda" and rows <= 64)
        assert_close_scaled(gemm(x, w), x @ w, torch.float32)
    assert gemm.serves("qkv") == (DEVICE == "cuda") and not gemm.serves("lm_head")
    assert not DecodeGemm(torch.device(DEVICE), Tuning(gemm_groups=frozenset({"o"}))).serves("qkv")
    with pytest.raises(ValueError, match="gemm_groups names \\['lm_head'\\]"):
        Tuning(gemm_groups=frozenset({"qkv", "lm_head"}))


@pytest.mark.parametrize("rows,used,segments", [(1, [2], 1), (9, [3, 0, 2], 4), (33, [1, 4, 0, 5, 2, 6], 8)])
@pytest.mark.parametrize("outs", [[64], [32, 32], [64, 32, 32]], ids=["o", "gate_up", "qkv"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_decode_gemm_lora_matches_reference(rows: int, used: list[int], segments: int,
                                            outs: list[int], dtype: str) -> None:
    """The decode GEMM with LoRA folded in (kernels/gemm/fold.py): x @ W plus every row's
    delta, slices side by side, rows without an adapter and empty padding segments left
    alone, ranks below the slot pool's; launched three times on the same counters (tickets and
    finished shrinks only grow: each launch must find its own), then with another block_n (a
    tuning table's tiling for steps of another size), whose grid has counters of its own."""
    from kernels.gemm.fold_triton_kernel import decode_gemm_lora_triton
    from kernels.gemm import counters_for, gemm_lora_fits

    dt = DTYPES[dtype]
    gen = torch.Generator().manual_seed(rows)
    slots = grouped_slots(gen, rows, used)
    case = make_lora_case(token_slots=slots, num_slots=7, max_rank=16, ranks=[16, 8, 16, 4, 16, 16, 12],
                          h_in=128, outs=outs, dtype=dt, device=DEVICE, seed=rows).poison_free_rows()
    lora = make_gemm_lora(case, segments)
    w = (torch.randn(sum(outs), 128, generator=gen) / 16).to(dt).to(DEVICE).t()
    assert gemm_lora_fits(lora, sum(outs), 16)
    expected = case.x.float().cpu() @ w.float().cpu() + naive_delta(case)
    shrinks = segments * len(outs)
    for launch in range(1, 4):
        y = decode_gemm_lora_triton(case.x, w, lora, block_n=16, block_k=64, num_stages=2)
        assert_close_scaled(y, expected, dt)
        assert counters_for(lora.sync, 16).tolist() == [launch * (shrinks + sum(outs) // 16),
                                                        launch * shrinks]
    y = decode_gemm_lora_triton(case.x, w, lora, block_n=32, block_k=64, num_stages=2)
    assert_close_scaled(y, expected, dt)
    assert counters_for(lora.sync, 32).tolist() == [shrinks + sum(outs) // 32, shrinks]
    assert counters_for(lora.sync, 16).tolist() == [3 * (shrinks + sum(outs) // 16), 3 * shrinks]


@pytest.mark.parametrize("rows,used,segments", [(1, [2], 1), (9, [3, 0, 2], 4), (33, [1, 4, 0, 5, 2, 6], 8)])
@pytest.mark.parametrize("group", ["qkv", "gate_up", "o", "o-split"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("splits", [0, 3], ids=["shrink_programs", "spread_3"])
def test_shrink_only_fold_leaves_the_delta_for_the_next_op(rows: int, used: list[int], segments: int,
                                                           group: str, dtype: str, splits: int) -> None:
    """GemmLora(expand=False): the GEMM only shrinks beside its matmul (y = x @ W, each adapter
    row's x @ A stored in xa, no counters taken) and the op after it expands
    GemmLora.unexpanded: RoPE + KV write after q/k/v, SiLU after gate/up, the residual add +
    norm after o (one program a row, or spread over programs of 16 columns by a ColumnSplit).
    The shrink runs in programs of its own, or (shrink_splits) in the tile programs as units
    of 3 K ranges each, more units than programs (the last range of K empty: zeros).
    Rows without an adapter keep xa's NaN (never written): the op must read no sums for them.
    Its output equals the reference over x @ W + every delta."""
    from kernels.gemm.fold_triton_kernel import decode_gemm_lora_triton
    from kernels.lora.delta import ColumnSplit
    from kernels.norm.reference import add_rms_norm as add_rms_norm_ref
    from kernels.norm.triton_kernel import add_rms_norm_triton
    from kernels.rope.reference import rope_and_cache_ref
    from kernels.rope.triton_kernel import rope_and_cache_triton
    from kernels.activation.reference import silu_mul as silu_mul_ref
    from kernels.activation.triton_kernel import silu_mul_triton

    dt = DTYPES[dtype]
    heads, kv_heads, head_dim = 4, 2, 16
    outs = {"qkv": [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim],
            "gate_up": [64, 64]}.get(group, [64])
    gen = torch.Generator().manual_seed(rows)
    slots = grouped_slots(gen, rows, used)
    tokens = len(slots)  # the rows with gaps of rows without an adapter between them
    case = make_lora_case(token_slots=slots, num_slots=7, max_rank=16, ranks=[16, 8, 16, 4, 16, 16, 12],
                          h_in=128, outs=outs, dtype=dt, device=DEVICE, seed=rows).poison_free_rows()
    split = ColumnSplit.allocate(16, tokens, 64, torch.device(DEVICE)) if group == "o-split" else None
    lora = dataclasses.replace(make_gemm_lora(case, segments), expand=False, column_split=split)
    if splits:
        lora = dataclasses.replace(lora, shrink_splits=splits, xa=torch.full(
            (tokens, splits * lora.xa.shape[1]), float("nan"), device=DEVICE))
    w = (torch.randn(sum(outs), 128, generator=gen) / 16).to(dt).to(DEVICE).t()
    y = decode_gemm_lora_triton(case.x, w, lora, block_n=16, block_k=64, num_stages=2)
    assert_close_scaled(y, case.x.float().cpu() @ w.float().cpu(), dt)
    assert not lora.sync.any()  # a shrink-only launch waits on no counters
    active = torch.tensor(slots) >= 0
    assert torch.isnan(lora.xa.cpu()[~active]).all()
    with_delta = (y.float().cpu() + naive_delta(case)).to(dt).to(DEVICE)
    rel = 1e-4 if dt == torch.float32 else 3e-2  # bf16: the delta rounded in once, or twice
    if group == "gate_up":
        got = silu_mul_triton(y, lora.unexpanded(tokens))
        torch.testing.assert_close(got.float().cpu(), silu_mul_ref(with_delta).float().cpu(),
                                   rtol=rel, atol=rel)
        return
    if group.startswith("o"):
        hidden = torch.randn(tokens, 64, generator=gen).to(dt).to(DEVICE)
        weight = (1 + torch.randn(64, generator=gen) / 4).to(dt).to(DEVICE)
        got = add_rms_norm_triton(hidden, y, weight, 1e-5, lora.unexpanded(tokens))
        want = add_rms_norm_ref(hidden, with_delta, weight, 1e-5)
        for g, w_ in zip(got, want):
            torch.testing.assert_close(g.float().cpu(), w_.float().cpu(), rtol=rel, atol=rel)
        if split is not None:  # each row's count back to zero for the next launch
            assert not split.arrivals.any()
        return
    positions = torch.randint(0, 50, (tokens,), generator=gen).to(DEVICE)
    theta = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    emb = torch.outer(torch.arange(64).float(), theta).repeat(1, 2)
    cos, sin = emb.cos().to(DEVICE), emb.sin().to(DEVICE)
    cache_slots = torch.randperm(16 * 4, generator=gen)[:tokens].to(DEVICE)
    caches = [torch.zeros(16, 4, kv_heads, head_dim, dtype=dt, device=DEVICE) for _ in range(2)]
    ref_caches = [c.clone() for c in caches]
    q = rope_and_cache_triton(y, lora.unexpanded(tokens), cos, sin, positions, cache_slots,
                              *caches, heads, kv_heads, head_dim)
    q_ref = rope_and_cache_ref(with_delta, None, cos, sin, positions, cache_slots, *ref_caches,
                               heads, kv_heads, head_dim)
    torch.testing.assert_close(q.float().cpu(), q_ref.float().cpu(), rtol=rel, atol=rel)
    for got, want in zip(caches, ref_caches):
        torch.testing.assert_close(got.float().cpu(), want.float().cpu(), rtol=rel, atol=rel)
