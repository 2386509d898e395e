"""LoRA on the embedding and the LM head (PEFT's `lora_embedding_A/B` on embed_tokens, a
Linear LoRA on lm_head), for a step's rows grouped by adapter: one gather or matmul pair per
adapter in the step, never per token. The groups' ranks, first arena rows and scalings are
host values (the slots' host tables), so nothing here reads device memory back.

Embedding: row t's delta is scaling * A[:, id_t] @ B^T, A [r, vocab] and B [hidden, r] kept as
rank rows (A's rows, B's columns) like every other module's (adapters/slots.py). The product is
computed in float32, scaled at the shrink as the projections' references do."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class EdgeGroup:
    """The rows of one adapter: their indices in the step (a device tensor), its rank, first
    arena row and scaling."""

    rows: torch.Tensor
    rank: int
    first: int
    scaling: float


def embedding_lora(ids: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   groups: list[EdgeGroup]) -> torch.Tensor:
    """[T, hidden] float32: each row's embedding LoRA delta (zero for rows in no group). a:
    [arena rows, vocab], b: [arena rows, hidden]."""
    out = torch.zeros(ids.shape[0], b.shape[1], dtype=torch.float32, device=b.device)
    for g in groups:
        h = a[g.first:g.first + g.rank][:, ids[g.rows]].t().float() * g.scaling  # [n, r]
        out[g.rows] = h @ b[g.first:g.first + g.rank].float()
    return out


def linear_lora(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, groups: list[EdgeGroup],
                columns: tuple[int, int] | None = None) -> torch.Tensor:
    """[N, columns] float32: each row's x @ A^T @ B delta (zero for rows in no group). a: [arena
    rows, in], b: [arena rows, out]; columns: the [start, stop) of B's columns wanted (a
    tensor-parallel rank's block of the vocabulary; None: all)."""
    start, stop = columns if columns is not None else (0, b.shape[1])
    out = torch.zeros(x.shape[0], stop - start, dtype=torch.float32, device=x.device)
    for g in groups:
        h = (x[g.rows].float() @ a[g.first:g.first + g.rank].float().t()) * g.scaling  # [n, r]
        out[g.rows] = h @ b[g.first:g.first + g.rank, start:stop].float()
    return out
