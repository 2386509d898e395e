"""Counts the JIT compiles that happen while a region runs: Triton kernels (a new
specialisation of a kernel compiles on its first launch, 0.3-2 s each) and torch.compile
graphs. A serving step that compiles stalls every request in flight, so the serving benchmark
reports the compiles that land in its timed runs (there should be none)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class CompileEvent:
    at: float          # time.perf_counter() when the compile finished
    what: str          # kernel name and specialisation (Triton), or "torch.compile graph"


@dataclass
class CompileWatch:
    events: list[CompileEvent] = field(default_factory=list)
    _installed: bool = False

    def install(self) -> "CompileWatch":
        """Hooks Triton's post-compile callback (triton >= 3.3's knobs); idempotent."""
        if self._installed:
            return self
        try:
            from triton import knobs
        except ImportError:
            return self
        previous = knobs.runtime.jit_post_compile_hook

        def hook(*args, **kwargs):
            self.events.append(CompileEvent(time.perf_counter(), str(kwargs.get("repr", "triton kernel"))))
            return previous(*args, **kwargs) if previous else None

        knobs.runtime.jit_post_compile_hook = hook
        self._installed = True
        return self

    def mark(self) -> tuple[int, int]:
        """A position to count from: (Triton compiles so far, torch.compile graphs so far)."""
        return len(self.events), _dynamo_graphs()

    def since(self, mark: tuple[int, int]) -> list[str]:
        """What compiled after `mark`: each Triton kernel's name and specialisation, then one
        entry per new torch.compile graph."""
        triton_events = [e.what for e in self.events[mark[0]:]]
        return triton_events + ["torch.compile graph"] * max(0, _dynamo_graphs() - mark[1])


def _dynamo_graphs() -> int:
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return int(counters["stats"].get("unique_graphs", 0))
