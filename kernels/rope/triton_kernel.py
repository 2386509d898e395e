"""RoPE, the q/k/v LoRA delta and the KV-cache write in one Triton launch per layer.

In a decode step the ops between the q/k/v matmul and attention are tiny (64 rows) and each
costs a launch and a round trip through memory: expanding and adding the LoRA delta, rotating
q and k, writing k and v into their cache slots. Programs cover (token, part): the first parts
each rotate a group of query heads (as many as there are KV heads), then one part rotates the
key heads and writes them to the cache, and one copies the value heads into it. A part adds
its columns' LoRA delta first when given, expanded from the shrink's partial sums and the
adapter's B rows in the arena (kernels/lora/delta.py, kernels/lora/rows.py). Heads are handled as their two halves, the pairs that
RoPE's rotate_half mixes, so each column is loaded (and its delta expanded) once. Where the
family norms each query and key head before RoPE (Qwen3, Gemma 3: QK_NORM), a part holds its
heads whole, so it normalises them in place before the rotation.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..host import cdiv, next_power_of_2, pdl_launch
from ..tuning import DEFAULT_TUNING, Tuning

from ..lora.delta import LoraDelta
from ..lora.expand_rows import expand_rows, load_b_rows, load_sums
from ..norm.triton_kernel import _weigh
from .reference import QKNorm


@triton.jit
def _half(qkv_row, d, col, mask, ADD: tl.constexpr):
    """Columns `col` of one row (a half of each of the part's heads, flattened) plus their
    float32 delta d where ADD (rounded to qkv's dtype once, as the unfused path rounds), in
    float32."""
    x = tl.load(qkv_row + col, mask=mask, other=0.0)
    if ADD:
        x = (x.to(tl.float32) + d).to(x.dtype)
    return x.to(tl.float32)


@triton.jit
def _rope_cache_kernel(
    qkv_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
    part_ptr, bq_ptr, bk_ptr, bv_ptr, lrows_ptr, dense_ptr, qn_ptr, kn_ptr, norm_eps,
    stride_qkv, stride_dense, stride_qo_t, stride_qo_h, stride_cos,
    stride_kb, stride_kp, stride_kh, stride_vb, stride_vp, stride_vh,
    R, stride_ps, stride_pslice, stride_pt, stride_lrows, stride_br_q, stride_br_kv,
    Hq, Hkv, D, HALF, PAGE, Q_PARTS,
    SPLITS: tl.constexpr, HAS_LORA: tl.constexpr, DENSE: tl.constexpr, BLOCK_HG: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr,
    EARLY_B: tl.constexpr = False, QK_NORM: tl.constexpr = False, UNIT_OFFSET: tl.constexpr = False,
):
    if PDL:  # launched with programmatic dependent launch (kernels/tuning.py: Tuning.pdl)
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may launch, start on its weights
    t = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    q_cols = Hq * D
    # The part's heads, their first column in qkv and in their slice, and where they go.
    is_q = part < Q_PARTS
    is_k = part == Q_PARTS
    first = tl.where(is_q, part * Hkv, 0)
    n_heads = tl.where(is_q, tl.minimum(Hkv, Hq - part * Hkv), Hkv)
    col0 = tl.where(is_q, 0, tl.where(is_k, q_cols, q_cols + Hkv * D))
    slice_id = tl.where(is_q, 0, tl.where(is_k, 1, 2))
    if is_q:
        b_base, stride_br = bq_ptr, stride_br_q
        dst, stride_dh = q_out_ptr + t * stride_qo_t, stride_qo_h
    elif is_k:
        b_base, stride_br = bk_ptr, stride_br_kv
        slot_k = tl.load(slot_ptr + t).to(tl.int64)
        dst = k_cache_ptr + (slot_k // PAGE) * stride_kb + (slot_k % PAGE) * stride_kp
        stride_dh = stride_kh
    else:
        b_base, stride_br = bv_ptr, stride_br_kv
        slot_v = tl.load(slot_ptr + t).to(tl.int64)
        dst = v_cache_ptr + (slot_v // PAGE) * stride_vb + (slot_v % PAGE) * stride_vp
        stride_dh = stride_vh

    # The part's heads' first halves, flattened: (head, d) pairs as one vector over all the
    # warps, B read a rank row at a time over it (kernels/lora/expand_rows.py).
    idx = tl.arange(0, BLOCK_HG * BLOCK_HALF)
    heads = idx // BLOCK_HALF
    offs_d = idx % BLOCK_HALF
    mask = (heads < n_heads) & (offs_d < HALF)
    slice_col = (first + heads) * D + offs_d
    col = col0 + slice_col
    qkv_row = qkv_ptr + t * stride_qkv
    # No delta to add: a placeholder _half ignores.
    d1 = tl.zeros((BLOCK_HG * BLOCK_HALF,), dtype=tl.float32)
    d2 = d1
    if DENSE:
        if PDL:
            tl.extra.cuda.gdc_wait()
        dense_row = dense_ptr + t * stride_dense
        d1 = tl.load(dense_row + col, mask=mask, other=0.0)
        d2 = tl.load(dense_row + col + HALF, mask=mask, other=0.0)
    elif HAS_LORA:
        # The row's adapter's rank and first arena row on this slice come from the host
        # (copied before the step) and B from the arenas: neither is written by the kernel
        # ahead, so with EARLY_B they are read before the wait, while the projection's GEMM
        # still streams its weights. A row without an adapter has rank 0: nothing is read.
        lrow = lrows_ptr + t * stride_lrows + 2 * slice_id
        r_live = tl.minimum(tl.load(lrow), R)
        b_rows = b_base + tl.load(lrow + 1).to(tl.int64) * stride_br
        if PDL and not EARLY_B:
            tl.extra.cuda.gdc_wait()  # before reading what the kernel ahead of this one writes
        b1 = load_b_rows(b_rows, stride_br, slice_col, mask, r_live, BLOCK_R)
        b2 = load_b_rows(b_rows, stride_br, slice_col + HALF, mask, r_live, BLOCK_R)
        if PDL and EARLY_B:
            tl.extra.cuda.gdc_wait()
        h = load_sums(part_ptr + slice_id * stride_pslice + t * stride_pt, stride_ps, r_live,
                      SPLITS, BLOCK_R)
        d1 = expand_rows(h, b1, BLOCK_R)
        d2 = expand_rows(h, b2, BLOCK_R)
    elif PDL:
        tl.extra.cuda.gdc_wait()
    x1 = _half(qkv_row, d1, col, mask, HAS_LORA)
    x2 = _half(qkv_row, d2, col + HALF, mask, HAS_LORA)
    if QK_NORM and part <= Q_PARTS:  # each head RMS-normalised over its D columns, rounded
        dt = qkv_ptr.dtype.element_ty
        sq = tl.reshape(x1 * x1 + x2 * x2, (BLOCK_HG, BLOCK_HALF))
        rstd = 1.0 / tl.sqrt(tl.sum(sq, axis=1) / D + norm_eps)
        rstd = tl.reshape(tl.broadcast_to(rstd[:, None], (BLOCK_HG, BLOCK_HALF)), (BLOCK_HG * BLOCK_HALF,))
        w_ptr = qn_ptr if is_q else kn_ptr
        w1 = tl.load(w_ptr + offs_d, mask=mask, other=0.0)
        w2 = tl.load(w_ptr + offs_d + HALF, mask=mask, other=0.0)
        x1 = _weigh(x1.to(dt), rstd, w1, UNIT_OFFSET).to(dt).to(tl.float32)
        x2 = _weigh(x2.to(dt), rstd, w2, UNIT_OFFSET).to(dt).to(tl.float32)
    if part <= Q_PARTS:  # queries and keys rotate: (x1, x2) -> (x1 c1 - x2 s1, x2 c2 + x1 s2)
        pos = tl.load(pos_ptr + t)
        trig = pos * stride_cos + offs_d
        dmask = offs_d < HALF
        c1 = tl.load(cos_ptr + trig, mask=dmask, other=0.0)
        s1 = tl.load(sin_ptr + trig, mask=dmask, other=0.0)
        c2 = tl.load(cos_ptr + trig + HALF, mask=dmask, other=0.0)
        s2 = tl.load(sin_ptr + trig + HALF, mask=dmask, other=0.0)
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    else:
        y1 = x1
        y2 = x2
    out = dst + (first + heads) * stride_dh + offs_d
    tl.store(out, y1.to(dst.dtype.element_ty), mask=mask)
    tl.store(out + HALF, y2.to(dst.dtype.element_ty), mask=mask)


def rope_and_cache_triton(qkv: torch.Tensor, delta: LoraDelta | None, cos_table: torch.Tensor,
                          sin_table: torch.Tensor, positions: torch.Tensor,
                          slot_mapping: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, num_heads: int, num_kv_heads: int,
                          head_dim: int, *, num_warps: int = 4,
                          tuning: Tuning = DEFAULT_TUNING,
                          out: torch.Tensor | None = None,
                          qk_norm: QKNorm | None = None) -> torch.Tensor:
    """As rope_and_cache_ref (its qk_norm too), in one launch; the queries go to `out` where
    given."""
    T = qkv.shape[0]
    assert head_dim % 2 == 0, "RoPE needs an even head size"
    assert qkv.stride(1) == 1
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1, "a head's vector must be contiguous"
    assert cos_table.stride(1) == 1 and cos_table.stride() == sin_table.stride()
    assert k_cache.dtype == v_cache.dtype == qkv.dtype
    q = out if out is not None else torch.empty(T, num_heads, head_dim, dtype=qkv.dtype,
                                                device=qkv.device)
    assert q.shape == (T, num_heads, head_dim) and q.stride(2) == 1 and q.dtype == qkv.dtype
    if T == 0:
        return q
    dense = delta is not None and delta.expanded is not None
    if dense:
        assert delta.expanded.shape == qkv.shape and delta.expanded.stride(1) == 1
    if delta is not None:
        assert len(delta.b) == 3, "three slices: q, k and v"
        bq, bk, bv = delta.b
        part = delta.partials
        assert part.stride(3) == 1 and all(b.stride(1) == 1 for b in delta.b)
        assert bk.stride() == bv.stride() and delta.token_rows.stride(1) == 1
        lora = (part, bq, bk, bv, delta.token_rows)
        R, splits = part.shape[3], delta.splits
        lora_strides = (R, part.stride(0), part.stride(1), part.stride(2),
                        delta.token_rows.stride(0), bq.stride(0), bk.stride(0))
    else:
        lora = (qkv,) * 5  # dummy pointers, never read
        R, splits, lora_strides = 1, 0, (1,) + (0,) * 6
    q_parts = cdiv(num_heads, num_kv_heads)
    pdl = tuning.pdl_on(qkv)
    norm = (qk_norm.q_weight, qk_norm.k_weight, qk_norm.eps) if qk_norm is not None else (qkv, qkv, 0.0)
    if qk_norm is not None:
        assert qk_norm.q_weight.is_contiguous() and qk_norm.k_weight.is_contiguous()
    _rope_cache_kernel[(T, q_parts + 2)](
        qkv, cos_table, sin_table, positions, slot_mapping, q, k_cache, v_cache, *lora,
        delta.expanded if dense else qkv, *norm, qkv.stride(0),
        delta.expanded.stride(0) if dense else 0, q.stride(0), q.stride(1), cos_table.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *lora_strides,
        num_heads, num_kv_heads, head_dim, head_dim // 2, k_cache.shape[1], q_parts,
        SPLITS=splits, HAS_LORA=delta is not None, DENSE=dense, BLOCK_HG=next_power_of_2(num_kv_heads),
        BLOCK_HALF=next_power_of_2(head_dim // 2), BLOCK_R=next_power_of_2(R),
        PDL=pdl, EARLY_B=tuning.expand_early_b_on(qkv),
        QK_NORM=qk_norm is not None, UNIT_OFFSET=qk_norm is not None and qk_norm.unit_offset,
        num_warps=num_warps, **pdl_launch(pdl),
    )
    return q
