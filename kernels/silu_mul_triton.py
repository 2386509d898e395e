"""SiLU(gate) * up with the gate/up LoRA delta expanded in, in one Triton launch.

Programs cover (row, a span of the intermediate columns): each reads its gate and up columns,
expands the row's delta for them from the shrink's partial sums and the adapter's B columns
(kernels/lora_delta.py), or adds the delta already expanded, and writes the activation. Rows
without an adapter skip the B reads.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ._host import cdiv, early_b_enabled, next_power_of_2, pdl_enabled, pdl_launch

from .lora_delta import LoraDelta

# Whether SiLU with a LoRA delta to expand takes rows two to a program (silu_mul_triton).
SILU_PAIRS = False


def silu_pairs() -> bool:
    """LORA_SILU_PAIRS (1 or 0): SILU_PAIRS overridden."""
    return os.environ.get("LORA_SILU_PAIRS", "1" if SILU_PAIRS else "0") == "1"


@triton.jit
def _b_tile(b_rows, stride_bn, offs, mask, offs_r, r_live):
    """B's rows for columns `offs` [columns, rank]; r_live: the rank columns to read, 0 for a
    row without an adapter (nothing read, zeros)."""
    return tl.load(b_rows + offs[:, None] * stride_bn + offs_r[None, :],
                   mask=mask[:, None] & (offs_r[None, :] < r_live), other=0.0)


@triton.jit
def _expanded(x, h, b):
    """x (a row's columns of one slice) plus h @ b.T (b: _b_tile), rounded once to x's dtype."""
    return (x.to(tl.float32) + tl.sum(b.to(tl.float32) * h[None, :], axis=1)).to(x.dtype)


@triton.jit
def _row_sums(part_row, stride_ps, stride_pslice, offs_r, r_live, SPLITS: tl.constexpr,
              BLOCK_R: tl.constexpr):
    """A row's gate and up sums (the shrink's splits added); none read for a row without an
    adapter (r_live 0: they may be unwritten, kernels/lora_gemm.py: GemmLora.unexpanded)."""
    h_g = tl.zeros((BLOCK_R,), dtype=tl.float32)
    h_u = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        h_g += tl.load(part_row + s * stride_ps, mask=offs_r < r_live, other=0.0)
        h_u += tl.load(part_row + s * stride_ps + stride_pslice, mask=offs_r < r_live, other=0.0)
    return h_g, h_u


@triton.jit
def _store_act(act_ptr, t, stride_act, offs, mask, g, u):
    """SiLU(g) * u of a row's columns, rounded as F.silu and the product round."""
    gf = g.to(tl.float32)
    silu = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    act = silu.to(tl.float32) * u.to(tl.float32)
    tl.store(act_ptr + t * stride_act + offs, act.to(act_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_kernel(
    gu_ptr, act_ptr, part_ptr, bg_ptr, bu_ptr, slots_ptr, dense_ptr,
    T, I, R,
    stride_gu, stride_act, stride_ps, stride_pslice, stride_pt,
    stride_bgs, stride_bgn, stride_bus, stride_bun, stride_dense,
    SPLITS: tl.constexpr, HAS_LORA: tl.constexpr, DENSE: tl.constexpr, BLOCK_I: tl.constexpr,
    BLOCK_R: tl.constexpr, PDL: tl.constexpr, EARLY_B: tl.constexpr = False,
    PAIRS: tl.constexpr = False,
):
    if PDL:  # launched with programmatic dependent launch (kernels/_host.py: pdl_enabled)
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may launch, start on its weights
    offs = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = offs < I
    if HAS_LORA and not DENSE:  # straight-line: the row's loads go out together
        # PAIRS: a program takes rows 2p and 2p + 1 and reads B once where both rows have the
        # same adapter (graph steps group rows by adapter), its own B for the second row only
        # where the adapters differ.
        t = (tl.program_id(0) * (2 if PAIRS else 1)).to(tl.int64)
        offs_r = tl.arange(0, BLOCK_R)
        # The rows' adapter slots come from the host (copied before the step) and B from the
        # slot pool: neither is written by the kernel ahead, so with EARLY_B they are read
        # before the wait, while the gate/up GEMM still streams its weights.
        slot = tl.load(slots_ptr + t)
        safe = tl.maximum(slot, 0).to(tl.int64)
        r_live = tl.where(slot >= 0, R, 0)
        if PAIRS:
            has_next = t + 1 < T
            slot_n = tl.load(slots_ptr + t + 1, mask=has_next, other=-1)
            same = slot_n == slot
            safe_n = tl.maximum(slot_n, 0).to(tl.int64)
            r_next = tl.where(slot_n >= 0, R, 0)
            r_own = tl.where(same, 0, r_next)  # B of its own only for another adapter
        if PDL and not EARLY_B:
            tl.extra.cuda.gdc_wait()  # before reading what the kernel ahead of this one writes
        b_g = _b_tile(bg_ptr + safe * stride_bgs, stride_bgn, offs, mask, offs_r, r_live)
        b_u = _b_tile(bu_ptr + safe * stride_bus, stride_bun, offs, mask, offs_r, r_live)
        if PAIRS:
            b_gn = _b_tile(bg_ptr + safe_n * stride_bgs, stride_bgn, offs, mask, offs_r, r_own)
            b_un = _b_tile(bu_ptr + safe_n * stride_bus, stride_bun, offs, mask, offs_r, r_own)
        if PDL and EARLY_B:
            tl.extra.cuda.gdc_wait()
        h_g, h_u = _row_sums(part_ptr + t * stride_pt + offs_r, stride_ps, stride_pslice, offs_r,
                             r_live, SPLITS, BLOCK_R)
        g = tl.load(gu_ptr + t * stride_gu + offs, mask=mask, other=0.0)
        u = tl.load(gu_ptr + t * stride_gu + I + offs, mask=mask, other=0.0)
        _store_act(act_ptr, t, stride_act, offs, mask, _expanded(g, h_g, b_g),
                   _expanded(u, h_u, b_u))
        if PAIRS:
            h_gn, h_un = _row_sums(part_ptr + (t + 1) * stride_pt + offs_r, stride_ps,
                                   stride_pslice, offs_r, r_next, SPLITS, BLOCK_R)
            mask_n = mask & (offs * 0 + t + 1 < T)  # (a vector: the interpreter takes no scalar here)
            g = tl.load(gu_ptr + (t + 1) * stride_gu + offs, mask=mask_n, other=0.0)
            u = tl.load(gu_ptr + (t + 1) * stride_gu + I + offs, mask=mask_n, other=0.0)
            _store_act(act_ptr, t + 1, stride_act, offs, mask_n,
                       _expanded(g, h_gn, tl.where(same, b_g, b_gn)),
                       _expanded(u, h_un, tl.where(same, b_u, b_un)))
    else:
        t = tl.program_id(0).to(tl.int64)
        if PDL:
            tl.extra.cuda.gdc_wait()
        g = tl.load(gu_ptr + t * stride_gu + offs, mask=mask, other=0.0)
        u = tl.load(gu_ptr + t * stride_gu + I + offs, mask=mask, other=0.0)
        if DENSE:  # the delta, expanded beside the matmul: [T, 2I] float32
            dg = tl.load(dense_ptr + t * stride_dense + offs, mask=mask, other=0.0)
            du = tl.load(dense_ptr + t * stride_dense + I + offs, mask=mask, other=0.0)
            g = (g.to(tl.float32) + dg).to(g.dtype)
            u = (u.to(tl.float32) + du).to(u.dtype)
        _store_act(act_ptr, t, stride_act, offs, mask, g, u)


def silu_mul_triton(gate_up: torch.Tensor, delta: LoraDelta | None = None, *,
                    block_i: int | None = None, num_warps: int | None = None,
                    pairs: bool | None = None) -> torch.Tensor:
    """As silu_mul_ref.silu_mul with delta.dense(), in one launch. block_i: columns per
    program. With a delta the defaults (512 columns, 2 warps) are the sweep's best for 32
    adapters on an H100 at batch 64: 11.6 -> 10.4 us against 256 columns and 4 warps
    (bench/decode_kernels_sweep.py --parts fused). pairs (with an unexpanded delta): each
    program takes two rows, reading B once where they share an adapter (None:
    LORA_SILU_PAIRS, default SILU_PAIRS). LORA_SILU_WARPS: the default warps a program with
    an unexpanded delta, for measuring."""
    T, two_i = gate_up.shape
    I = two_i // 2
    assert gate_up.stride(1) == 1
    act = torch.empty(T, I, dtype=gate_up.dtype, device=gate_up.device)
    if T == 0:
        return act
    dense = delta is not None and delta.expanded is not None
    if dense:
        assert delta.expanded.shape == (T, two_i) and delta.expanded.stride(1) == 1
    if delta is not None:
        assert len(delta.b) == 2, "two slices: gate and up"
        bg, bu = delta.b
        part = delta.partials
        assert bg.shape[1] == I and bu.shape[1] == I and bg.stride(2) == 1 and bu.stride(2) == 1
        assert part.stride(3) == 1
        lora = (part, bg, bu, delta.token_slots)
        lora_strides = (part.stride(0), part.stride(1), part.stride(2), bg.stride(0), bg.stride(1),
                        bu.stride(0), bu.stride(1))
        R, splits, default_block = part.shape[3], delta.splits, 1024 if dense else 512
    else:
        lora = (gate_up,) * 4  # dummy pointers, never read
        lora_strides, R, splits, default_block = (0,) * 7, 1, 0, 1024
    block_i = min(block_i or default_block, next_power_of_2(I))
    pairs = delta is not None and not dense and (silu_pairs() if pairs is None else pairs)
    default_warps = (int(os.environ.get("LORA_SILU_WARPS", "4" if pairs else "2"))
                     if delta is not None and not dense else 4)
    pdl = pdl_enabled(gate_up)
    _silu_mul_kernel[(cdiv(T, 2) if pairs else T, cdiv(I, block_i))](
        gate_up, act, *lora, delta.expanded if dense else gate_up, T, I, R, gate_up.stride(0),
        act.stride(0), *lora_strides, delta.expanded.stride(0) if dense else 0,
        SPLITS=splits, HAS_LORA=delta is not None, DENSE=dense, BLOCK_I=block_i,
        BLOCK_R=max(16, next_power_of_2(R)), PDL=pdl,
        EARLY_B=early_b_enabled(gate_up), PAIRS=pairs, **pdl_launch(pdl),
        num_warps=num_warps or default_warps,
    )
    return act
