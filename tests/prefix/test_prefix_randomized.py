"""Randomized (hypothesis): interleaved requests over shared prefixes in three namespaces
(base, alpha, beta), with steps, cancels, unloads and re-uploads of alpha between two
weight variants, on a KV cache small enough to force preemption and cache recycling. The
engine's consistency check runs after every step (debug_checks); every request that was not
cancelled must equal the PEFT reference of the adapter version it ran under, and everything
returns to idle at the end."""
from __future__ import annotations

import os
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness import hf_greedy, make_peft_adapter
from inference_node.adapters.sources import content_hash
from inference_node.config import NodeConfig
from inference_node.engine.request import Request, SamplingParams, StreamEvent
from inference_node.llm import LLM

MAX_NEW = 5
FILES = ("adapter_config.json", "adapter_model.safetensors")
_rng = random.Random(21)
PREFIXES = [[_rng.randrange(100, 40000) for _ in range(n)] for n in (8, 11, 12)]
SUFFIXES = {(p, n): [_rng.randrange(100, 40000) for _ in range(n)] for p in range(3) for n in range(1, 6)}


def prompt_of(prefix: int, suffix: int) -> list[int]:
    return PREFIXES[prefix] + SUFFIXES[(prefix, suffix)]


class Oracle:
    """PEFT greedy continuations per (weights variant, prompt), computed once each."""

    def __init__(self, base: Path, variants: dict[str, Path | None]) -> None:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM
        import torch

        self.models = {}
        for key, folder in variants.items():
            model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
            self.models[key] = PeftModel.from_pretrained(model, folder).eval() if folder else model
        self.memo: dict[tuple[str, tuple[int, ...]], list[int]] = {}

    def __call__(self, variant: str, prompt: list[int]) -> list[int]:
        key = (variant, tuple(prompt))
        if key not in self.memo:
            self.memo[key] = hf_greedy(self.models[variant], prompt, MAX_NEW, eos=False)
        return self.memo[key]


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_llama_path):
    root = tmp_path_factory.mktemp("randomized-adapters")
    targets = ["q_proj", "v_proj", "o_proj", "down_proj"]
    variants = {
        "alpha-1": make_peft_adapter(tiny_llama_path, root / "alpha-1", 8, 16.0, targets, seed=11, scale=3.0),
        "alpha-2": make_peft_adapter(tiny_llama_path, root / "alpha-2", 4, 8.0, targets, seed=12, scale=3.0),
        "beta": make_peft_adapter(tiny_llama_path, root / "beta", 8, 16.0, ["k_proj", "up_proj"], seed=13,
                                  scale=3.0),
    }
    versions = {content_hash([(folder / f).read_bytes() for f in FILES]): key for key, folder in variants.items()}
    oracle = Oracle(tiny_llama_path, {"base": None, **variants})
    return tiny_llama_path, variants, versions, oracle


@dataclass
class Tracked:
    request: Request
    adapter: str
    prompt: list[int]
    events: list[StreamEvent] = field(default_factory=list)

    @property
    def finished(self) -> StreamEvent | None:
        return self.events[-1] if self.events and self.events[-1].finish_reason else None


SUBMIT = st.tuples(st.just("submit"), st.sampled_from(["", "alpha", "beta"]), st.integers(0, 2), st.integers(1, 5))
OPS = st.one_of(
    SUBMIT, SUBMIT, SUBMIT, SUBMIT,  # mostly traffic, so requests overlap and preempt each other
    st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(st.just("cancel"), st.integers(0, 50)),
    st.tuples(st.just("unload"), st.sampled_from(["alpha", "beta"])),
    st.tuples(st.just("reupload"), st.sampled_from(["alpha-1", "alpha-2"])),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(ops=st.lists(OPS, min_size=10, max_size=50))
def test_interleaved_namespaces_with_cancels_unloads_and_reuploads(world, tmp_path_factory, ops) -> None:
    base, variants, versions, oracle = world
    adapter_root = tmp_path_factory.mktemp("adapters")
    shutil.copytree(variants["beta"], adapter_root / "beta")
    (adapter_root / "alpha").symlink_to(variants["alpha-1"])  # re-uploads swap the link atomically
    llm = LLM(NodeConfig.of(checkpoint=str(base), device="cpu", num_kv_blocks=14, block_size=4, max_num_seqs=4,
                            max_num_batched_tokens=24, max_loras=2, max_lora_rank=8, max_cpu_loras=2,
                            adapter_dir=str(adapter_root), debug_checks=True))
    engine, manager = llm.engine, llm.node.adapters
    tracked: list[Tracked] = []

    def step(times: int = 1) -> None:
        for _ in range(times):
            engine.run_once(block=False)

    try:
        for op in ops:
            if op[0] == "submit":
                _, adapter, prefix, suffix = op
                t = Tracked(None, adapter, prompt_of(prefix, suffix))  # type: ignore[arg-type]
                t.request = Request(list(t.prompt), SamplingParams(max_tokens=MAX_NEW, ignore_eos=True),
                                    emit=t.events.append, adapter=adapter)
                engine.submit(t.request)
                tracked.append(t)
            elif op[0] == "step":
                step(op[1])
            elif op[0] == "cancel" and tracked:
                engine.abort(tracked[op[1] % len(tracked)].request.id)
            elif op[0] == "unload":
                engine.call(lambda name=op[1]: manager.unload(name) if name in manager.current else None)
            elif op[0] == "reupload":
                (adapter_root / "alpha.new").symlink_to(variants[op[1]])
                os.replace(adapter_root / "alpha.new", adapter_root / "alpha")
                engine.call(lambda: manager.load("alpha", "", False, lambda entry, error: None))
        deadline = time.monotonic() + 60
        while any(t.finished is None for t in tracked) or manager.busy():
            assert time.monotonic() < deadline, "requests did not finish"
            step()
            time.sleep(0.0005)
        step()  # pending commands (a late unload or load) run too

        for t in tracked:
            end = t.finished
            assert end.error is None, end.error
            assert end.finish_reason in ("length", "cancelled")
            if end.finish_reason == "length":
                variant = "base" if not t.adapter else versions[end.adapter_version]
                tokens = [x for e in t.events for x in e.token_ids]
                assert tokens == oracle(variant, t.prompt), (t.adapter, variant)
                assert t.adapter != "alpha" or variant.startswith("alpha")
        engine.check_consistency()
        engine.allocator.check_idle()
        assert all(e.refs == 0 for e in manager.entries())
        cache = engine.prefix_cache
        live = {e.namespace for e in manager.current.values()} | {"base"}
        assert set(cache.stats) <= live, "a retired adapter's namespace still has cache entries"
    finally:
        manager.shutdown()
