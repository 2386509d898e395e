"""What graphs an engine captures, as the other ranks of a tensor-parallel node must capture
them too (in the same order, so every graph's collectives meet): plain data, sent over the
ranks' control line."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GraphPlan:
    scratch_block: int      # the KV block padded rows write into
    max_model_len: int
    feedback_rows: int      # rows of the sampled-token feedback buffer the graphs read
    decode_batch: int       # the decode graphs' largest batch (0: no decode graphs)
    pieces_tokens: int      # the piecewise graphs' largest token bucket (0: none)
    pieces_seqs: int        # the most sequences a piecewise step holds
