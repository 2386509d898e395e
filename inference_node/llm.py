"""One node in this process, built from a NodeConfig: the object the engine core process
serves, and what tests and benchmarks build the same way to drive the engine directly.

    llm = LLM(NodeConfig.of(checkpoint=path, device="cpu"))
    [answer] = llm.generate([[1, 2, 3]], max_tokens=8)
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from .config import NodeConfig
from .engine.engine import Engine
from .engine.request import Request, SamplingParams, StreamEvent
from .node import Node, build_node


@dataclass
class Completion:
    """One prompt's answer from LLM.generate."""

    token_ids: list[int]
    finish_reason: str
    cached_prompt_tokens: int = 0
    adapter_version: str = ""


class LLM:
    """A node (model, KV cache, adapter tiers, engine) in this process. The engine's loop runs
    on whoever drives it: the engine core's loop when served, `generate` otherwise."""

    def __init__(self, config: NodeConfig | None = None, **options: Any) -> None:
        """config, or NodeConfig.of(**options) (the defaults with the named fields set)."""
        self.config = config if config is not None else NodeConfig.of(**options)
        self.node: Node = build_node(self.config)
        self._prepared = False

    @property
    def engine(self) -> Engine:
        return self.node.engine

    @property
    def checkpoint(self) -> Path:
        return self.node.checkpoint

    def prepare(self) -> None:
        """The engine's warm-up and graph captures (the engine core does this before serving)."""
        if not self._prepared:
            self.engine.prepare()
            self._prepared = True

    def pin_adapters(self, names: Sequence[str], timeout_s: float = 600.0) -> None:
        """Loads each named adapter from the node's source into GPU adapter memory, pinned (never
        evicted), running the loop here until all are there: benchmarks and tests start their
        traffic with them resident. Raises naming the adapters that did not load."""
        manager = self.node.adapters
        if manager is None:
            raise ValueError("this node has LoRA disabled (max_loras 0): it holds no adapters")
        pending, failed = set(names), []

        def done_for(name: str):
            def done(entry, error) -> None:
                pending.discard(name)
                if error is not None or entry is None or not entry.resident:
                    failed.append(f"{name}: {error or 'not in GPU adapter memory'}")
            return done

        for name in names:
            manager.load(name, "", True, done_for(name))
        deadline = time.monotonic() + timeout_s
        while pending:
            self.engine.run_once(block=False)
            time.sleep(0.002)
            if time.monotonic() > deadline:
                raise TimeoutError(f"adapters still loading after {timeout_s:.0f}s: {sorted(pending)[:5]}")
        if failed:
            raise RuntimeError(f"{len(failed)} adapters did not load: {'; '.join(failed[:3])}")

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int, adapter: str = "",
                 ignore_eos: bool = False, temperature: float = 0.0, seed: int | None = None) -> list[Completion]:
        """Each prompt's answer, all in flight together (so steps batch them), the loop run
        here until every one has finished. Raises the first request's error, if any."""
        self.prepare()
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, ignore_eos=ignore_eos)
        tokens: list[list[int]] = [[] for _ in prompts]
        ends: list[StreamEvent | None] = [None] * len(prompts)

        def emit(i: int, event: StreamEvent) -> None:
            tokens[i].extend(event.token_ids)
            if event.finish_reason is not None:
                ends[i] = event

        for i, prompt in enumerate(prompts):
            self.engine.submit(Request(list(prompt), params, lambda event, i=i: emit(i, event), adapter=adapter))
        while any(end is None for end in ends):
            self.engine.run_once()
        errors = [end.error for end in ends if end.error is not None]
        if errors:
            raise errors[0]
        return [Completion(t, end.finish_reason, end.cached_prompt_tokens, end.adapter_version)
                for t, end in zip(tokens, ends)]

    def close(self) -> None:
        """Ends the loop (requests still running end) and stops what the node started: a
        tensor-parallel node's other ranks, the disk tier's lock."""
        self.engine.shutdown(timeout=0)
        if self.node.adapters is not None:
            self.node.adapters.shutdown()
        self.node.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
