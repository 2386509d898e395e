"""The engine's settings, which also size and switch its model runner."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    num_kv_blocks: int
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_queue: int = 1024
    max_model_len: int = 4096
    prefix_caching: bool = True
    decode_graphs: bool = False      # decode steps through static buffers (CUDA graphs on CUDA)
    max_graph_batch: int = 64        # largest decode batch replayed from a graph
    piecewise_graphs: bool = False   # other steps piece by piece through static buffers (CUDA graphs on CUDA)
    prefill_delay_factor: float = 0.0  # admission waits this x the last prefill step (scheduler.py)
    refill_wait_factor: float = 1.0    # after a burst of finishes, their replacements share a prefill step (scheduler.py)
    warmup: str = "auto"             # compile eager steps' kernels at start (runner/warmup.py): auto = on CUDA
    debug_checks: bool = False
