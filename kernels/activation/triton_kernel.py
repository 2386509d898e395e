"""SiLU(gate) * up (or GeLU-tanh(gate) * up, Gemma's) with the gate/up LoRA delta expanded
in, in one Triton launch.

Programs cover (row, a span of the intermediate columns): each reads its gate and up columns,
expands the row's delta for them from the shrink's partial sums and the adapter's B columns
(kernels/lora/delta.py), or adds the delta already expanded, and writes the activation. Rows
without an adapter skip the B reads.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..gemm.shapes import empty_rows
from ..host import cdiv, next_power_of_2, pdl_launch
from ..lora.delta import LoraDelta
from ..lora.expand_rows import expand_rows, load_b_rows, load_sums
from ..tuning import DEFAULT_TUNING, Tuning


@triton.jit
def silu_times(gate, up, dtype: tl.constexpr):
    """SiLU(gate) * up, rounded where F.silu(g) * u on `dtype` tensors rounds: g and u first
    (a matmul's output), then the SiLU, then the product. Also the gated decode GEMM's
    epilogue (kernels/gemm), so its output is this kernel's bit for bit."""
    g = gate.to(dtype).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dtype)
    return (silu.to(tl.float32) * up.to(dtype).to(tl.float32)).to(dtype)


@triton.jit
def gelu_tanh_times(gate, up, dtype: tl.constexpr):
    """GeLU(gate, tanh approximation) * up, rounded as F.gelu(g, approximate="tanh") * u on
    `dtype` tensors rounds (transformers' gelu_pytorch_tanh): g and u, the GeLU, the product."""
    g = gate.to(dtype).to(tl.float32)
    inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)  # sqrt(2 / pi) (g + 0.044715 g^3)
    tanh = 2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0
    gelu = (0.5 * g * (1.0 + tanh)).to(dtype)
    return (gelu.to(tl.float32) * up.to(dtype).to(tl.float32)).to(dtype)


@triton.jit
def _silu_mul_kernel(
    gu_ptr, act_ptr, part_ptr, bg_ptr, bu_ptr, rows_ptr, dense_ptr,
    I, R,
    stride_gu, stride_act, stride_ps, stride_pslice, stride_pt,
    stride_rows, stride_bgr, stride_bur, stride_dense,
    SPLITS: tl.constexpr, HAS_LORA: tl.constexpr, DENSE: tl.constexpr, BLOCK_I: tl.constexpr,
    BLOCK_R: tl.constexpr, PDL: tl.constexpr, EARLY_B: tl.constexpr = False,
    GELU_TANH: tl.constexpr = False,
):
    if PDL:  # launched with programmatic dependent launch (kernels/tuning.py: Tuning.pdl)
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may launch, start on its weights
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = offs < I
    if HAS_LORA and not DENSE:  # straight-line: the row's loads go out together
        # The row's adapter's ranks and first arena rows on gate and up come from the host
        # (copied before the step) and B from the arenas: neither is written by the kernel
        # ahead, so with EARLY_B they are read before the wait, while the gate/up GEMM still
        # streams its weights. A row without an adapter has rank 0: nothing is read. B is read
        # a rank row at a time over the columns (kernels/lora/expand_rows.py).
        lrow = rows_ptr + t * stride_rows
        r_g = tl.minimum(tl.load(lrow), R)
        first_g = tl.load(lrow + 1).to(tl.int64)
        r_u = tl.minimum(tl.load(lrow + 2), R)
        first_u = tl.load(lrow + 3).to(tl.int64)
        if PDL and not EARLY_B:
            tl.extra.cuda.gdc_wait()  # before reading what the kernel ahead of this one writes
        b_g = load_b_rows(bg_ptr + first_g * stride_bgr, stride_bgr, offs, mask, r_g, BLOCK_R)
        b_u = load_b_rows(bu_ptr + first_u * stride_bur, stride_bur, offs, mask, r_u, BLOCK_R)
        if PDL and EARLY_B:
            tl.extra.cuda.gdc_wait()
        part_row = part_ptr + t * stride_pt
        h_g = load_sums(part_row, stride_ps, r_g, SPLITS, BLOCK_R)
        h_u = load_sums(part_row + stride_pslice, stride_ps, r_u, SPLITS, BLOCK_R)
        g = tl.load(gu_ptr + t * stride_gu + offs, mask=mask, other=0.0)
        u = tl.load(gu_ptr + t * stride_gu + I + offs, mask=mask, other=0.0)
        # Each plus its delta, rounded once to its dtype.
        g = (g.to(tl.float32) + expand_rows(h_g, b_g, BLOCK_R)).to(g.dtype)
        u = (u.to(tl.float32) + expand_rows(h_u, b_u, BLOCK_R)).to(u.dtype)
    else:
        if PDL:
            tl.extra.cuda.gdc_wait()
        g = tl.load(gu_ptr + t * stride_gu + offs, mask=mask, other=0.0)
        u = tl.load(gu_ptr + t * stride_gu + I + offs, mask=mask, other=0.0)
        if DENSE:  # the delta, expanded beside the matmul: [T, 2I] float32
            dg = tl.load(dense_ptr + t * stride_dense + offs, mask=mask, other=0.0)
            du = tl.load(dense_ptr + t * stride_dense + I + offs, mask=mask, other=0.0)
            g = (g.to(tl.float32) + dg).to(g.dtype)
            u = (u.to(tl.float32) + du).to(u.dtype)
    if GELU_TANH:
        act = gelu_tanh_times(g, u, act_ptr.dtype.element_ty)
    else:
        act = silu_times(g, u, act_ptr.dtype.element_ty)
    tl.store(act_ptr + t * stride_act + offs, act, mask=mask)


def silu_mul_triton(gate_up: torch.Tensor, delta: LoraDelta | None = None, *,
                    block_i: int | None = None, num_warps: int | None = None,
                    tuning: Tuning = DEFAULT_TUNING, activation: str = "silu") -> torch.Tensor:
    """As reference.silu_mul with delta.dense() and its activation, in one launch. block_i:
    columns per program. With a delta to expand the defaults are the tuning's silu_row_tile,
    the decode graph's best: alone, wider programs were faster, but in the graph a program's
    B, read before its wait, is less to hold while the gate/up GEMM still runs."""
    assert activation in ("silu", "gelu_tanh"), activation
    T, two_i = gate_up.shape
    I = two_i // 2
    assert gate_up.stride(1) == 1
    act = empty_rows(T, I, dtype=gate_up.dtype, device=gate_up.device)  # down's x: tma_rows
    if T == 0:
        return act
    dense = delta is not None and delta.expanded is not None
    if dense:
        assert delta.expanded.shape == (T, two_i) and delta.expanded.stride(1) == 1
    if delta is not None:
        assert len(delta.b) == 2, "two slices: gate and up"
        bg, bu = delta.b
        part = delta.partials
        assert bg.shape[1] == I and bu.shape[1] == I and bg.stride(1) == 1 and bu.stride(1) == 1
        assert part.stride(3) == 1 and delta.token_rows.stride(1) == 1
        lora = (part, bg, bu, delta.token_rows)
        lora_strides = (part.stride(0), part.stride(1), part.stride(2), delta.token_rows.stride(0),
                        bg.stride(0), bu.stride(0))
        R, splits = part.shape[3], delta.splits
        default_block = 1024 if dense else tuning.silu_row_tile[0]
    else:
        lora = (gate_up,) * 4  # dummy pointers, never read
        lora_strides, R, splits, default_block = (0,) * 6, 1, 0, 1024
    block_i = min(block_i or default_block, next_power_of_2(I))
    default_warps = tuning.silu_row_tile[1] if delta is not None and not dense else 4
    pdl = tuning.pdl_on(gate_up)
    _silu_mul_kernel[(T, cdiv(I, block_i))](
        gate_up, act, *lora, delta.expanded if dense else gate_up, I, R, gate_up.stride(0),
        act.stride(0), *lora_strides, delta.expanded.stride(0) if dense else 0,
        SPLITS=splits, HAS_LORA=delta is not None, DENSE=dense, BLOCK_I=block_i,
        BLOCK_R=next_power_of_2(R), PDL=pdl,
        EARLY_B=tuning.expand_early_b_on(gate_up), **pdl_launch(pdl), GELU_TANH=activation == "gelu_tanh",
        num_warps=num_warps or default_warps,
    )
    return act
