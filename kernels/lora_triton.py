"""Multi-LoRA shrink/expand as Triton kernels: one launch per call for all adapters and slices.

Grid: (token tiles of a segment, segment, slice x output tiles). Segments are the groups of
tokens sharing an adapter slot (LoraBatchMeta), so every program reads a single slot's A/B
tile and the launch is sized from host integers only (no device sync).

The slices of a fused projection (q/k/v, gate/up) are separate tensors. The kernel gets the
first one as its pointer argument and, per slice, the element offset of the others from it
(a small cached int64 table): plain pointer arithmetic, which behaves the same on the GPU and
in Triton's interpreter, and keeps 16-element alignment known to the compiler when it holds.
"""
from __future__ import annotations

import os
from typing import Sequence

import torch
import triton
import triton.language as tl

from .lora_meta import LoraBatchMeta

_TABLE_CACHE: dict[tuple, torch.Tensor] = {}
_TABLE_CACHE_MAX = 1024


@triton.jit
def _lora_shrink_kernel(
    x_ptr, a_ptr, table_ptr, out_ptr, scaling_ptr, ranks_ptr,
    sorted_ids_ptr, seg_slots_ptr, seg_starts_ptr, seg_lens_ptr,
    K, R,
    stride_xt, stride_xk,
    stride_as, stride_ar, stride_ak,
    stride_os, stride_ot, stride_or,
    HAS_RANKS: tl.constexpr, OFF_UNIT: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    pid_m = tl.program_id(0)
    seg = tl.program_id(1)
    pid_2 = tl.program_id(2)
    slice_id = pid_2 // SPLIT_K
    split = pid_2 % SPLIT_K

    seg_len = tl.load(seg_lens_ptr + seg)
    m0 = pid_m * BLOCK_M
    if m0 >= seg_len:
        return
    slot = tl.load(seg_slots_ptr + seg)
    if HAS_RANKS:
        rank = tl.minimum(tl.load(ranks_ptr + slot), R)
    else:
        rank = R
    if rank <= 0:
        return  # rows stay zero (the output is zero-initialised)
    seg_start = tl.load(seg_starts_ptr + seg)

    offs_m = m0 + tl.arange(0, BLOCK_M)
    mask_m = offs_m < seg_len
    tok = tl.load(sorted_ids_ptr + seg_start + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < rank

    a_off = tl.load(table_ptr + slice_id) * OFF_UNIT
    a_base = a_ptr + a_off + slot.to(tl.int64) * stride_as
    x_rows = x_ptr + tok[:, None] * stride_xt
    a_cols = a_base + offs_r[None, :].to(tl.int64) * stride_ar

    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(split * BLOCK_K, K, BLOCK_K * SPLIT_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        xt = tl.load(x_rows + offs_k[None, :] * stride_xk,
                     mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        at = tl.load(a_cols + offs_k[:, None] * stride_ak,
                     mask=mask_k[:, None] & mask_r[None, :], other=0.0)  # [BLOCK_K, BLOCK_R]
        if DOT_F32:
            acc += tl.dot(xt.to(tl.float32), at.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(xt, at.to(xt.dtype))
    acc *= tl.load(scaling_ptr + slot).to(tl.float32)

    out_ptrs = (out_ptr + slice_id.to(tl.int64) * stride_os + tok[:, None] * stride_ot
                + offs_r[None, :] * stride_or)
    out_mask = mask_m[:, None] & mask_r[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc, mask=out_mask)
    else:
        tl.atomic_add(out_ptrs, acc, mask=out_mask)


@triton.jit
def _lora_expand_kernel(
    h_ptr, b_ptr, table_ptr, y_ptr, ranks_ptr,
    sorted_ids_ptr, seg_slots_ptr, seg_starts_ptr, seg_lens_ptr,
    R, N_TILES,
    stride_hs, stride_ht, stride_hr,
    stride_bn, stride_br,
    stride_yt, stride_yn,
    HAS_RANKS: tl.constexpr, OFF_UNIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    pid_m = tl.program_id(0)
    seg = tl.program_id(1)
    pid_2 = tl.program_id(2)
    slice_id = pid_2 // N_TILES
    pid_n = pid_2 % N_TILES

    # Per-slice row of the table: offset of B_i from b_ptr, out_i, column in y, B_i's slot stride.
    row = table_ptr + slice_id * 4
    b_off = tl.load(row) * OFF_UNIT
    n_out = tl.load(row + 1)
    y_col = tl.load(row + 2)
    stride_bs = tl.load(row + 3)

    seg_len = tl.load(seg_lens_ptr + seg)
    m0 = pid_m * BLOCK_M
    n0 = pid_n * BLOCK_N
    if (m0 >= seg_len) | (n0 >= n_out):
        return
    slot = tl.load(seg_slots_ptr + seg)
    if HAS_RANKS:
        rank = tl.minimum(tl.load(ranks_ptr + slot), R)
    else:
        rank = R
    if rank <= 0:
        return  # a zero delta: y is left untouched
    seg_start = tl.load(seg_starts_ptr + seg)

    offs_m = m0 + tl.arange(0, BLOCK_M)
    mask_m = offs_m < seg_len
    tok = tl.load(sorted_ids_ptr + seg_start + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < n_out

    h_rows = h_ptr + slice_id.to(tl.int64) * stride_hs + tok[:, None] * stride_ht
    b_base = b_ptr + b_off + slot.to(tl.int64) * stride_bs
    b_cols = b_base + offs_n[None, :].to(tl.int64) * stride_bn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        mask_r = offs_r < rank
        ht = tl.load(h_rows + offs_r[None, :] * stride_hr,
                     mask=mask_m[:, None] & mask_r[None, :], other=0.0)
        bt = tl.load(b_cols + offs_r[:, None] * stride_br,
                     mask=mask_r[:, None] & mask_n[None, :], other=0.0)  # [BLOCK_R, BLOCK_N]
        if DOT_F32:
            acc += tl.dot(ht, bt.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(ht.to(bt.dtype), bt)

    y_ptrs = y_ptr + tok[:, None] * stride_yt + (y_col + offs_n)[None, :].to(tl.int64) * stride_yn
    y_mask = mask_m[:, None] & mask_n[None, :]
    y_old = tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y_old + acc).to(y_ptr.dtype.element_ty), mask=y_mask)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _dot_f32(dtype: torch.dtype, device: torch.device) -> bool:
    """fp32 operands: exact fp32 products (no TF32) so fp32 results match the reference.
    Also on CPU/in the interpreter, whose tl.dot reads bf16 as raw uint16 (triton 3.9)."""
    return dtype == torch.float32 or device.type != "cuda" or interpreting()


def _block_m(max_segment_len: int) -> int:
    return 16 if max_segment_len <= 16 else 32 if max_segment_len <= 32 else 64


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _offset_table(tensors: Sequence[torch.Tensor], extra: Sequence[Sequence[int]],
                  device: torch.device) -> tuple[torch.Tensor, int]:
    """Device int64 table: row i = (offset of tensors[i] from tensors[0] in OFF_UNIT elements,
    *extra[i]). Cached by addresses/sizes: the slot buffers live as long as the engine."""
    base = tensors[0].data_ptr()
    esize = tensors[0].element_size()
    deltas = [t.data_ptr() - base for t in tensors]
    unit = 16 if all(d % (16 * esize) == 0 for d in deltas) else 1
    rows = tuple((d // (esize * unit), *e) for d, e in zip(deltas, extra))
    key = (device, base, esize, unit, rows)
    table = _TABLE_CACHE.get(key)
    if table is None:
        if len(_TABLE_CACHE) >= _TABLE_CACHE_MAX:
            _TABLE_CACHE.clear()
        table = torch.tensor(rows, dtype=torch.int64, device=device).reshape(-1)
        _TABLE_CACHE[key] = table
    return table, unit


def _uniform(tensors: Sequence[torch.Tensor], dims: Sequence[int]) -> list[torch.Tensor]:
    """Same dtype and same strides on `dims` for all slices (made contiguous if not)."""
    ref = tensors[0]
    ok = all(t.dtype == ref.dtype and all(t.stride(d) == ref.stride(d) for d in dims)
             for t in tensors)
    if ok:
        return list(tensors)
    dtype = ref.dtype
    return [t.to(dtype).contiguous() for t in tensors]


def lora_shrink_triton(x: torch.Tensor, a_stacked: Sequence[torch.Tensor], meta: LoraBatchMeta,
                       scaling: torch.Tensor, slot_ranks: torch.Tensor | None = None, *,
                       split_k: int | None = None) -> torch.Tensor:
    """[n_slices, T, R] float32 = x @ A_i[slot].T * scaling[slot]; rows of slot -1 are zero."""
    n_slices = len(a_stacked)
    T, K = x.shape
    S, R, K_a = a_stacked[0].shape
    assert K_a == K, f"A has in-features {K_a}, x has {K}"
    assert all(a.shape == (S, R, K) for a in a_stacked), "A slices must share [S, R, H_in]"
    out = torch.zeros(n_slices, T, R, dtype=torch.float32, device=x.device)
    if meta.num_segments == 0 or T == 0 or R == 0:
        return out
    a_list = _uniform(a_stacked, (0, 1, 2))
    table, unit = _offset_table(a_list, [()] * n_slices, x.device)

    block_m = _block_m(meta.max_segment_len)
    block_r = max(16, triton.next_power_of_2(R))
    block_k = 128 if block_r <= 32 else 64 if block_r <= 128 else 32
    block_k = min(block_k, max(16, triton.next_power_of_2(K)))
    m_tiles = triton.cdiv(meta.max_segment_len, block_m)
    k_tiles = triton.cdiv(K, block_k)
    if split_k is None:  # decode: few programs, so split the reduction over H_in (atomics)
        split_k = max(1, min(k_tiles, 2 * _num_sms(x.device) // (m_tiles * meta.num_segments
                                                                   * n_slices)))
    split_k = max(1, min(split_k, k_tiles))
    ranks = slot_ranks if slot_ranks is not None else scaling  # dummy pointer when unused
    grid = (m_tiles, meta.num_segments, n_slices * split_k)
    _lora_shrink_kernel[grid](
        x, a_list[0], table, out, scaling, ranks,
        meta.sorted_token_ids, meta.segment_slots, meta.segment_starts, meta.segment_lens,
        K, R,
        x.stride(0), x.stride(1),
        a_list[0].stride(0), a_list[0].stride(1), a_list[0].stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        HAS_RANKS=slot_ranks is not None, OFF_UNIT=unit, SPLIT_K=split_k,
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k, DOT_F32=_dot_f32(x.dtype, x.device),
        num_warps=4,
    )
    return out


def lora_expand_triton(h: torch.Tensor, b_stacked: Sequence[torch.Tensor], meta: LoraBatchMeta,
                       y: torch.Tensor, slice_offsets: Sequence[int],
                       slot_ranks: torch.Tensor | None = None) -> None:
    """y[t, off_i:off_i+out_i] += h[i, t] @ B_i[slot_t].T in place; slot -1 rows untouched."""
    n_slices = len(b_stacked)
    assert h.shape[0] >= n_slices and len(slice_offsets) == n_slices
    T, R = h.shape[1], h.shape[2]
    if meta.num_segments == 0 or T == 0 or R == 0:
        return
    for b, off in zip(b_stacked, slice_offsets):
        assert b.shape[2] == R, f"B has rank {b.shape[2]}, h has {R}"
        assert 0 <= off and off + b.shape[1] <= y.shape[1], "slice outside y's columns"
    b_list = _uniform(b_stacked, (1, 2))
    extra = [(b.shape[1], off, b.stride(0)) for b, off in zip(b_list, slice_offsets)]
    table, unit = _offset_table(b_list, extra, y.device)

    block_m = _block_m(meta.max_segment_len)
    block_n = 64 if meta.max_segment_len <= 64 else 128
    block_r = min(64, max(16, triton.next_power_of_2(R)))
    max_out = max(b.shape[1] for b in b_list)
    n_tiles = triton.cdiv(max_out, block_n)
    ranks = slot_ranks if slot_ranks is not None else h  # dummy pointer when unused
    grid = (triton.cdiv(meta.max_segment_len, block_m), meta.num_segments, n_slices * n_tiles)
    _lora_expand_kernel[grid](
        h, b_list[0], table, y, ranks,
        meta.sorted_token_ids, meta.segment_slots, meta.segment_starts, meta.segment_lens,
        R, n_tiles,
        h.stride(0), h.stride(1), h.stride(2),
        b_list[0].stride(1), b_list[0].stride(2),
        y.stride(0), y.stride(1),
        HAS_RANKS=slot_ranks is not None, OFF_UNIT=unit,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r,
        DOT_F32=_dot_f32(b_list[0].dtype, y.device),
        num_warps=4,
    )
