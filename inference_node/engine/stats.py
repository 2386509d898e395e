"""The engine's counters, read by GetStats and the metrics."""
from __future__ import annotations

from dataclasses import dataclass

from ..runner.runner import ForwardMode


@dataclass
class EngineStats:
    steps: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    preemptions: int = 0
    max_adapters_in_step: int = 0
    graph_steps: int = 0             # decode steps replayed from CUDA graphs (static buffers)
    eager_decode_steps: int = 0      # decode-only steps that ran eagerly (larger than the graphs)
    eager_prefill_steps: int = 0     # steps with prompt tokens (prefill chunks, maybe beside decodes) run eagerly
    piecewise_graph_steps: int = 0   # other steps than decode graphs', replayed piece by piece (piecewise_graphs.py)
    cut_short: int = 0               # answers ended part-way by shutdown
    non_finite_rows: int = 0         # sampled rows whose logits held NaN or Inf (their requests failed)

    def count(self, mode: ForwardMode, prefill: bool) -> None:
        """One more step, by how it ran (prefill: it carries prompt tokens)."""
        self.steps += 1
        if mode is ForwardMode.DECODE_GRAPHS:
            self.graph_steps += 1
        elif mode is ForwardMode.PIECEWISE_GRAPHS:
            self.piecewise_graph_steps += 1
        elif prefill:
            self.eager_prefill_steps += 1
        else:
            self.eager_decode_steps += 1
