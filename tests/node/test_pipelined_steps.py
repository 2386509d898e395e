"""The engine launches step n+1 before it reads step n's tokens. These tests drive the engine
step by step and check what that must not change: outputs equal the transformers reference,
a request that ends by length costs no extra step, one that ends by EOS drops the token its
extra step sampled, cancels and preemptions in the middle of the pipeline lose nothing, and
every KV block and count returns to idle."""
from __future__ import annotations

import random

import pytest
import torch

from harness import hf_greedy
from inference_node.engine.build import build_engine
from inference_node.engine.config import EngineConfig
from inference_node.engine.engine import Engine
from inference_node.engine.request import Request, SamplingParams, StreamEvent
from inference_node.model.llama import LlamaModel
from inference_node.model.loader import load_model


@pytest.fixture(scope="module")
def tiny_model(tiny_llama_path) -> LlamaModel:
    return load_model(tiny_llama_path, torch.device("cpu"), torch.float32)


class Collected:
    """A request's stream, as a client would see it."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.reason: str | None = None
        self.events = 0

    def __call__(self, event: StreamEvent) -> None:
        assert self.reason is None, "an event after the final one"
        self.events += 1
        self.tokens += event.token_ids
        self.reason = event.finish_reason


def make_engine(model: LlamaModel, graphs: bool = False, **overrides) -> Engine:
    cfg = dict(num_kv_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
               max_model_len=128, decode_graphs=graphs, piecewise_graphs=graphs, max_graph_batch=8,
               debug_checks=True)
    cfg.update(overrides)
    return build_engine(model, EngineConfig(**cfg))


def submit(engine: Engine, prompt: list[int], max_tokens: int, ignore_eos: bool = True) -> tuple[Request, Collected]:
    out = Collected()
    req = Request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos), emit=out)
    engine.submit(req)
    return req, out


def drain(engine: Engine, limit: int = 2000) -> None:
    for _ in range(limit):
        engine.run_once(block=False)
        if not engine.scheduler.has_work() and engine._launched is None and engine._commands.empty():
            return
    raise AssertionError("the engine did not go idle")


def assert_idle(engine: Engine) -> None:
    engine.check_consistency()
    assert engine._launched is None
    assert engine.allocator.num_free == engine.allocator.num_blocks  # free or cached-idle
    assert engine.num_inflight() == 0


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(rng.randrange(3, 14))] for _ in range(n)]


def test_tokens_stream_one_step_behind_and_length_costs_no_extra_step(tiny_model, tiny_llama_hf) -> None:
    engine = make_engine(tiny_model)
    prompt = prompts(1, 0)[0]
    req, out = submit(engine, prompt, max_tokens=6)
    engine.run_once(block=False)          # prefill launched, its token not read yet
    assert engine._launched is not None and out.tokens == [] and req.num_pending == 1
    engine.run_once(block=False)          # decode 1 launched, then the prefill's token streamed
    assert len(out.tokens) == 1 and req.num_pending == 1
    drain(engine)
    assert out.tokens == hf_greedy(tiny_llama_hf, prompt, 6, eos=False) and out.reason == "length"
    assert engine.stats.steps == 6        # one prefill + five decodes: no step past the last token
    assert engine.stats.generated_tokens == 6
    assert_idle(engine)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-buffers"])
def test_eos_drops_the_in_flight_token_and_the_batch_stays_exact(tiny_model, tiny_llama_hf, graphs) -> None:
    a_prompt, b_prompt = prompts(2, 1)
    a_ref = hf_greedy(tiny_llama_hf, a_prompt, 12, eos=False)
    b_ref = hf_greedy(tiny_llama_hf, b_prompt, 12, eos=False)
    stop_at = next(i for i in range(2, len(a_ref)) if a_ref[i] not in a_ref[:i])
    engine = make_engine(tiny_model, graphs=graphs)
    engine.eos_ids = frozenset({a_ref[stop_at]})
    _, a_out = submit(engine, a_prompt, 12, ignore_eos=False)
    _, b_out = submit(engine, b_prompt, 12, ignore_eos=True)
    drain(engine)
    assert a_out.tokens == a_ref[:stop_at + 1] and a_out.reason == "stop"
    assert b_out.tokens == b_ref and b_out.reason == "length"
    # a's step after its EOS ran (it was launched before the EOS was read) but its token was
    # dropped: neither streamed nor counted.
    assert engine.stats.generated_tokens == len(a_out.tokens) + len(b_out.tokens)
    if graphs:
        assert engine.stats.graph_steps > 0 and engine.stats.piecewise_graph_steps > 0
    assert_idle(engine)


def test_cancel_while_its_step_is_in_flight(tiny_model, tiny_llama_hf) -> None:
    engine = make_engine(tiny_model)
    a_prompt, b_prompt = prompts(2, 2)
    a, a_out = submit(engine, a_prompt, 20)
    _, b_out = submit(engine, b_prompt, 10)
    for _ in range(4):
        engine.run_once(block=False)
    assert a.num_pending == 1             # a's newest token is on the device
    engine.abort(a.id)
    drain(engine)
    assert a_out.reason == "cancelled" and 0 < len(a_out.tokens) < 20
    assert a_out.tokens == hf_greedy(tiny_llama_hf, a_prompt, len(a_out.tokens), eos=False)
    assert b_out.tokens == hf_greedy(tiny_llama_hf, b_prompt, 10, eos=False)
    assert_idle(engine)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-buffers"])
def test_preemption_with_tokens_in_flight_keeps_every_output(tiny_model, tiny_llama_hf, graphs) -> None:
    # 12 blocks of 4 tokens for 6 requests growing to ~30 tokens each: preemption is certain.
    engine = make_engine(tiny_model, graphs=graphs, num_kv_blocks=12, max_num_seqs=6)
    jobs = [(p, 8 + i) for i, p in enumerate(prompts(6, 3))]
    outs = [submit(engine, p, n)[1] for p, n in jobs]
    drain(engine)
    assert engine.scheduler.num_preemptions > 0
    for (prompt, n), out in zip(jobs, outs):
        assert out.tokens == hf_greedy(tiny_llama_hf, prompt, n, eos=False) and out.reason == "length"
    if graphs:  # recomputed prompts (and their streamed tokens) replayed piece by piece
        assert engine.stats.piecewise_graph_steps > 0 and engine.stats.eager_prefill_steps == 0
    assert_idle(engine)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-buffers"])
def test_prefill_delay_gathers_arrivals_into_one_prefill_step(tiny_model, tiny_llama_hf, graphs) -> None:
    """With a prefill delay, requests arriving one per step while another decodes are held
    and then admitted in one step; every output still equals the reference and the engine
    ends idle."""
    engine = make_engine(tiny_model, graphs=graphs, prefill_delay_factor=1e6)
    first_prompt, *later_prompts = prompts(4, 7)
    _, first_out = submit(engine, first_prompt, 8)
    engine.run_once(block=False)  # nothing decodes yet: the first prompt is admitted at once
    engine.run_once(block=False)
    engine.scheduler.last_prefill_seconds = 1.0  # a huge delay: only the budget rule admits
    later = []
    for prompt in later_prompts:
        later.append((prompt, *submit(engine, prompt, 8)))
        engine.run_once(block=False)
        assert all(r.num_computed == 0 for _, r, _ in later), "admitted before the delay ran out"
    for _, r, _ in later:  # the delay runs out: all three are admitted in the same step
        r.arrival -= 1e7
    engine.run_once(block=False)
    assert all(r.num_computed == len(p) for p, r, _ in later)
    drain(engine)
    assert first_out.tokens == hf_greedy(tiny_llama_hf, first_prompt, 8, eos=False)
    for prompt, _, out in later:
        assert out.tokens == hf_greedy(tiny_llama_hf, prompt, 8, eos=False) and out.reason == "length"
    assert_idle(engine)
