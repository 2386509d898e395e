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
from ..host import cdiv, dot_f32, num_sms
from ..tuning import DEFAULT_TUNING, Tiling
from .reference import PairLora

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


class _Grouped:
    """One step's routing sorted by expert (align_by_expert), and the grouped GEMM over it."""

    def __init__(self, x: torch.Tensor, picks: torch.Tensor, num_experts: int,
                 tilings: Mapping[str, Tiling] | None) -> None:
        self.tilings = tilings or DEFAULT_TUNING.moe_tilings
        self.top_k, self.pairs = picks.shape[1], picks.numel()
        self.sorted_ids, self.block_expert = align_by_expert(picks, num_experts, BLOCK_M)
        self.f32 = dot_f32(x.dtype, x.device)

    def gemm(self, a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, group: str, *, per_token: bool,
             gated: bool = False, weights: torch.Tensor | None = None) -> None:
        """out[pair] = a[its row] @ w[its expert]^T at `group`'s tiling: SiLU(gate) * up where
        gated (out has half w's rows), times each pair's routing weight where `weights` (flat)."""
        n, k = (w.shape[1] // 2 if gated else w.shape[1]), w.shape[2]
        block_n, block_k, stages = fitted(self.tilings[group], k, a.element_size(), gated=group == "gate_up")
        if group == "gate_up" and not gated:
            block_n *= 2  # gate's and up's columns in one plain tile: the gated launch's bytes
        _grouped_gemm_kernel[(self.block_expert.numel(), cdiv(n, block_n))](
            a, w, out, self.sorted_ids, self.block_expert, weights if weights is not None else out, n, k, self.pairs,
            a.stride(0), w.stride(0), w.stride(1), out.stride(0),
            ROWS_PER_TOKEN=self.top_k if per_token else 1, SCALE=weights is not None, GATED=gated, F32_DOT=self.f32,
            BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, num_stages=stages)


def fused_experts_triton(x: torch.Tensor, weights: torch.Tensor, picks: torch.Tensor, gate_up: torch.Tensor,
                         down: torch.Tensor, tilings: Mapping[str, Tiling] | None = None) -> torch.Tensor:
    """As reference.experts_reference without LoRA: x [T, hidden], weights / picks [T, k],
    gate_up [E, 2 * inter, hidden], down [E, hidden, inter] (all contiguous); tilings: the
    Tuning's moe_tilings (the defaults' where None)."""
    tokens, top_k = picks.shape
    grouped = _Grouped(x, picks, gate_up.shape[0], tilings)
    act = x.new_empty(grouped.pairs, gate_up.shape[1] // 2)
    grouped.gemm(x, gate_up, act, "gate_up", per_token=True, gated=True)
    scaled = x.new_empty(grouped.pairs, x.shape[1])
    grouped.gemm(act, down, scaled, "down", per_token=False, weights=weights.reshape(-1).contiguous())
    return scaled.view(tokens, top_k, -1).sum(dim=1, dtype=torch.float32).to(x.dtype)


# -- each pair's expert LoRA, beside the grouped GEMMs ---------------------------------------------

# Tuning.moe_lora_launches' first entry 2: one launch (a program a pair) where the pairs give
# every SM this many programs, else two launches (their expand has a program per column tile
# too). Qwen3-30B-A3B at 64 rows has 512 pairs; Mixtral at 64 rows has 128 pairs, each of
# 28,672 gate/up columns, which one program a pair would stream alone.
ONE_LAUNCH_WHEN_FULL = 2
ONE_LAUNCH_PROGRAMS_PER_SM = 2


def one_launch(launches: int, pairs: int, device: torch.device) -> bool:
    """Whether a moe_lora_launches entry whose first value is `launches` runs `pairs` pairs'
    LoRA in one launch (1), two (0), or one where they fill the GPU (ONE_LAUNCH_WHEN_FULL)."""
    if launches == ONE_LAUNCH_WHEN_FULL:
        return pairs >= ONE_LAUNCH_PROGRAMS_PER_SM * num_sms(device)
    return bool(launches)


@triton.jit
def _pair_rank(token_slots_ptr, rank_ptr, token, EVERY: tl.constexpr):
    """(the token's adapter slot, clamped to 0; its rank there, 0 for no adapter; whether the
    pair writes: EVERY, down's routing weight, makes every pair write, with LoRA or not)."""
    slot = tl.load(token_slots_ptr + token)
    rank = tl.where(slot >= 0, tl.load(rank_ptr + tl.maximum(slot, 0)), 0)
    if EVERY:
        keep = rank >= 0
    else:
        keep = rank > 0
    return tl.maximum(slot, 0), rank, keep


@triton.jit
def _pair_shrink(x_ptr, row, a_rows, live, K, stride_xm, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_R] float32: x[row] . each of the live rows of A at a_rows, over K in BLOCK_K tiles."""
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        xv = tl.load(x_ptr + row.to(tl.int64) * stride_xm + ks, mask=k_ok, other=0.0).to(tl.float32)
        av = tl.load(a_rows + ks[None, :], mask=live[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(av * xv[None, :], axis=1)
    return acc


@triton.jit
def _pair_add(y_ptr, weight_ptr, pair, cols, col_ok, delta, stride_ym, SCALE: tl.constexpr):
    """y[pair, cols] += delta, rounded to y's dtype before the add (as the reference's
    index_add); SCALE: then times the pair's routing weight, rounded again."""
    y_ptrs = y_ptr + pair.to(tl.int64) * stride_ym + cols
    y = tl.load(y_ptrs, mask=col_ok, other=0.0)
    out_dtype = y_ptr.dtype.element_ty
    out = (y.to(tl.float32) + delta.to(out_dtype).to(tl.float32)).to(out_dtype)
    if SCALE:
        out = (out.to(tl.float32) * tl.load(weight_ptr + pair)).to(out_dtype)
    tl.store(y_ptrs, out, mask=col_ok)


@triton.jit
def _pair_lora_shrink_kernel(
    x_ptr, picks_ptr, a_ptr, token_slots_ptr, first_ptr, rank_ptr, s_ptr,
    K, stride_xm, stride_ae, stride_ar, stride_sm,
    TOP_K: tl.constexpr, X_PER_PAIR: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """s[pair, r] = x[row] . A[expert, first + r] for r < the rank of the pair's token's
    adapter slot (zeros past it, and for tokens without one)."""
    pair = tl.program_id(0)
    token = pair // TOP_K
    slot, rank, _ = _pair_rank(token_slots_ptr, rank_ptr, token, False)
    rs = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    if rank > 0:
        expert = tl.load(picks_ptr + pair).to(tl.int64)
        first = tl.load(first_ptr + slot)
        if X_PER_PAIR:
            row = pair
        else:
            row = token
        a_rows = a_ptr + expert * stride_ae + (first + rs).to(tl.int64)[:, None] * stride_ar
        acc = _pair_shrink(x_ptr, row, a_rows, rs < rank, K, stride_xm, BLOCK_R, BLOCK_K)
    tl.store(s_ptr + pair * stride_sm + rs, acc)


@triton.jit
def _pair_lora_expand_kernel(
    s_ptr, picks_ptr, b_ptr, token_slots_ptr, first_ptr, rank_ptr, scaling_ptr, y_ptr, weight_ptr,
    N, stride_sm, stride_be, stride_br, stride_ym,
    TOP_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, SCALE: tl.constexpr,
):
    """y[pair, n] += (s[pair] . B[expert, first:first + rank, n]) * scaling (_pair_add);
    SCALE: for every pair, with LoRA or not: down's epilogue, so its grouped GEMM writes no
    unscaled rows to scale afterwards."""
    pair, pid_n = tl.program_id(0), tl.program_id(1)
    token = pair // TOP_K
    slot, rank, keep = _pair_rank(token_slots_ptr, rank_ptr, token, SCALE)
    if keep:
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        delta = tl.zeros((BLOCK_N,), dtype=tl.float32)
        if rank > 0:
            expert = tl.load(picks_ptr + pair).to(tl.int64)
            first = tl.load(first_ptr + slot)
            rs = tl.arange(0, BLOCK_R)
            live = rs < rank
            s = tl.load(s_ptr + pair * stride_sm + rs, mask=live, other=0.0)
            b = tl.load(b_ptr + expert * stride_be + (first + rs).to(tl.int64)[:, None] * stride_br + cols[None, :],
                        mask=live[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
            delta = tl.sum(s[:, None] * b, axis=0) * tl.load(scaling_ptr + slot)
        _pair_add(y_ptr, weight_ptr, pair, cols, col_ok, delta, stride_ym, SCALE)


@triton.jit
def _pair_lora_fused_kernel(
    x_ptr, picks_ptr, a_ptr, b_ptr, token_slots_ptr, first_ptr, rank_ptr, scaling_ptr, y_ptr, weight_ptr,
    K, N, stride_xm, stride_ae, stride_ar, stride_be, stride_br, stride_ym,
    TOP_K: tl.constexpr, X_PER_PAIR: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr, SCALE: tl.constexpr,
):
    """The shrink and the expand kernels' work for one pair in one program: its rank's
    products stay in registers, and the pair's slot, rank and expert are read once."""
    pair = tl.program_id(0)
    token = pair // TOP_K
    slot, rank, keep = _pair_rank(token_slots_ptr, rank_ptr, token, SCALE)
    if keep:
        rs = tl.arange(0, BLOCK_R)
        live = rs < rank
        expert = tl.load(picks_ptr + pair).to(tl.int64)
        first = tl.load(first_ptr + slot)
        scaling = tl.load(scaling_ptr + slot)
        s = tl.zeros((BLOCK_R,), dtype=tl.float32)
        if rank > 0:
            if X_PER_PAIR:
                row = pair
            else:
                row = token
            a_rows = a_ptr + expert * stride_ae + (first + rs).to(tl.int64)[:, None] * stride_ar
            s = _pair_shrink(x_ptr, row, a_rows, live, K, stride_xm, BLOCK_R, BLOCK_K)
        b_rows = b_ptr + expert * stride_be + (first + rs).to(tl.int64)[:, None] * stride_br
        for n0 in range(0, N, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            col_ok = cols < N
            delta = tl.zeros((BLOCK_N,), dtype=tl.float32)
            if rank > 0:
                b = tl.load(b_rows + cols[None, :], mask=live[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
                delta = tl.sum(s[:, None] * b, axis=0) * scaling
            _pair_add(y_ptr, weight_ptr, pair, cols, col_ok, delta, stride_ym, SCALE)


def pair_lora_triton(x: torch.Tensor, picks: torch.Tensor, lora: PairLora, y: torch.Tensor, x_per_pair: bool,
                     weights: torch.Tensor | None = None, num_warps: int = 4, fused: bool = False,
                     width: int = 128) -> None:
    """As reference.pair_lora_reference: a shrink launch of one program a pair, then an expand
    launch over (pair, column tile); with `weights` (flat, float32) every pair's row then
    times its routing weight. Each pair reads its adapter's rows of its expert: no host
    sync, so a graph captures it. width: the K and N tile (moe_lora_launches' second value)."""
    pairs, top_k = picks.numel(), picks.shape[1]
    block_r = max(16, triton.next_power_of_2(lora.max_rank))
    x = x if x.stride(1) == 1 else x.contiguous()
    flat = picks.reshape(-1)
    if fused:
        _pair_lora_fused_kernel[(pairs,)](
            x, flat, lora.a, lora.b, lora.token_slots, lora.first, lora.rank, lora.scaling, y,
            weights if weights is not None else lora.scaling, x.shape[1], y.shape[1], x.stride(0), lora.a.stride(0),
            lora.a.stride(1), lora.b.stride(0), lora.b.stride(1), y.stride(0), TOP_K=top_k, X_PER_PAIR=x_per_pair,
            BLOCK_R=block_r, BLOCK_K=width, BLOCK_N=width, SCALE=weights is not None, num_warps=num_warps)
        return
    shrunk = torch.empty(pairs, block_r, dtype=torch.float32, device=y.device)
    _pair_lora_shrink_kernel[(pairs,)](
        x, flat, lora.a, lora.token_slots, lora.first, lora.rank, shrunk, x.shape[1], x.stride(0), lora.a.stride(0),
        lora.a.stride(1), shrunk.stride(0), TOP_K=top_k, X_PER_PAIR=x_per_pair, BLOCK_R=block_r, BLOCK_K=width,
        num_warps=num_warps)
    n = y.shape[1]
    _pair_lora_expand_kernel[(pairs, cdiv(n, width))](
        shrunk, flat, lora.b, lora.token_slots, lora.first, lora.rank, lora.scaling, y,
        weights if weights is not None else lora.scaling, n, shrunk.stride(0), lora.b.stride(0), lora.b.stride(1),
        y.stride(0), TOP_K=top_k, BLOCK_R=block_r, BLOCK_N=width, SCALE=weights is not None, num_warps=num_warps)


def fused_experts_lora_triton(x: torch.Tensor, weights: torch.Tensor, picks: torch.Tensor, gate_up: torch.Tensor,
                              down: torch.Tensor, tilings: Mapping[str, Tiling] | None,
                              gate_up_lora: PairLora | None, down_lora: PairLora | None,
                              launches: Mapping[str, Tiling] | None = None) -> torch.Tensor:
    """As reference.experts_reference with each pair's expert LoRA: each pair's deltas added
    beside the grouped GEMMs, gate/up's before SiLU * up (a launch of its own where gate/up
    has LoRA, the GEMM's epilogue where not), down's before the routing weight (its expand's
    epilogue), rounded where the reference rounds. launches: Tuning.moe_lora_launches."""
    from ..activation.dispatch import silu_mul_lora

    launches = launches or DEFAULT_TUNING.moe_lora_launches

    def pair_lora(a: torch.Tensor, lora: PairLora, y: torch.Tensor, group: str, **kw) -> None:
        launch, width, warps = launches[group]
        pair_lora_triton(a, picks, lora, y, num_warps=warps, fused=one_launch(launch, picks.numel(), y.device),
                         width=width, **kw)

    tokens, top_k = picks.shape
    grouped = _Grouped(x, picks, gate_up.shape[0], tilings)
    flat_weights = weights.reshape(-1).contiguous()
    act = x.new_empty(grouped.pairs, gate_up.shape[1] // 2)
    if gate_up_lora is not None:
        projected = x.new_empty(grouped.pairs, gate_up.shape[1])
        grouped.gemm(x, gate_up, projected, "gate_up", per_token=True)
        pair_lora(x, gate_up_lora, projected, "gate_up", x_per_pair=False)
        act = silu_mul_lora(projected, None)  # rounded as F.silu(gate) * up
    else:
        grouped.gemm(x, gate_up, act, "gate_up", per_token=True, gated=True)
    scaled = x.new_empty(grouped.pairs, x.shape[1])
    if down_lora is not None:
        grouped.gemm(act, down, scaled, "down", per_token=False)
        pair_lora(act, down_lora, scaled, "down", x_per_pair=True, weights=flat_weights)
    else:
        grouped.gemm(act, down, scaled, "down", per_token=False, weights=flat_weights)
    return scaled.view(tokens, top_k, -1).sum(dim=1, dtype=torch.float32).to(x.dtype)
