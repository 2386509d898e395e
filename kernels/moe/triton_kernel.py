"""The routed experts as two grouped GEMMs (vLLM's fused_moe, written for this node): the
(token, pick) pairs sorted by expert into blocks of BLOCK_M rows, each block one expert's,
then one launch over (block, column tile) for gate/up and one for down.

The sort is fixed-size (padded to T * k + E * (BLOCK_M - 1) rows rounded up to BLOCK_M, blocks past the last
expert's marked -1 and skipped), built from scatter-adds, a cumsum, a stable argsort and a
searchsorted: no host sync, so a decode graph captures the routing with the experts.

Each program of a GEMM reads its block's expert once, gathers its rows (a token's hidden row
for gate/up, a pair's activation row for down), streams that expert's weight tile by tile
and writes its pairs' rows of the output; down's epilogue scales each pair by its routing
weight. The k picks of a token are then summed in float32.
"""
from __future__ import annotations

from typing import Mapping

import torch
import triton
import triton.language as tl

from ..activation.triton_kernel import silu_times
from ..gemm.shapes import SHARED_MEMORY
from ..host import cdiv, dot_f32
from ..tuning import DEFAULT_TUNING, Tiling

BLOCK_M = 16


def fitted(tiling: Tiling, k: int, esize: int, gated: bool) -> Tiling:
    """(block_n, block_k, stages) of a grouped GEMM over K = k for a tiling of the Tuning's
    moe_tilings: K tiles no longer than K needs, and no more stages than shared memory holds
    (a gated program streams gate's and up's tiles)."""
    block_n, block_k, stages = tiling
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    per_stage = (BLOCK_M + (2 if gated else 1) * block_n) * block_k * esize
    return block_n, block_k, max(1, min(stages, SHARED_MEMORY // per_stage))


def align_by_expert(picks: torch.Tensor, num_experts: int, block_m: int = BLOCK_M
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted pair ids [T*k + E*(block_m-1), rounded up to blocks], pair T*k where a block's row is padding;
    each block's expert [blocks], -1 past the last expert's rows) of the flattened picks."""
    flat = picks.flatten()
    pairs = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    expert_of_sorted = flat[order]
    first_sorted = torch.cumsum(counts, 0) - counts
    within = torch.arange(pairs, device=flat.device) - first_sorted[expert_of_sorted]
    size = cdiv(pairs + num_experts * (block_m - 1), block_m) * block_m
    sorted_ids = torch.full((size,), pairs, dtype=torch.long, device=flat.device)
    sorted_ids[(padded_end - padded)[expert_of_sorted] + within] = order
    starts = torch.arange(0, size, block_m, device=flat.device)
    block_expert = torch.searchsorted(padded_end, starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return sorted_ids, block_expert


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, w_ptr, c_ptr, sorted_ptr, block_expert_ptr, weight_ptr,
    N, K, num_pairs, stride_am, stride_we, stride_wn, stride_cm,
    ROWS_PER_TOKEN: tl.constexpr, SCALE: tl.constexpr, GATED: tl.constexpr, F32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """C[pair, n] = sum_k A[pair // ROWS_PER_TOKEN, k] * W[expert, n, k] (* the pair's routing
    weight where SCALE); GATED: W's rows are gate then up (N each) and C gets silu(g) * u."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    rows = tl.where(valid, pairs // ROWS_PER_TOKEN, 0)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(a_ptr + rows[:, None] * stride_am + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None], mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        if F32_DOT:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc += tl.dot(a, w, input_precision="ieee" if F32_DOT else None)
        if GATED:
            w_up = tl.load(w_base + (cols[None, :] + N) * stride_wn + ks[:, None],
                           mask=col_ok[None, :] & k_ok[:, None], other=0.0)
            if F32_DOT:
                w_up = w_up.to(tl.float32)
            acc_up += tl.dot(a, w_up, input_precision="ieee" if F32_DOT else None)
    out_dtype = c_ptr.dtype.element_ty
    if GATED:
        result = silu_times(acc, acc_up, out_dtype).to(tl.float32)
    else:
        result = acc.to(out_dtype).to(tl.float32)
    if SCALE:
        result = result * tl.load(weight_ptr + pairs, mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.store(c_ptr + pairs[:, None] * stride_cm + cols[None, :], result.to(out_dtype),
             mask=valid[:, None] & col_ok[None, :])


def fused_experts_triton(x: torch.Tensor, weights: torch.Tensor, picks: torch.Tensor, gate_up: torch.Tensor,
                         down: torch.Tensor, tilings: Mapping[str, Tiling] | None = None) -> torch.Tensor:
    """As reference.experts_reference without LoRA: x [T, hidden], weights / picks [T, k],
    gate_up [E, 2 * inter, hidden], down [E, hidden, inter] (all contiguous); tilings: the
    Tuning's moe_tilings (the defaults' where None)."""
    tilings = tilings or DEFAULT_TUNING.moe_tilings
    tokens, top_k = picks.shape
    num_experts, two_inter, hidden = gate_up.shape
    inter = two_inter // 2
    pairs = tokens * top_k
    sorted_ids, block_expert = align_by_expert(picks, num_experts, BLOCK_M)
    f32 = dot_f32(x.dtype, x.device)
    esize = x.element_size()
    act = x.new_empty(pairs, inter)
    block_n, block_k, stages = fitted(tilings["gate_up"], hidden, esize, gated=True)
    grid = (block_expert.numel(), cdiv(inter, block_n))
    _grouped_gemm_kernel[grid](
        x, gate_up, act, sorted_ids, block_expert, weights, inter, hidden, pairs,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), act.stride(0),
        ROWS_PER_TOKEN=top_k, SCALE=False, GATED=True, F32_DOT=f32,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, num_stages=stages)
    scaled = x.new_empty(pairs, hidden)
    flat_weights = weights.reshape(-1).contiguous()
    block_n, block_k, stages = fitted(tilings["down"], inter, esize, gated=False)
    grid = (block_expert.numel(), cdiv(hidden, block_n))
    _grouped_gemm_kernel[grid](
        act, down, scaled, sorted_ids, block_expert, flat_weights, hidden, inter, pairs,
        act.stride(0), down.stride(0), down.stride(1), scaled.stride(0),
        ROWS_PER_TOKEN=1, SCALE=True, GATED=False, F32_DOT=f32,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, num_stages=stages)
    return scaled.view(tokens, top_k, hidden).sum(dim=1, dtype=torch.float32).to(x.dtype)
