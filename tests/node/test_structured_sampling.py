"""The engine's sampling beyond one greedy answer, driven step by step on a tiny random Llama:

- structured output: constrained requests follow their grammar (a random model still writes
  JSON valid under the schema) while the unconstrained requests of the same steps keep their
  answers; the same tokens whether steps run eagerly or through the static-buffer graph paths;
- logprobs are the log-softmax of the model's logits before temperature (transformers' on the
  same weights), with the greedy token the top alternative;
- the later answers of n wait for the first's prompt blocks and reuse them, and every block
  returns to idle whichever of them is cancelled, and when;
- stop_token_ids end an answer with the token, ignore_eos or not;
- a grammar that does not compile ends its request with INVALID_ARGUMENT's error, alone.
"""
from __future__ import annotations

import json
import time

import pytest
import torch

from harness import hf_greedy
from inference_node.engine.build import build_engine
from inference_node.engine.config import EngineConfig
from inference_node.engine.engine import Engine
from inference_node.engine.errors import InvalidRequest
from inference_node.engine.grammar import GrammarCompiler
from inference_node.engine.request import Request, SamplingParams, StreamEvent
from inference_node.frontend.response_format import grammar_of
from inference_node.model.llama import LlamaModel
from inference_node.model.loader import load_model
from inference_node.tokenizer import TextCodec
from lora.v1 import inference_pb2 as pb

PROMPT = [5, 17, 301, 4000, 88, 9, 1234, 77, 640, 31, 2048, 12, 900, 45, 3, 71, 2500, 6]   # 18 tokens
SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["colour", "count", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tiny_model(tiny_llama_path) -> LlamaModel:
    return load_model(tiny_llama_path, torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def compiler(tiny_llama_path, tiny_model) -> GrammarCompiler:
    compiler = GrammarCompiler(tiny_llama_path / "tokenizer.json", tiny_model.config.vocab_size,
                               tiny_model.config.eos_token_ids)
    yield compiler
    compiler.close()


@pytest.fixture(scope="module")
def codec(tiny_llama_path) -> TextCodec:
    return TextCodec(tiny_llama_path)


@pytest.fixture(scope="module")
def hf_model(tiny_llama_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()


class Collected:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.logprobs: list = []
        self.reason: str | None = None
        self.error: BaseException | None = None

    def __call__(self, event: StreamEvent) -> None:
        assert self.reason is None, "an event after the final one"
        self.tokens += event.token_ids
        if event.logprobs is not None:
            assert len(event.logprobs) == len(event.token_ids)
            self.logprobs += event.logprobs
        self.reason, self.error = event.finish_reason, event.error


def make_engine(model: LlamaModel, compiler: GrammarCompiler | None, graphs: bool = False, **overrides) -> Engine:
    cfg = dict(num_kv_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256,
               decode_graphs=graphs, piecewise_graphs=graphs, max_graph_batch=8, debug_checks=True)
    cfg.update(overrides)
    return build_engine(model, EngineConfig(**cfg), grammars=compiler)


def submit(engine: Engine, prompt: list[int] = PROMPT, grammar: str = "", follows: Request | None = None,
           **params) -> tuple[Request, Collected]:
    out = Collected()
    params.setdefault("max_tokens", 12)
    req = Request(list(prompt), SamplingParams(**params), emit=out, grammar_source=grammar, follows=follows)
    engine.submit(req)
    return req, out


def drain(engine: Engine, outs: list[Collected], timeout: float = 120.0) -> None:
    """Runs the loop until every answer ended: blocking while idle, so a grammar compiling on
    its thread (slow on a loaded machine) wakes the loop when it is done."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        engine.run_once(block=True)
        if all(o.reason is not None for o in outs) and engine._launched is None:
            return
    raise AssertionError("the engine did not finish its requests")


def check_idle(engine: Engine) -> None:
    engine.check_consistency()
    snap = engine.snapshot()
    assert snap["live_requests"] == 0 and snap["kv_blocks_free"] == snap["kv_blocks_total"], snap


def schema_grammar(schema: dict = SCHEMA) -> str:
    return grammar_of(pb.ResponseFormat(type=pb.ResponseFormat.JSON_SCHEMA, json_schema=json.dumps(schema)))


def valid(data: object) -> bool:
    """SCHEMA's own rules, checked by hand."""
    return (isinstance(data, dict) and set(data) == {"colour", "count", "ok"} and data["colour"] in ("red", "green", "blue")
            and type(data["count"]) is int and 0 <= data["count"] <= 99 and type(data["ok"]) is bool)


def constrained_answers(engine: Engine, codec: TextCodec, hf_model) -> list[list[int]]:
    """Free-text and constrained requests in the same steps: the free ones keep transformers'
    greedy answers, the constrained ones end ("stop") with JSON valid under SCHEMA."""
    grammar = schema_grammar()
    free = [submit(engine, PROMPT[:10 + i], max_tokens=14, ignore_eos=True) for i in range(2)]
    greedy_json = submit(engine, grammar=grammar, max_tokens=40)
    sampled_json = [submit(engine, PROMPT[:12], grammar=grammar, max_tokens=40, temperature=1.0, seed=s)
                    for s in (1, 2)]
    drain(engine, [o for _, o in free + [greedy_json] + sampled_json])
    for i, (_, out) in enumerate(free):
        assert out.tokens == hf_greedy(hf_model, PROMPT[:10 + i], 14, eos=False)
    answers = []
    for _, out in [greedy_json, *sampled_json]:
        assert out.reason == "stop" and out.error is None
        answer = json.loads(codec.decode(out.tokens))
        assert valid(answer), answer
        answers.append(out.tokens)
    check_idle(engine)
    return answers


def test_constrained_rows_follow_their_grammar_and_leave_the_others_unchanged(tiny_model, compiler, codec,
                                                                              hf_model) -> None:
    engine = make_engine(tiny_model, compiler)
    answers = constrained_answers(engine, codec, hf_model)
    # The grammar's masks are what made a random model write JSON: without them it does not.
    _, unconstrained = submit(engine, max_tokens=len(answers[0]), ignore_eos=True)
    drain(engine, [unconstrained])
    assert unconstrained.tokens != answers[0]
    assert not codec.decode(unconstrained.tokens).startswith("{")


def test_graph_paths_sample_what_eager_steps_sample(tiny_model, compiler, codec, hf_model) -> None:
    """Decode graphs and piecewise graphs (their static buffers, on the CPU) hand the sampler
    their logits as eager steps do: the same constrained tokens."""
    eager = constrained_answers(make_engine(tiny_model, compiler), codec, hf_model)
    graphs = make_engine(tiny_model, compiler, graphs=True)
    assert constrained_answers(graphs, codec, hf_model) == eager
    assert graphs.stats.graph_steps and graphs.stats.piecewise_graph_steps


def hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax at every position of ids (row i: the distribution of token i + 1)."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_logprobs_are_the_log_softmax_of_the_raw_logits(tiny_model, compiler, hf_model, graphs) -> None:
    engine = make_engine(tiny_model, compiler, graphs)
    greedy = submit(engine, max_tokens=10, ignore_eos=True, logprobs=5)
    sampled = submit(engine, PROMPT[:9], max_tokens=10, ignore_eos=True, logprobs=3, temperature=1.7, seed=4)
    bare = submit(engine, PROMPT[:11], max_tokens=10, ignore_eos=True)
    drain(engine, [greedy[1], sampled[1], bare[1]])
    assert bare[1].logprobs == []
    for prompt, (_, out), top in ((PROMPT, greedy, 5), (PROMPT[:9], sampled, 3)):
        assert len(out.logprobs) == len(out.tokens) == 10
        reference = hf_logprobs(hf_model, prompt + out.tokens)[len(prompt) - 1:-1]
        for pos, (token, (logprob, ids, values)) in enumerate(zip(out.tokens, out.logprobs)):
            assert len(ids) == len(values) == top
            assert values == sorted(values, reverse=True)
            assert logprob == pytest.approx(reference[pos, token].item(), abs=1e-4)
            expected = reference[pos].topk(top)
            assert values == pytest.approx(expected.values.tolist(), abs=1e-4)
            assert ids == expected.indices.tolist()
            if out is greedy[1]:
                assert ids[0] == token and values[0] == pytest.approx(logprob, abs=1e-6)
    # Sampled at temperature 1.7 from the raw distribution: the sampled tokens are not all its argmax.
    assert any(ids[0] != token for token, (_, ids, _) in zip(sampled[1].tokens, sampled[1].logprobs))
    check_idle(engine)


def test_later_answers_reuse_the_first_answers_prompt_blocks(tiny_model, compiler) -> None:
    engine = make_engine(tiny_model, compiler)
    prompt = [t + 1 for t in PROMPT]            # no block of it is cached yet
    first = submit(engine, prompt, ignore_eos=True)
    others = [submit(engine, prompt, ignore_eos=True, follows=first[0]) for _ in range(2)]
    drain(engine, [first[1]] + [o for _, o in others])
    assert first[1].tokens == others[0][1].tokens == others[1][1].tokens
    block = 4
    shared = (len(prompt) - 1) // block * block  # the cache leaves the last token (and its block) to compute
    assert engine.stats.prompt_tokens == len(prompt) + 2 * (len(prompt) - shared)
    assert engine.stats.cached_prompt_tokens == 2 * shared
    check_idle(engine)


def test_every_block_returns_to_idle_whichever_answer_is_cancelled_and_when(tiny_model, compiler) -> None:
    engine = make_engine(tiny_model, compiler)
    # A later answer cancelled after some tokens: the others finish whole.
    prompt = [t + 2 for t in PROMPT]
    first = submit(engine, prompt, max_tokens=30, ignore_eos=True)
    others = [submit(engine, prompt, max_tokens=30, ignore_eos=True, follows=first[0]) for _ in range(2)]
    for _ in range(200):
        engine.run_once(block=False)
        if len(others[0][1].tokens) >= 3:
            break
    engine.abort(others[0][0].id)
    drain(engine, [first[1], others[0][1], others[1][1]])
    assert others[0][1].reason == "cancelled" and 3 <= len(others[0][1].tokens) < 30
    assert first[1].reason == others[1][1].reason == "length" and first[1].tokens == others[1][1].tokens
    check_idle(engine)
    # The first cancelled before its prompt was computed: the others compute it themselves.
    prompt = [t + 3 for t in PROMPT]
    first = submit(engine, prompt, max_tokens=8, ignore_eos=True)
    others = [submit(engine, prompt, max_tokens=8, ignore_eos=True, follows=first[0]) for _ in range(2)]
    engine.abort(first[0].id)
    drain(engine, [first[1], others[0][1], others[1][1]])
    assert first[1].reason == "cancelled" and first[1].tokens == []
    assert others[0][1].reason == others[1][1].reason == "length"
    assert others[0][1].tokens == others[1][1].tokens and len(others[0][1].tokens) == 8
    check_idle(engine)


def test_stop_token_ids_end_the_answer_with_the_token(tiny_model, compiler) -> None:
    engine = make_engine(tiny_model, compiler)
    full = submit(engine, max_tokens=16, ignore_eos=True)
    drain(engine, [full[1]])
    tokens = full[1].tokens
    cut = next(i for i in range(3, len(tokens)) if tokens[i] not in tokens[:i])
    stopped = [submit(engine, max_tokens=16, ignore_eos=ignore, stop_token_ids=frozenset({tokens[cut], 1}))
               for ignore in (True, False)]
    drain(engine, [o for _, o in stopped])
    for _, out in stopped:
        assert (out.reason, out.tokens) == ("stop", tokens[:cut + 1])
    check_idle(engine)


def test_a_grammar_that_does_not_compile_ends_its_request_alone(tiny_model, compiler) -> None:
    engine = make_engine(tiny_model, compiler)
    broken = submit(engine, grammar='{"grammars": [{"lark_grammar": "start: nothing_defined"}]}')
    fine = submit(engine, max_tokens=6, ignore_eos=True)
    drain(engine, [broken[1], fine[1]])
    assert broken[1].reason == "error" and isinstance(broken[1].error, InvalidRequest)
    assert "does not compile" in str(broken[1].error) and broken[1].tokens == []
    assert fine[1].reason == "length" and len(fine[1].tokens) == 6
    check_idle(engine)
    without = make_engine(tiny_model, None)
    with pytest.raises(InvalidRequest, match="structured output"):
        submit(without, grammar=schema_grammar())
