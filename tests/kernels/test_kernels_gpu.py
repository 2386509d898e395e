"""Triton kernels natively on CUDA at realistic sizes (Llama-3.2-1B-like), bf16, against the
PyTorch reference. Skipped where no CUDA device is present."""
from __future__ import annotations

import pytest
import torch

from kernel_cases import make_attention_case, make_gemm_lora, make_lora_case, naive_delta, random_slots

pytestmark = pytest.mark.gpu

HIDDEN, Q, KV, INTER = 2048, 2048, 512, 8192
GROUPS = {  # name: (in_features, slice out sizes)
    "qkv": (HIDDEN, [Q, KV, KV]),
    "o": (Q, [HIDDEN]),
    "gate_up": (HIDDEN, [INTER, INTER]),
    "down": (INTER, [HIDDEN]),
}


def _bf16_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    scale = max(1.0, expected.float().abs().max().item())
    torch.testing.assert_close(actual.float(), expected.float(), rtol=2e-2, atol=2e-2 * scale)


@pytest.mark.parametrize("T,num_adapters", [(1, 1), (37, 8), (256, 32), (2048, 4)])
@pytest.mark.parametrize("group", list(GROUPS))
def test_lora_triton_matches_reference_on_gpu(group: str, T: int, num_adapters: int) -> None:
    from kernels.lora import add_lora
    from kernels.lora.reference import lora_expand_ref, lora_shrink_ref
    from kernels.lora.triton_kernel import lora_expand_triton, lora_shrink_triton

    h_in, outs = GROUPS[group]
    S, R = 32, 32
    gen = torch.Generator().manual_seed(T + num_adapters)
    ranks = [[8, 16, 32][s % 3] for s in range(S)]
    used = torch.randperm(S, generator=gen)[:num_adapters].tolist()
    slots = random_slots(gen, T, S, used, none_fraction=0.2 if T > 1 else 0.0)
    case = make_lora_case(token_slots=slots, num_slots=S, max_rank=R, ranks=ranks, h_in=h_in,
                          outs=outs, dtype=torch.bfloat16, device="cuda", seed=T).poison_free_rows()
    # Every slot's own rank on every slice, then a third of the slots switched off on one
    # slice each (their rows there hold data the kernels must not read).
    off = case.ranks.repeat(len(outs), 1)
    for s in range(0, S, 3):
        off[s % len(outs), s] = 0
    inactive = [t for t, s in enumerate(slots) if s < 0]
    for slot_rows in (case.slots, case.slots_with(off)):
        h_ref = lora_shrink_ref(case.x, case.a, case.meta, case.scaling, slot_rows)
        h = lora_shrink_triton(case.x, case.a, case.meta, case.scaling, slot_rows)
        _bf16_close(h, h_ref)
        y_ref, y = case.y.clone(), case.y.clone()
        lora_expand_ref(h_ref, case.b, case.meta, y_ref, case.offsets, slot_rows)
        lora_expand_triton(h_ref, case.b, case.meta, y, case.offsets, slot_rows)
        _bf16_close(y - case.y, y_ref - case.y)  # the deltas, at their own scale
        assert torch.equal(y[inactive], case.y[inactive])
        y_fused = case.y.clone()
        add_lora(case.x, y_fused, case.a, case.b, case.meta, case.scaling, case.offsets,
                 slot_rows)  # CUDA: Triton
        _bf16_close(y_fused - case.y, y_ref - case.y)


@pytest.mark.parametrize("q_lens,ctx", [
    ([1] * 64, [512 + 61 * i for i in range(64)]),     # decode, varied contexts
    ([1, 1], [4096, 1500]),                            # small decode batch: split-KV path
    ([512, 1, 1, 1, 200], [512, 2048, 77, 4000, 900]),  # mixed prefill (fresh, chunked) + decode
])
@pytest.mark.parametrize("heads", [(32, 8, 64), (32, 8, 128), (16, 2, 128)],
                         ids=["1b", "8b", "70b-tp4-rank"])  # decode key tiles of 64, 32, 32 keys
def test_paged_attention_triton_matches_reference_on_gpu(q_lens: list[int], ctx: list[int],
                                                         heads: tuple[int, int, int]) -> None:
    from kernels.attention.reference import paged_attention_ref
    from kernels.attention.triton_kernel import paged_attention_triton, paged_attention_triton_impl

    num_heads, num_kv_heads, head_dim = heads
    case = make_attention_case(q_lens=q_lens, seq_lens=ctx, num_heads=num_heads,
                               num_kv_heads=num_kv_heads, head_dim=head_dim, page=16,
                               dtype=torch.bfloat16, device="cuda")
    ref = paged_attention_ref(*case.args())
    _bf16_close(paged_attention_triton(*case.args()), ref)
    for splits in (1, 4):
        _bf16_close(paged_attention_triton_impl(*case.args(), num_splits=splits), ref)


def _replays_with_a_new_input(step, out: torch.Tensor, times: int = 3):
    """Runs `step` (a kernel writing from `out`, then kernels launched with PDL after it)
    once, captures it in a CUDA graph, then replays it `times` times, each with a new `out`,
    yielding the replay's index after each: a kernel that read its predecessor's output
    before its wait would see the last replay's."""
    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for i in range(times):
        out.normal_()
        graph.replay()
        torch.cuda.synchronize()
        yield i


_NEEDS_PDL = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="programmatic dependent launch needs Hopper or newer")


@_NEEDS_PDL
@pytest.mark.parametrize("prefetch_k,tma", [(0, False), (512, False), (2048, False), (0, True), (512, True)])
def test_decode_gemm_pdl_after_a_norm_in_a_graph(prefetch_k: int, tma: bool) -> None:
    """Launched with programmatic dependent launch right after the add + norm that writes its
    input (which lets it start early), replayed from a CUDA graph: it must still read the
    norm's new output, never the stale one (with pointer loads and with TMA tile loads)."""
    from kernels.gemm.triton_kernel import decode_gemm_tma, decode_gemm_triton

    K, N = 2048, 2048
    w = (torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / 32).t()
    gemm = decode_gemm_tma if tma else decode_gemm_triton
    step, out, y, x_seen = _norm_then(w, lambda x, y: gemm(x, w, y, pdl=True, prefetch_k=prefetch_k))
    for _ in _replays_with_a_new_input(step, out):
        torch.testing.assert_close(y.float(), (x_seen.float() @ w.float()).to(torch.bfloat16).float(),
                                   rtol=2e-2, atol=2e-2)


@_NEEDS_PDL
@pytest.mark.parametrize("early_kv", [True, False])
@pytest.mark.parametrize("tma", [True, False])
def test_attention_after_rope_and_the_qkv_gemm_in_a_graph(early_kv: bool, tma: bool) -> None:
    """A decode layer's chain as the step runs it, each launched with PDL and replayed from a
    CUDA graph: the q/k/v GEMM (letting RoPE launch as soon as its programs start), RoPE +
    KV write (the new token's q, and its key and value into the cache), then attention
    (early_kv: the older keys of its first tile read before its wait). Each replay, on a
    new input, must equal the reference over the new q and the cache as RoPE left it: an
    attention that read q or the new token's key or value before its wait would see the last
    replay's. Contexts from 1 to 150 keys put the new token in the first key tile and in later
    ones."""
    from kernels.gemm.triton_kernel import decode_gemm_tma, decode_gemm_triton
    from kernels.attention.reference import paged_attention_ref
    from kernels.attention.triton_kernel import paged_attention_triton_impl
    from kernels.rope.triton_kernel import rope_and_cache_triton
    from inference_node.model.rope import RotaryEmbedding

    heads, kv_heads, dim, page = 32, 8, 64, 16
    lens = [1 + (37 * i) % 150 for i in range(64)]
    case = make_attention_case(q_lens=[1] * 64, seq_lens=lens, num_heads=heads,
                               num_kv_heads=kv_heads, head_dim=dim, page=page,
                               dtype=torch.bfloat16, device="cuda", seed=3)
    seq_lens = case.seq_lens.long()
    positions = seq_lens - 1
    blocks = case.block_tables.long().gather(1, (positions // page)[:, None])[:, 0]
    slots = blocks * page + positions % page
    rope = RotaryEmbedding(dim, 256, 500000.0, None, torch.device("cuda"))
    x = torch.randn(64, HIDDEN, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(Q + 2 * KV, HIDDEN, device="cuda", dtype=torch.bfloat16) / 32).t()
    out = torch.empty(64, heads, dim, device="cuda", dtype=torch.bfloat16)
    q_seen = torch.empty_like(out)

    def step():
        qkv = (decode_gemm_tma if tma else decode_gemm_triton)(
            x, w, pdl=True, prefetch_k=512, block_n=32, block_k=256, early_trigger=True)
        q = rope_and_cache_triton(qkv, None, rope.cos, rope.sin, positions, slots,
                                  case.k_cache, case.v_cache, heads, kv_heads, dim)
        out.copy_(paged_attention_triton_impl(
            q, case.k_cache, case.v_cache, case.block_tables, case.query_start_loc,
            case.seq_lens, case.scale, 1, max(lens), early_kv=early_kv))
        q_seen.copy_(q)

    for _ in _replays_with_a_new_input(step, x):
        _bf16_close(out, paged_attention_ref(q_seen, case.k_cache, case.v_cache,
                                             case.block_tables, case.query_start_loc,
                                             case.seq_lens, case.scale, 1, max(lens)))


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="TMA needs Hopper or newer")
@pytest.mark.parametrize("rows", [1, 7, 33, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_gemm_tma_matches_torch_mm(rows: int, dtype: torch.dtype) -> None:
    """TMA tile loads: y = x @ W over [out, in] weights, float32 exact to fp32 products; the
    rows past the batch that x's buffer holds (NaN here) are read with the tile (tma_rows)
    and spread to no row of the batch, and the output's rows past it stay unwritten."""
    from kernels.gemm import tma_fits
    from kernels.gemm.triton_kernel import decode_gemm_tma

    torch.manual_seed(rows)
    K, N = 1024, 96
    x_full = torch.randn(64, K, device="cuda", dtype=dtype)
    x = x_full[:rows]
    x_full[rows:] = float("nan")  # a kernel reading past the batch would spread these
    w = (torch.randn(N, K, device="cuda", dtype=dtype) / 32).t()
    assert tma_fits(x, w)
    out = torch.full((rows + 3, N), 7.0, device="cuda", dtype=dtype)
    decode_gemm_tma(x, w, out[:rows], block_n=16, block_k=128, num_stages=3)
    expected = x.float() @ w.float()
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out[:rows].float(), expected, **tol)
    assert bool((out[rows:] == 7.0).all()), "rows past the batch were written"


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="TMA needs Hopper or newer")
@pytest.mark.parametrize("rows", [1, 64])
@pytest.mark.parametrize("K,N,split_k", [(8192, 2048, 4), (14336, 4096, 2), (4096, 4096, 2)])
def test_k_split_decode_gemm_tma_through_the_dispatcher(rows: int, K: int, N: int, split_k: int) -> None:
    """Llama 1B's and 8B's down and 8B's o with Tuning.gemm_split_k under PDL: the dispatcher
    hands back float32 partials (SplitSums) only where the caller takes them, each its K range's
    product, and the add + norm over them writes what it writes over their sum."""
    from kernels.gemm import DecodeGemm
    from kernels.gemm.fp8 import SplitSums
    from kernels.norm.triton_kernel import add_rms_norm_triton
    from kernels.tuning import Tuning

    torch.manual_seed(rows + K)
    x = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / 64).t()
    tuning = Tuning(gemm_split_k={"down": split_k}, gemm_tma_tilings={"down": (64, 128, 4)})
    gemm = DecodeGemm(torch.device("cuda"), tuning)
    left = gemm(x, w, group="down", leave_sums=True)
    assert isinstance(left, SplitSums) and left.parts.shape == (split_k, rows, N)
    step = K // split_k
    for s in range(split_k):
        part = x[:, s * step:(s + 1) * step].float() @ w[s * step:(s + 1) * step].float()
        torch.testing.assert_close(left.parts[s], part, rtol=1e-3, atol=1e-3)
    plain = gemm(x, w, group="down")
    assert isinstance(plain, torch.Tensor)
    torch.testing.assert_close(left.total().float(), plain.float(), rtol=2e-2, atol=2e-2)
    hidden = torch.randn(rows, N, device="cuda", dtype=torch.bfloat16)
    weight = torch.rand(N, device="cuda", dtype=torch.bfloat16) + 0.5
    got = add_rms_norm_triton(hidden, left, weight, 1e-5, tuning=tuning)
    want = add_rms_norm_triton(hidden, left.total(), weight, 1e-5, tuning=tuning)
    for g, e in zip(got, want):
        assert torch.equal(g, e)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="TMA needs Hopper or newer")
@pytest.mark.parametrize("rows", [1, 33, 64])
def test_gated_decode_gemm_tma_is_the_gemm_then_the_silu(rows: int) -> None:
    """At Llama-3.1-8B's gate/up (4096 -> 2 x 14336), TMA loads, PDL: the gated launch equals
    the plain launch then the SiLU kernel, bit for bit (as the node's base step runs it and
    as a LoRA step still does)."""
    from kernels.activation.triton_kernel import silu_mul_triton
    from kernels.gemm.triton_kernel import decode_gemm_tma

    torch.manual_seed(rows)
    K, I = 4096, 14336
    x = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(2 * I, K, device="cuda", dtype=torch.bfloat16) / 64).t()
    launch = dict(pdl=True, prefetch_k=512, block_n=16, block_k=128, num_stages=4, early_trigger=True)
    gated = decode_gemm_tma(x, w, gated=True, **launch)
    two_launches = silu_mul_triton(decode_gemm_tma(x, w, **launch))
    torch.cuda.synchronize()
    assert gated.shape == (rows, I) and torch.equal(gated, two_launches)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="TMA needs Hopper or newer")
@pytest.mark.parametrize("rows,block_n,head_dim", [(1, 32, 128), (64, 32, 128), (64, 64, 128), (64, 16, 96)])
def test_rope_decode_gemm_tma_is_the_gemm_then_rope_and_cache(rows: int, block_n: int, head_dim: int) -> None:
    """At Llama-3.1-8B's q/k/v (4096 -> 32 query and 8 KV heads of 128), Llama-3 RoPE tables,
    and Phi-3-mini's (3072 -> 32 and 32 heads of 96, three tiles to half a head), TMA loads,
    PDL: the RoPE launch writes the queries and the cache slots, bit for bit, that the plain
    launch then the RoPE kernel write (as the node's base step ran them)."""
    from inference_node.model.rope import RotaryEmbedding
    from kernels.gemm.rope_out import RopeOut
    from kernels.gemm.triton_kernel import decode_gemm_tma
    from kernels.rope.triton_kernel import rope_and_cache_triton

    torch.manual_seed(rows)
    heads, kv_heads, K = (32, 8, 4096) if head_dim == 128 else (32, 32, 3072)
    N = (heads + 2 * kv_heads) * head_dim
    x = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / 64).t()
    scaling = ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}
               if head_dim == 128 else None)
    rope = RotaryEmbedding(head_dim, 8192, 500000.0, scaling, torch.device("cuda"))
    positions = torch.randint(0, 8192, (rows,), device="cuda")
    slots = torch.randperm(64 * 16, device="cuda")[:rows]
    caches = [torch.zeros(64, 16, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    q = torch.empty(rows, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    launch = dict(pdl=True, prefetch_k=512, block_k=128, num_stages=4, early_trigger=True)
    decode_gemm_tma(x, w, block_n=block_n, **launch, rope=RopeOut(
        q, caches[0], caches[1], rope.cos, rope.sin, positions, slots, heads, kv_heads, head_dim))
    qkv = decode_gemm_tma(x, w, block_n=2 * block_n, **launch)
    q_two = rope_and_cache_triton(qkv, None, rope.cos, rope.sin, positions, slots, caches[2],
                                  caches[3], heads, kv_heads, head_dim)
    torch.cuda.synchronize()
    assert torch.equal(q, q_two)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@pytest.mark.parametrize("block", [128, 512])
@pytest.mark.parametrize("adapters", [1, 32])
def test_add_rms_norm_split_over_columns_in_a_graph(block: int, adapters: int) -> None:
    """The LoRA add + norm with each row spread over programs (a ColumnSplit), at Llama-3.2-1B's
    width and decode batch, right after the projection's GEMM that writes its input (both
    PDL-launched on Hopper, as in a step), replayed from one CUDA graph: every replay, on new
    inputs, equals the reference on the GEMM's new output (a kernel that read it before its
    wait would see the last replay's), and leaves every arrival count at zero (a count left
    over would make the next replay normalise a row before all of it is in)."""
    from kernels.gemm.triton_kernel import decode_gemm_triton
    from kernels.lora.delta import ColumnSplit, LoraDelta
    from kernels.norm.reference import add_rms_norm
    from kernels.norm.triton_kernel import add_rms_norm_triton
    from kernels.tuning import DEFAULT_TUNING

    T, R = 64, 16
    gen = torch.Generator(device="cuda").manual_seed(block + adapters)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    # B in an arena of rank rows: adapter j a run of its own rank, a NaN row after each run
    # (read past a rank, it spreads); each row's (rank, first row), rank 0 without an adapter.
    ranks = [[16, 8, 12, 4][j % 4] for j in range(adapters)]
    firsts = [sum(r + 1 for r in ranks[:j]) for j in range(adapters)]
    b = torch.full((sum(r + 1 for r in ranks), HIDDEN), float("nan"), **bf16)
    for first, r in zip(firsts, ranks):
        b[first:first + r] = torch.randn(r, HIDDEN, generator=gen, **bf16) * 0.05
    slots = torch.sort(torch.randint(-1, adapters, (T,), generator=gen, device="cuda")).values
    rank_of = torch.tensor(ranks, device="cuda")[slots.clamp(min=0)]
    token_rows = torch.stack([torch.where(slots >= 0, rank_of, 0),
                              torch.tensor(firsts, device="cuda")[slots.clamp(min=0)]], dim=1).int()
    past_rank = torch.arange(R, device="cuda")[None, :] >= token_rows[:, :1]  # [T, R]
    partials = torch.randn(4, 1, T, R, generator=gen, device="cuda")
    x_in = torch.randn(T, Q, generator=gen, **bf16)
    w = (torch.randn(HIDDEN, Q, generator=gen, **bf16) / 32).t()  # o: [in, out] view of [out, in]
    hidden, out = torch.randn(T, HIDDEN, generator=gen, **bf16), torch.empty(T, HIDDEN, **bf16)
    weight = 1 + 0.1 * torch.randn(HIDDEN, generator=gen, **bf16)
    split = ColumnSplit.allocate(block, T, HIDDEN, torch.device("cuda"))
    delta = LoraDelta(partials, (b,), token_rows, column_split=split)
    results = {}

    def step():
        decode_gemm_triton(x_in, w, out, pdl=DEFAULT_TUNING.pdl_on(x_in), prefetch_k=512, block_n=16,
                           block_k=256)
        results["new"], results["x"] = add_rms_norm_triton(hidden, out, weight, 1e-5, delta)

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(4):
        x_in.normal_(generator=gen)
        partials.normal_(generator=gen)
        partials[:, :, past_rank] = float("nan")  # sums no kernel may read (past a rank, or no adapter)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.float(), (x_in.float() @ w.float()).to(torch.bfloat16).float(),
                                   rtol=2e-2, atol=2e-2)
        new_ref, x_ref = add_rms_norm(hidden, out, weight, 1e-5, delta.dense())
        _bf16_close(results["new"], new_ref)
        _bf16_close(results["x"], x_ref)
        assert int(split.arrivals.count_nonzero()) == 0


def _fold_case(k: int, outs: list[int], adapters: int, segments: int):
    """64 rows over `adapters` adapters (a few rows on the base model below 32) in a bucket
    of `segments` (empty segments after the real ones): the LoRA case, its GemmLora, and W
    (a transposed view of [out, in], as the engine keeps it)."""
    none = 4 if adapters < 32 else 0
    slots = [-1] * none + sorted(i % adapters for i in range(64 - none))
    case = make_lora_case(token_slots=slots, num_slots=64, max_rank=16, h_in=k, outs=outs,
                          dtype=torch.bfloat16, device="cuda", seed=adapters)
    w = (torch.randn(sum(outs), k, device="cuda", dtype=torch.bfloat16) / 32).t()
    return case, make_gemm_lora(case, segments), w


def _norm_then(w: torch.Tensor, matmul):
    """A step as the decode graphs run it: the add + norm writing the matmul's input x, then
    matmul(x, y) writing y = x @ w. Returns (step, the norm's input to renew, y, the x seen)."""
    from kernels.norm.triton_kernel import add_rms_norm_triton

    k, n = w.shape
    hidden = torch.randn(64, k, device="cuda", dtype=torch.bfloat16)
    out = torch.randn(64, k, device="cuda", dtype=torch.bfloat16)
    norm_w = torch.ones(k, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(64, n, device="cuda", dtype=torch.bfloat16)
    x_seen = torch.empty(64, k, device="cuda", dtype=torch.bfloat16)

    def step():
        _, x = add_rms_norm_triton(hidden, out, norm_w, 1e-5)
        matmul(x, y)
        x_seen.copy_(x)

    return step, out, y, x_seen


def _norm_then_fold(gemm, group: str, w: torch.Tensor, lora):
    """_norm_then with the decode GEMM's LoRA fold as the matmul."""
    return _norm_then(w, lambda x, y: y.copy_(gemm(x, w, group=group, lora=lora)))


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="TMA needs Hopper or newer")
@pytest.mark.parametrize("rows", [5, 40])
def test_decode_gemm_lora_reads_its_row_tiles_nan_rows_without_spreading_them(rows: int) -> None:
    """A step of fewer rows than its row tile, x from empty_rows with NaN in the rows past the
    batch: the fold's TMA descriptor spans the whole tile (tma_rows) and every row of the batch
    is the reference's x @ W plus its delta."""
    from kernels.gemm import DecodeGemm
    from kernels.gemm.shapes import empty_rows, row_tile, tma_rows
    from kernels.tuning import Tuning

    k, outs = GROUPS["o"]
    case = make_lora_case(token_slots=sorted(i % 8 for i in range(rows)), num_slots=8, max_rank=16, h_in=k,
                          outs=outs, dtype=torch.bfloat16, device="cuda", seed=rows)
    lora = make_gemm_lora(case, 8)
    x = empty_rows(rows, k, dtype=torch.bfloat16, device="cuda")
    tile = x.as_strided((row_tile(rows), k), (k, 1))
    tile[rows:] = float("nan")
    x.copy_(case.x)
    assert tma_rows(x, row_tile(rows)) == row_tile(rows)
    w = (torch.randn(sum(outs), k, device="cuda", dtype=torch.bfloat16) / 32).t()
    y = DecodeGemm(torch.device("cuda"), Tuning())(x, w, group="o", lora=lora)
    _bf16_close(y.cpu(), x.float().cpu() @ w.float().cpu() + naive_delta(case))


@pytest.mark.parametrize("adapters,segments,splits", [(1, 1, 8), (32, 32, 4), (20, 32, 4), (64, 64, 2)])
@pytest.mark.parametrize("group", [*GROUPS, "down-8b"])
def test_spread_shrink_fold_after_a_norm_in_a_graph(group: str, adapters: int, segments: int,
                                                    splits: int) -> None:
    """A shrink-only fold whose tile programs compute the shrink (GemmLora.shrink_splits), as
    the decode graphs launch it: the engine's tiling (down-8b: Llama-3.1-8B's down at the H100
    table's fold tiling), TMA and PDL on Hopper, after the add + norm that writes its input,
    captured and replayed with new inputs. Each replay: y = the norm's new output @ W, and the
    delta the op after it expands from the split sums equals every row's delta."""
    import dataclasses

    from kernels.gemm import DecodeGemm
    from kernels.tuning import Tuning

    tuning = Tuning()
    if group == "down-8b":
        group, (k, outs) = "down", (14336, [4096])
        tuning = Tuning(fold_tilings={**tuning.fold_tilings, "down": (32, 128, 6)})
    else:
        k, outs = GROUPS[group]
    case, lora, w = _fold_case(k, outs, adapters, segments)
    lora = dataclasses.replace(lora, expand=False, shrink_splits=splits, xa=torch.full(
        (64, splits * lora.xa.shape[1]), float("nan"), device="cuda"))
    step, out, y, x_seen = _norm_then_fold(DecodeGemm(torch.device("cuda"), tuning), group, w, lora)
    for _ in _replays_with_a_new_input(step, out):
        case.x = x_seen.clone()
        _bf16_close(y.cpu(), case.x.float().cpu() @ w.float().cpu())
        _bf16_close(lora.unexpanded(64).dense().cpu(), naive_delta(case))
    assert not lora.sync.any()  # a shrink-only launch waits on no counters


@pytest.mark.parametrize("prefetch_a", [0, 2048])
@pytest.mark.parametrize("adapters,segments", [(1, 1), (32, 32), (20, 32), (64, 64)])
@pytest.mark.parametrize("group", list(GROUPS))
def test_decode_gemm_lora_after_a_norm_in_a_graph(group: str, adapters: int, segments: int,
                                                  prefetch_a: int) -> None:
    """The decode GEMM with LoRA folded in (kernels/gemm/fold.py) as the decode graphs launch
    it: the engine's tiling, TMA and PDL on Hopper, right after the add + norm that writes
    its input (which lets it start early), captured and replayed with new inputs; 64 rows
    over `adapters` adapters in a bucket of `segments` (empty segments after the real ones),
    the shrink programs asking L2 for `prefetch_a` columns of A before their wait (or none).
    Each replay: the norm's new output @ W plus every row's delta, the shrinks counted."""
    from kernels.gemm import DecodeGemm
    from kernels.tuning import Tuning

    k, outs = GROUPS[group]
    case, lora, w = _fold_case(k, outs, adapters, segments)
    gemm = DecodeGemm(torch.device("cuda"), Tuning(fold_prefetch_a=prefetch_a))
    step, out, y, x_seen = _norm_then_fold(gemm, group, w, lora)
    for i in _replays_with_a_new_input(step, out):
        case.x = x_seen.clone()
        expected = case.x.float().cpu() @ w.float().cpu() + naive_delta(case)
        _bf16_close(y.cpu(), expected)
        # One tiling a group: one block_n's row of counters moves; column 1 counts finished shrinks.
        assert lora.sync[:, 1].sum().item() == (i + 2) * segments * len(outs), f"replay {i}: shrinks counted"
