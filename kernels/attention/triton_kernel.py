"""Paged attention as a Triton kernel: mixed prefill/decode batches over block tables.

One program per (query tile, KV head[, KV split], sequence). The query heads that share a
KV head (GQA) are packed into the tile's rows, so each key/value tile is loaded once per
group; keys are gathered per position through the block table (any block size), with an
online softmax in fp32 (log2 domain).

Decode-heavy batches with few (sequence, KV head) pairs would leave most of the GPU idle
while a few programs walk long contexts: those split the keys into NUM_SPLITS ranges
(flash-decoding), write partial (max, sum, acc) in fp32, and a second small kernel merges them.

With a sliding window (Mistral, Gemma's local layers) a tile walks only the keys from its
first query's window on: the blocks behind it, which a request may have given back (their
table entries point at the scratch block), are never read, and the splits divide the window's
keys. Soft-capped scores (Gemma 2) are capped before the mask and the softmax, as transformers
does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..gemm.shapes import empty_rows
from ..host import cdiv, dot_f32, interpreting, next_power_of_2, num_sms, pdl_launch
from ..tuning import DEFAULT_TUNING, Tuning


_LOG2E = 1.4426950408889634
_NEG_BIG = tl.constexpr(-1.0e30)  # finite "minus infinity" for running maxima: exp2 of a difference stays 0/1
_LOG2E_IN_KERNEL = tl.constexpr(_LOG2E)  # a jit function reads only constexpr globals


# Launch arguments that follow a step's batch (the split count, the block table's width, the
# token count in the partials' stride) are not specialised: Triton would otherwise compile a
# new variant of the kernel for each new value class mid-serving (seconds, every request
# waiting). Whether the keys are split at all is a constexpr: two variants.
_ATTENTION_DYNAMIC = ["NUM_SPLITS", "stride_btb", "stride_ps"]
_MERGE_DYNAMIC = ["NUM_SPLITS", "stride_ps"]


@triton.jit
def _attend_tile(q, k, v, offs_n, mask_n, pos, qk_scale, m_i, l_i, acc, window, softcap,
                 DOT_F32: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """One key tile of the online softmax: the running (max, sum, acc) after keys offs_n."""
    if DOT_F32:
        qk = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k.to(q.dtype)))
    visible = mask_n[None, :] & (offs_n[None, :] <= pos[:, None])
    if HAS_WINDOW:  # the last `window` keys of each query, its own included
        visible = visible & (offs_n[None, :] > pos[:, None] - window)
    if HAS_SOFTCAP:  # cap * tanh(score / cap), the score in natural units, then to log2's
        capped = qk * (qk_scale / _LOG2E_IN_KERNEL) / softcap
        qk = (2.0 / (1.0 + tl.exp(-2.0 * capped)) - 1.0) * (softcap * _LOG2E_IN_KERNEL)
    else:
        qk = qk * qk_scale
    qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if DOT_F32:
        acc += tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc += tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=_ATTENTION_DYNAMIC)
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, qsl_ptr, seq_lens_ptr,
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
    qk_scale, head_dim, NUM_SPLITS, window, softcap,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_kp, stride_kh, stride_kd,
    stride_vb, stride_vp, stride_vh, stride_vd,
    stride_btb, stride_btn,
    stride_ot, stride_oh, stride_od,
    stride_ps, stride_pt, stride_ph,
    PAGE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, SPLIT: tl.constexpr, DOT_F32: tl.constexpr,
    PDL: tl.constexpr, EARLY_KV: tl.constexpr,
    HAS_WINDOW: tl.constexpr = False, HAS_SOFTCAP: tl.constexpr = False,
):
    if PDL:  # launched with programmatic dependent launch (kernels/tuning.py: Tuning.pdl)
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may launch, start on its weights
        if not EARLY_KV:
            tl.extra.cuda.gdc_wait()  # before reading what the kernel ahead of this one writes
    # Row r of the tile: query q0 + r // GROUP_PAD, head kv_head * GROUP + r % GROUP_PAD.
    # A sequence's KV heads (and splits) launch side by side: they read the same pages (a
    # page holds every head's keys of its positions), so together they read whole pages.
    # The step's metadata (query starts, lengths, block tables) is written before the step's
    # first kernel, so it may be read before the wait.
    pid_q = tl.program_id(0)
    pid_2 = tl.program_id(1)
    seq = tl.program_id(2)
    kv_head = pid_2 // NUM_SPLITS
    split = pid_2 % NUM_SPLITS

    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    q0 = pid_q * BLOCK_Q
    if q0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx0 = seq_len - q_len  # absolute position of the sequence's first new token

    rows = tl.arange(0, BLOCK_M)
    qi = q0 + rows // GROUP_PAD
    g = rows % GROUP_PAD
    row_valid = (qi < q_len) & (g < GROUP)
    head = kv_head * GROUP + g
    pos = ctx0 + qi
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    tok = (q_start + qi).to(tl.int64)
    qmask = row_valid[:, None] & mask_d[None, :]

    # Keys this tile needs: up to its last query's position; this split's share of them (the
    # splits divide each sequence's own keys, so a graph sized for the longest context allowed
    # still spreads a short one over all of its splits).
    kv_end = ctx0 + tl.minimum(q0 + BLOCK_Q, q_len)
    kv_start = 0
    if HAS_WINDOW:  # nothing before the tile's first query's window
        kv_start = tl.maximum(ctx0 + q0 - window + 1, 0)
    split_len = tl.cdiv(tl.cdiv(kv_end - kv_start, NUM_SPLITS), BLOCK_N) * BLOCK_N
    kv_lo = kv_start + split * split_len
    kv_hi = tl.minimum(kv_end, kv_lo + split_len)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_btb

    # The first key tile. Keys before ctx0 were written by earlier steps, not by the kernel
    # ahead (RoPE + KV write writes the new tokens' slots only): with EARLY_KV they are
    # loaded before the wait, so their latency (block table, then keys) overlaps that
    # kernel; the new tokens' keys in the tile are loaded after it.
    offs_n = kv_lo + tl.arange(0, BLOCK_N)
    mask_n = offs_n < kv_hi
    blk = tl.load(bt_row + (offs_n // PAGE) * stride_btn, mask=mask_n, other=0).to(tl.int64)
    in_blk = (offs_n % PAGE).to(tl.int64)
    k_ptrs = k_ptr + (blk * stride_kb + in_blk * stride_kp + kv_head * stride_kh)[:, None] \
        + offs_d[None, :] * stride_kd
    v_ptrs = v_ptr + (blk * stride_vb + in_blk * stride_vp + kv_head * stride_vh)[:, None] \
        + offs_d[None, :] * stride_vd
    old = (mask_n & (offs_n < ctx0))[:, None] & mask_d[None, :]
    k = tl.load(k_ptrs, mask=old, other=0.0)
    v = tl.load(v_ptrs, mask=old, other=0.0)
    # Block ids are read one tile ahead: a tile's keys then wait for one memory latency, not
    # for the block-table read and then the keys.
    ahead = offs_n + BLOCK_N
    next_blk = tl.load(bt_row + (ahead // PAGE) * stride_btn, mask=ahead < kv_hi, other=0)
    if PDL and EARLY_KV:
        tl.extra.cuda.gdc_wait()  # q and the new tokens' keys are the kernel ahead's output
    new = (mask_n & (offs_n >= ctx0))[:, None] & mask_d[None, :]
    k = tl.where(new, tl.load(k_ptrs, mask=new, other=0.0), k)
    v = tl.where(new, tl.load(v_ptrs, mask=new, other=0.0), v)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh
                + offs_d[None, :] * stride_qd, mask=qmask, other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)

    m_i = tl.full((BLOCK_M,), _NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    m_i, l_i, acc = _attend_tile(q, k, v, offs_n, mask_n, pos, qk_scale, m_i, l_i, acc, window, softcap,
                                 DOT_F32, HAS_WINDOW, HAS_SOFTCAP)
    for n0 in range(kv_lo + BLOCK_N, kv_hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < kv_hi
        blk = next_blk.to(tl.int64)
        ahead = offs_n + BLOCK_N
        next_blk = tl.load(bt_row + (ahead // PAGE) * stride_btn, mask=ahead < kv_hi, other=0)
        in_blk = (offs_n % PAGE).to(tl.int64)
        k_off = blk * stride_kb + in_blk * stride_kp + kv_head * stride_kh
        v_off = blk * stride_vb + in_blk * stride_vp + kv_head * stride_vh
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_ptr + k_off[:, None] + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        m_i, l_i, acc = _attend_tile(q, k, v, offs_n, mask_n, pos, qk_scale, m_i, l_i, acc, window,
                                     softcap, DOT_F32, HAS_WINDOW, HAS_SOFTCAP)

    if not SPLIT:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh
                 + offs_d[None, :] * stride_od, out.to(out_ptr.dtype.element_ty), mask=qmask)
    else:  # partials, merged by _merge_splits_kernel (empty splits store m=-big, l=0)
        p_row = split.to(tl.int64) * stride_ps + tok * stride_pt + head * stride_ph
        tl.store(part_acc_ptr + p_row[:, None] * head_dim + offs_d[None, :], acc, mask=qmask)
        tl.store(part_m_ptr + p_row, m_i, mask=row_valid)
        tl.store(part_l_ptr + p_row, l_i, mask=row_valid)


@triton.jit(do_not_specialize=_MERGE_DYNAMIC)
def _merge_splits_kernel(
    part_acc_ptr, part_m_ptr, part_l_ptr, out_ptr, head_dim, NUM_SPLITS,
    stride_ps, stride_pt, stride_ph,
    stride_ot, stride_oh, stride_od,
    SPLITS_PAD: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # launched with programmatic dependent launch (kernels/tuning.py: Tuning.pdl)
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may launch, start on its weights
        tl.extra.cuda.gdc_wait()  # before reading what the kernel ahead of this one writes
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    mask_s = splits < NUM_SPLITS
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    p_row = splits.to(tl.int64) * stride_ps + tok * stride_pt + head * stride_ph
    m = tl.load(part_m_ptr + p_row, mask=mask_s, other=_NEG_BIG)
    l = tl.load(part_l_ptr + p_row, mask=mask_s, other=0.0)
    acc = tl.load(part_acc_ptr + p_row[:, None] * head_dim + offs_d[None, :],
                  mask=mask_s[:, None] & mask_d[None, :], other=0.0)
    m_max = tl.max(m, 0)
    w = tl.where(mask_s, tl.exp2(m - m_max), 0.0)
    denom = tl.sum(l * w, 0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(out_ptr + tok * stride_ot + head * stride_oh + offs_d * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=mask_d)


SPLIT_KEYS_PAST = 512  # decode-like batches split a context's keys only past this many
# The most key splits a launch takes. The merge always walks a tile of this many splits
# (masked past the real count): one compiled merge for every split count, so no count first
# met under requests compiles (the start-up warm-up cannot reach them all).
MAX_SPLITS = 64


def _auto_splits(device: torch.device, programs: int, max_query_len: int,
                 max_seq_len: int) -> int:
    """Split the keys only for decode-like batches that would not fill the GPU otherwise."""
    if device.type != "cuda" or max_query_len > 16 or max_seq_len <= SPLIT_KEYS_PAST:
        return 1
    sms = num_sms(device)
    want = (2 * sms + programs - 1) // programs
    return max(1, min(want, cdiv(max_seq_len, 256), MAX_SPLITS))


def key_block(block_d: int, max_query_len: int, on_gpu: bool, tuning: Tuning, tile: int | None = None) -> int:
    """Keys a program's tile holds. Decode tiles hold a fixed number of elements (`tile`, else
    the tuning's): on an H100 at batch 64, 32 keys of 128-wide heads (8B's) beat 64 by 2.7 µs
    a launch (29.7 → 27.0), while 64-wide heads (1B's) ran within 0.4 µs from 32 to 256 keys."""
    if not on_gpu:
        return 32  # the interpreter: small tiles run fastest
    if max_query_len > 16:
        # 64 keys of heads up to 128 wide; 32 of Gemma 2's 256-wide heads, whose 64-key K and
        # V tiles over the pipeline's stages would need 288 KB of shared memory (Hopper: 227).
        return max(16, min(64, 8192 // block_d))
    return max(16, min(256, (tile or tuning.attention_decode_key_tile) // block_d))


def paged_attention_triton_impl(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
    scale: float, max_query_len: int, max_seq_len: int, *,
    num_splits: int | None = None, block_n: int | None = None, num_warps: int | None = None,
    num_stages: int | None = None, early_kv: bool | None = None,
    tuning: Tuning = DEFAULT_TUNING, out: torch.Tensor | None = None,
    window: int = 0, softcap: float = 0.0,
) -> torch.Tensor:
    """paged_attention_triton with the tiling knobs exposed (tests force splits and tiles).
    early_kv: with PDL, load the first tile's older keys before waiting for the kernel ahead
    (None: the tuning's attention_early_kv)."""
    T, num_heads, head_dim = q.shape
    page, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    batch = block_tables.shape[0]
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    if out is None:
        out = empty_rows(T, num_heads, head_dim, dtype=q.dtype, device=q.device)  # o's x: tma_rows
    assert out.shape == q.shape and out.dtype == q.dtype
    if T == 0 or batch == 0 or max_query_len <= 0:
        return out
    group = num_heads // num_kv_heads
    group_pad = next_power_of_2(group)
    block_d = max(16, next_power_of_2(head_dim))
    target_m = 64 if max_query_len > 16 else 16
    block_q = max(1, target_m // group_pad)
    block_q = min(block_q, next_power_of_2(max_query_len))
    block_q = max(block_q, cdiv(16, group_pad))  # tl.dot needs >= 16 rows
    # A decode step's launch as the tuner measured it for its rows (Tuning.attention_decode_launches)
    launch = tuning.attention_decode_launch(T) if max_query_len <= 16 else None
    tile = None
    if launch is not None:  # zeros: the rule's
        tile, warps, stages = launch
        num_warps, num_stages = num_warps or warps or None, num_stages or stages or None
    if block_n is None:
        block_n = key_block(block_d, max_query_len, q.is_cuda and not interpreting(), tuning, tile)
    q_tiles = cdiv(max_query_len, block_q)
    if num_splits is None:
        num_splits = _auto_splits(q.device, q_tiles * batch * num_kv_heads, max_query_len,
                                  max_seq_len)
    num_splits = max(1, min(num_splits, cdiv(max(max_seq_len, 1), block_n), MAX_SPLITS))

    if num_splits > 1:
        part_acc = torch.empty(num_splits, T, num_heads, head_dim, dtype=torch.float32,
                               device=q.device)
        part_m = torch.empty(num_splits, T, num_heads, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        p_strides = part_m.stride()
    else:
        part_acc = part_m = part_l = out  # unused
        p_strides = (0, 0, 0)

    # Heads inner: a sequence's programs launch side by side (measured faster on an H100).
    grid = (q_tiles, num_kv_heads * num_splits, batch)
    pdl = tuning.pdl_on(q)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
        out, part_acc, part_m, part_l,
        scale * _LOG2E, head_dim, num_splits, max(window, 0), float(softcap) or 1.0,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        block_tables.stride(0), block_tables.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        *p_strides,
        PAGE=page, GROUP=group, GROUP_PAD=group_pad,
        BLOCK_Q=block_q, BLOCK_M=block_q * group_pad, BLOCK_N=block_n, BLOCK_D=block_d,
        SPLIT=num_splits > 1, PDL=pdl, **pdl_launch(pdl),
        HAS_WINDOW=window > 0, HAS_SOFTCAP=softcap > 0,
        EARLY_KV=pdl and (early_kv if early_kv is not None else tuning.attention_early_kv_on(q)),
        DOT_F32=dot_f32(q.dtype, q.device),
        num_warps=num_warps or (4 if block_q * group_pad * block_d <= 64 * 128 else 8),
        **({"num_stages": num_stages} if num_stages else {}),
    )
    if num_splits > 1:
        _merge_splits_kernel[(T, num_heads)](
            part_acc, part_m, part_l, out, head_dim, num_splits,
            *p_strides,
            out.stride(0), out.stride(1), out.stride(2),
            SPLITS_PAD=MAX_SPLITS,
            BLOCK_D=block_d, PDL=pdl, **pdl_launch(pdl),
        )
    return out


def paged_attention_triton(
    q: torch.Tensor,               # [T, Hq, D]: new tokens of all sequences, concatenated
    k_cache: torch.Tensor,         # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,         # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,    # [B, max_blocks] int32 (unused entries: any valid block)
    query_start_loc: torch.Tensor, # [B + 1] int32: sequence b's queries are q[start[b]:start[b+1]]
    seq_lens: torch.Tensor,        # [B] int32: context length of b, its new tokens included
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    *, tuning: Tuning = DEFAULT_TUNING, out: torch.Tensor | None = None,
    window: int = 0, softcap: float = 0.0,
) -> torch.Tensor:
    """Causal attention of each new token over its sequence's cached keys, within its
    `window` where > 0, its scores soft-capped where `softcap` > 0 (see the reference), into
    `out` where given."""
    return paged_attention_triton_impl(q, k_cache, v_cache, block_tables, query_start_loc,
                                       seq_lens, scale, max_query_len, max_seq_len, tuning=tuning,
                                       out=out, window=window, softcap=softcap)
