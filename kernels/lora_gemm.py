"""A fused projection's LoRA folded into its decode matmul: y = x @ W + every row's delta,
one launch (kernels/decode_gemm_lora_triton.py), the PyTorch reference elsewhere.

Why: at decode a step's adapters add bytes (A and B of each distinct adapter) to a matmul
that is itself a stream of weight bytes. Run as kernels of their own, or inside the op after
the matmul, the LoRA parts are short launches bound by latency, not bytes: on an H100 with
32 adapters the ops that expanded B took 0.33 ms a step for 0.13 ms of B
(docs/PERFORMANCE.md). Folded in, A and B are read beside the weight stream: the shrink
programs read each adapter's A once, and each output tile reads its rows' B columns while
it streams W, leaving a short tail (a wait for the shrinks, a read of their rows) after the
matmul. That tail and the shrink programs cost a few microseconds per wave of tiles, so it
pays for o (one wave), not for gate/up or q/k/v (adapters/overlap.py, FOLD_GROUPS).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ._dispatch import use_triton



@dataclass(frozen=True)
class GemmLora:
    """What the matmul of one fused group needs to add its LoRA (adapters/slots.py layout)."""

    a_all: torch.Tensor          # [S, slices x R, K]: a slot's A, slice by slice
    b_all: torch.Tensor          # [S, N, R]: a slot's B, rows at their output columns
    scaling: torch.Tensor        # [S] float32
    slice_offsets: tuple[int, ...]  # first output column of each slice
    segment_table: torch.Tensor  # [>= segments, >= 3] int32: slot, first row, length (rows
                                 # of a segment contiguous; empty rows after the real ones)
    segments: int                # table rows a launch reads (a graph's bucket)
    token_slots: torch.Tensor    # [T] int32, -1 for none (the reference's input)
    xa: torch.Tensor             # [>= T, slices x R] float32 scratch for the shrink's rows
    sync: torch.Tensor           # [2] int64 counters of one launch site and grid size, zero
                                 # before its first launch (tickets, finished shrinks)

    @property
    def rank(self) -> int:
        return self.b_all.shape[2]

    @property
    def slices(self) -> int:
        return len(self.slice_offsets)

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """[T, N] float32: every row's delta (the reference the kernel is checked against)."""
        slots = self.token_slots.long()
        active = slots >= 0
        safe = slots.clamp(min=0)
        scale = torch.where(active, self.scaling[safe], 0.0)[:, None]
        xa = torch.einsum("tk,tjk->tj", x.float(), self.a_all[safe].float()) * scale
        b = self.b_all[safe].float()  # [T, N, R]
        bounds = [*self.slice_offsets, b.shape[1]]
        r = self.rank
        return torch.cat([torch.einsum("tr,tnr->tn", xa[:, i * r:(i + 1) * r], b[:, lo:hi])
                          for i, (lo, hi) in enumerate(zip(bounds, bounds[1:]))], dim=1)


def gemm_lora_fits(lora: GemmLora, n: int, block_n: int) -> bool:
    """Whether the Triton kernel takes this fold: every tile inside one slice (at most 3),
    a rank the tensor cores take (a power of 2, 16 or more), and a segment table."""
    r = lora.rank
    return (lora.slices <= 3 and r >= 16 and r & (r - 1) == 0 and n % block_n == 0
            and all(off % block_n == 0 for off in lora.slice_offsets)
            and lora.segment_table.shape[0] >= lora.segments)


def decode_gemm_lora(x: torch.Tensor, w: torch.Tensor, lora: GemmLora, *, tma: bool = False,
                     pdl: bool = False, prefetch_k: int = 0, block_n: int = 16,
                     block_k: int = 128, num_warps: int = 4, num_stages: int = 4) -> torch.Tensor:
    """x [M, K] @ w [K, N] (w a transposed view of [N, K] for tma) plus the LoRA delta, in
    x's dtype. Triton where it runs and the fold fits, else the reference."""
    M, K = x.shape
    N = w.shape[1]
    if not (use_triton(x) and gemm_lora_fits(lora, N, block_n) and K % block_k == 0):
        return (torch.mm(x, w).float() + lora.delta(x)).to(x.dtype)
    from .decode_gemm_lora_triton import decode_gemm_lora_triton

    return decode_gemm_lora_triton(x, w, lora, tma=tma, pdl=pdl, prefetch_k=prefetch_k,
                                   block_n=block_n, block_k=block_k, num_warps=num_warps,
                                   num_stages=num_stages)
