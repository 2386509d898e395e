"""What the Triton decode GEMM takes, decided on the host (no Triton import): how many rows,
which tiling divides a weight, and whether TMA can fetch its tiles."""
from __future__ import annotations

from typing import Mapping

import torch

from ..tuning import Tiling

MAX_ROWS = 64  # decode batches; larger (prefill) matmuls stay with cuBLAS
DEFAULT_TILING: Tiling = (16, 128, 4)  # a group without a tiling of its own
SHARED_MEMORY = 200 << 10  # bytes of an SM's shared memory a launch's pipeline may fill


def row_tile(rows: int) -> int:
    """The row tile (BLOCK_M) a decode GEMM launch of `rows` rows compiles for: every row in
    one tile, at least 16 (the tensor cores' smallest)."""
    return max(16, 1 << (rows - 1).bit_length())


def empty_rows(rows: int, *rest: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised [rows, *rest] whose storage holds a whole row tile (up to MAX_ROWS
    rows): for the ops whose output a decode GEMM reads, so that its TMA descriptor spans the
    tile (tma_rows) and never reads past its end."""
    padded = row_tile(rows) if rows <= MAX_ROWS else rows
    return torch.empty(padded, *rest, dtype=dtype, device=device)[:rows]


def tma_rows(x: torch.Tensor, block_m: int) -> int:
    """The rows a TMA descriptor over x [M, K] (row-major) spans: whole tiles of block_m rows
    where x's storage holds them (empty_rows), else M. The rows past M are read and their
    results never stored: each output row depends on its own row of x alone. Rows past a
    descriptor's end come back as zeros, slowly: H200, 8B down's GEMM at 40 rows of a 64-row
    tile 50.0 us, 33.4 over the tile's rows; o 16.5 against 13.8; at 56 rows 34.9 against 33.1."""
    M, K = x.shape
    rows = -(-M // block_m) * block_m
    if rows == M or x.stride(1) != 1:
        return M
    last = x.storage_offset() + (rows - 1) * x.stride(0) + K
    return rows if last * x.element_size() <= x.untyped_storage().nbytes() else M


def tiling(w: torch.Tensor, group: str | None, table: Mapping[str, Tiling],
           rows: int = MAX_ROWS) -> Tiling | None:
    """(block_n, block_k, stages) for w [K, N] from the group's entry of `table` (one of the
    Tuning's tiling tables), None where no tiling divides it (the group's own, else 64-column
    K steps: SmolLM2's hidden size is 576), with no more stages than shared memory holds
    (float32 tiles are twice as large). Tables are tuned, and their tilings checked to
    compile, in 16-bit types at each bucket's rows: where two stages of a wider type's launch
    of `rows` rows would not fit, its K tiles are halved until they do."""
    block_n, block_k, stages = table.get(group, DEFAULT_TILING)
    if w.shape[0] % block_k:
        block_k = 64
    if w.shape[1] % block_n or w.shape[0] % block_k:
        return None
    esize = w.element_size()
    if esize > 2:
        while 2 * (row_tile(rows) + block_n) * block_k * esize > SHARED_MEMORY and block_k > 64:
            block_k //= 2
        if 2 * (row_tile(rows) + block_n) * block_k * esize > SHARED_MEMORY:
            return None
    per_stage = (64 + block_n) * block_k * esize
    return block_n, block_k, max(2, min(stages, SHARED_MEMORY // per_stage))


def gated_block_n(block_n: int) -> int:
    """Columns of each of gate and up a program of the gated launch (SiLU(gate) * up in the
    GEMM) takes for a gate/up tiling of `block_n`: half, so it reads as many weight bytes as
    a plain program (16 at least, the tensor cores' smallest)."""
    return max(16, block_n // 2)


def rope_block_n(block_n: int, head_dim: int) -> int:
    """Columns of each half of a head a program of the RoPE launch (q/k/v's GEMM with RoPE and
    the KV-cache write in its epilogue) takes for a q/k/v tiling of `block_n`: half, so it
    reads as many weight bytes as a plain program, at least 16 (the tensor cores' smallest),
    at most half a head, and a power of two dividing half a head where one does (a tile is a
    power of two: Phi-3's heads of 96 take tiles of 16, not 48; a launch checks it divides)."""
    half, want, n = head_dim // 2, max(16, block_n // 2), 16
    while n * 2 <= want and half % (n * 2) == 0:
        n *= 2
    return n


def tma_fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether decode_gemm_tma takes x @ w: w a transposed view of a contiguous [out, in]
    matrix, both 16-byte aligned with 16-byte row strides (what a TMA descriptor needs)."""
    esize = x.element_size()
    return (w.t().is_contiguous() and x.stride(1) == 1 and x.data_ptr() % 16 == 0
            and w.data_ptr() % 16 == 0 and (x.stride(0) * esize) % 16 == 0
            and (w.shape[0] * esize) % 16 == 0)
