"""Turns a step's scheduled chunks into the flat tensors of one forward pass.

Everything is assembled on the host from Python lists and copied to the device once per
tensor, so the step has no device synchronisation before sampling. A token the previous step
sampled and the host has not read yet is taken from the device token buffer (`feedback`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.forward import ForwardBatch
from ..engine.scheduler import ScheduledChunk


@dataclass
class HostBatch:
    """A step's flat inputs as host lists, before they go to the device (a tensor-parallel
    node's rank 0 sends them to the other ranks as they are, parallel/workers.py)."""

    input_ids: list[int]
    pending_at: list[int]      # flat positions whose token is still on the device
    pending_rows: list[int]    # ... and its row in `feedback`
    positions: list[int]
    slot_mapping: list[int]
    block_tables: list[list[int]]
    query_start_loc: list[int]
    seq_lens: list[int]
    logits_indices: list[int]
    max_query_len: int

    def to_device(self, device: torch.device, feedback: torch.Tensor | None = None,
                  input_ids: torch.Tensor | None = None) -> ForwardBatch:
        """The step's ForwardBatch; input_ids, where given, replaces this batch's token ids
        (already on the device: a tensor-parallel rank receives rank 0's)."""

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        ids = input_ids
        if ids is None:
            ids = tensor(self.input_ids, torch.long)
            if self.pending_at:
                ids.index_copy_(0, tensor(self.pending_at, torch.long), feedback[tensor(self.pending_rows, torch.long)])
        return ForwardBatch(
            input_ids=ids,
            positions=tensor(self.positions, torch.long),
            slot_mapping=tensor(self.slot_mapping, torch.long),
            block_tables=tensor(self.block_tables, torch.int32),
            query_start_loc=tensor(self.query_start_loc, torch.int32),
            seq_lens=tensor(self.seq_lens, torch.int32),
            logits_indices=tensor(self.logits_indices, torch.long),
            max_query_len=self.max_query_len,
            max_seq_len=max(self.seq_lens),
        )


def build_forward_batch(chunks: list[ScheduledChunk], block_size: int, device: torch.device,
                        feedback: torch.Tensor | None = None) -> ForwardBatch:
    return build_host_batch(chunks, block_size, feedback is not None).to_device(device, feedback)


def build_host_batch(chunks: list[ScheduledChunk], block_size: int, has_feedback: bool = True) -> HostBatch:
    input_ids: list[int] = []
    pending_at: list[int] = []
    pending_rows: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    query_start = [0]
    seq_lens: list[int] = []
    logits_indices: list[int] = []
    max_blocks = max(len(c.request.block_ids) for c in chunks)
    tables: list[list[int]] = []
    for chunk in chunks:
        req, start = chunk.request, chunk.request.num_computed
        end = start + chunk.num_new_tokens
        known = req.all_token_ids[start:end]
        input_ids += known
        if len(known) < end - start:  # the last token: sampled by the step still in flight
            if not has_feedback or end - start - len(known) > 1:
                raise RuntimeError(f"request {req.id}: its input token is still on the device")
            pending_at.append(len(input_ids))
            pending_rows.append(req.feedback_row)
            input_ids.append(0)
        positions += range(start, end)
        blocks = req.block_ids
        slot_mapping += [blocks[p // block_size] * block_size + p % block_size for p in range(start, end)]
        query_start.append(query_start[-1] + chunk.num_new_tokens)
        seq_lens.append(end)
        tables.append(blocks + [0] * (max_blocks - len(blocks)))
        if chunk.completes_prompt:
            logits_indices.append(query_start[-1] - 1)
    return HostBatch(input_ids, pending_at, pending_rows, positions, slot_mapping, tables, query_start,
                     seq_lens, logits_indices, max(c.num_new_tokens for c in chunks))
