"""A fused projection's LoRA delta left unexpanded, for the op after the projection to expand.

In a decode step a LoRA expand is a small kernel whose launch and ramp-up cost more than the
bytes it reads, and whose float32 output (the delta) is written only to be read back by the
next op (RoPE with the KV-cache write, the residual add and norm, SiLU). That next op reads
the projection's output row by row anyway, so it expands the delta itself: it sums the
shrink's split partials for the row, reads the row's adapter's B columns and adds the
product before doing its own work. No expand launch, no delta buffer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoraDelta:
    """partials[:, i, t] summed, times B_i[slot_t]'s first rank_i(slot_t) columns, is the delta
    of row t on slice i of the projection (slices side by side, in order)."""

    partials: torch.Tensor          # [splits, n_slices, T, R] float32, scaled; rows of slot -1
                                    # and columns past a slot's rank may hold garbage
    b: tuple[torch.Tensor, ...]     # per slice [S, out_i, R]
    token_slots: torch.Tensor       # [T] int32: each row's adapter slot, -1 for none
    ranks: torch.Tensor             # [n_slices, S] int32: 0 where the adapter skips the slice

    @property
    def splits(self) -> int:
        return self.partials.shape[0]

    def dense(self) -> torch.Tensor:
        """[T, sum(out_i)] float32: the delta itself (the reference the fused ops are
        checked against, and the CPU path)."""
        h = self.partials.sum(0)  # [n_slices, T, R]
        T, R = h.shape[1], h.shape[2]
        slots = self.token_slots.long()
        active = slots >= 0
        safe = slots.clamp(min=0)
        outs = []
        for i, b in enumerate(self.b):
            rank = torch.where(active, self.ranks[i].long()[safe], 0)  # [T]
            keep = torch.arange(R, device=h.device)[None, :] < rank[:, None]
            hi = torch.where(keep, h[i], 0.0)  # garbage past the rank never reaches the sum
            outs.append(torch.einsum("tr,tor->to", hi, b[safe].float()))
        return torch.cat(outs, dim=1) if outs else h.new_zeros(T, 0)
