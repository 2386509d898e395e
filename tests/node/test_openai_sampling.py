"""The OpenAI API's sampling features, driven by the real `openai` client against a node of the
embedded model (SmolLM2), with gRPC beside it:

- n answers: indexed choices, whole and streamed (interleaved by index), usage summed, the
  prompt computed once; one answer ended early by its stop string leaves the others whole;
- logprobs and top_logprobs on completions and chat, whole and streamed: the greedy token is
  the top alternative and the values are transformers' log-softmax on the same checkpoint;
- seed: the same seed gives the same sampled text alone or beside other requests, another
  seed another text;
- stop_token_ids end an answer after the token (its text left out);
- response_format json_schema and json_object: the answers parse and validate (jsonschema);
- every bad value of these fields is a 400 in OpenAI's error shape, gRPC's the same message.
"""
from __future__ import annotations

import json
import threading
from collections import defaultdict

import grpc
import openai
import pytest
import torch

from harness import InProcessNode, wait_for
from inference_node.config import NodeConfig, RequestLimits
from lora.v1 import inference_pb2 as pb
from test_openai_api import OneConnection, _error_shape

PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman who"
MESSAGES = [{"role": "user", "content": "Write one sentence about the sea."}]
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"enum": ["Paris", "London", "Tokyo"]}},
          "required": ["name", "age", "city"], "additionalProperties": False}
PERSON_MESSAGES = [{"role": "user", "content": "Invent a person. Answer in JSON with their name, age and city."}]


@pytest.fixture(scope="module")
def node(smollm2_path):
    n = InProcessNode(NodeConfig.of(checkpoint=str(smollm2_path), device="cpu", dtype="float32", num_kv_blocks=256,
                                    max_loras=0, max_model_len=1024, debug_checks=True,
                                    limits=RequestLimits(max_concurrent_streams=8)), http=True)
    yield n
    n.stop()


@pytest.fixture(scope="module")
def hf_model(smollm2_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()


def engine_stats(node) -> dict:
    return node.engine.call(node.engine.snapshot).result(10)


def streamed_choices(stream, chat: bool) -> tuple[dict[int, str], dict[int, str], list[int], object]:
    """Each choice's text and finish reason, the order of the indexes chunks came in, the usage."""
    texts, finishes, order, usage = defaultdict(str), {}, [], None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            order.append(choice.index)
            texts[choice.index] += (choice.delta.content or "") if chat else choice.text
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    return dict(texts), finishes, order, usage


# -- n ----------------------------------------------------------------------------------------------
def test_n_answers_are_indexed_choices_that_share_the_prompt(node, api, base) -> None:
    # A prompt of its own (nothing of it cached yet), of more than two KV blocks.
    prompt = PROMPT + " went out every morning, when the sea was grey and the wind was cold."
    before = engine_stats(node)
    whole = api.completions.create(model=base, prompt=prompt, max_tokens=12, n=3, temperature=1.0, seed=7,
                                   extra_body={"ignore_eos": True})
    after = engine_stats(node)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" and c.text for c in whole.choices)
    assert len({c.text for c in whole.choices}) > 1            # seeds 7, 8, 9: different samples
    assert whole.usage.completion_tokens == 36
    prompt_tokens = whole.usage.prompt_tokens
    shared = (prompt_tokens - 1) // 16 * 16                      # full blocks (of 16), less the last token's
    assert prompt_tokens > 32 and shared >= 16
    assert after["prompt_tokens"] - before["prompt_tokens"] == prompt_tokens + 2 * (prompt_tokens - shared)
    assert after["cached_prompt_tokens"] - before["cached_prompt_tokens"] == 2 * shared
    assert whole.usage.prompt_tokens_details.cached_tokens == shared

    texts, finishes, order, usage = streamed_choices(api.completions.create(
        model=base, prompt=prompt, max_tokens=12, n=3, temperature=1.0, seed=7, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}), chat=False)
    assert texts == {c.index: c.text for c in whole.choices}   # the same seeds: the same answers
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert order != sorted(order)                                # interleaved as they were sampled
    assert usage.completion_tokens == 36 and usage.prompt_tokens == prompt_tokens

    chat = api.chat.completions.create(model=base, messages=MESSAGES, max_tokens=10, n=2, temperature=0)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content   # greedy: n equal answers
    texts, finishes, _, _ = streamed_choices(api.chat.completions.create(
        model=base, messages=MESSAGES, max_tokens=10, n=2, temperature=0, stream=True), chat=True)
    assert texts == {0: chat.choices[0].message.content, 1: chat.choices[1].message.content}
    node.check_idle()


def test_one_answer_ended_by_its_stop_string_leaves_the_others_whole(node, api, base) -> None:
    args = dict(model=base, prompt=PROMPT, max_tokens=16, n=3, temperature=1.0, seed=21,
                extra_body={"ignore_eos": True})
    full = [c.text for c in api.completions.create(**args).choices]
    stop = next(full[0][i:i + 4] for i in range(2, len(full[0]) - 4)
                if full[0][i:i + 4].strip() and all(full[0][i:i + 4] not in t for t in full[1:])
                and full[0][i:i + 4] not in full[0][:i + 3])
    cut = api.completions.create(**args, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == full[0][:full[0].index(stop)]
    assert [c.text for c in cut.choices[1:]] == full[1:]
    assert [c.finish_reason for c in cut.choices[1:]] == ["length", "length"]
    assert cut.usage.completion_tokens < 48
    node.check_idle()


def test_closing_a_stream_of_n_answers_frees_every_one(node, api, base) -> None:
    stream = api.completions.create(model=base, prompt=PROMPT, max_tokens=500, n=3, temperature=1.0, stream=True,
                                    extra_body={"ignore_eos": True})
    seen = set()
    for chunk in stream:
        seen |= {c.index for c in chunk.choices}
        if len(seen) == 3:
            break
    stream.close()
    wait_for(lambda: engine_stats(node)["live_requests"] == 0, 10, "the engine to free the three answers")
    node.check_idle()


# -- logprobs -----------------------------------------------------------------------------------------
def hf_logprobs(hf_model, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax of the distributions the output tokens were sampled from."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt_ids + output_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[len(prompt_ids) - 1:-1]


def test_completion_logprobs_are_transformers_log_softmax(node, api, grpc_client, base, hf_model) -> None:
    codec = node.server.frontend.codec
    prompt_ids = codec.encode(PROMPT)
    expected = grpc_client.generate(pb.GenerateRequest(prompt_token_ids=prompt_ids, max_tokens=12, ignore_eos=True,
                                                       logprobs=True, top_logprobs=5), timeout=120)
    assert len(expected.logprobs) == len(expected.token_ids) == 12
    reference = hf_logprobs(hf_model, prompt_ids, list(expected.token_ids))
    for pos, (token, entry) in enumerate(zip(expected.token_ids, expected.logprobs)):
        assert entry.top_token_ids[0] == token                    # greedy: the most likely token
        assert entry.logprob == pytest.approx(reference[pos, token].item(), abs=2e-3)
        top = reference[pos].topk(5)
        assert list(entry.top_logprobs) == pytest.approx(top.values.tolist(), abs=2e-3)
        assert entry.logprob <= 0 and entry.top_logprobs[0] == pytest.approx(entry.logprob, abs=1e-6)

    whole = api.completions.create(model=base, prompt=prompt_ids, max_tokens=12, temperature=0, logprobs=5,
                                   extra_body={"ignore_eos": True})
    logprobs = whole.choices[0].logprobs
    assert "".join(logprobs.tokens) == whole.choices[0].text == expected.text
    assert logprobs.token_logprobs == pytest.approx([e.logprob for e in expected.logprobs], abs=1e-6)
    assert logprobs.text_offset == [len("".join(logprobs.tokens[:i])) for i in range(12)]
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert max(top.values()) == pytest.approx(logprob, abs=1e-6) and top[token] == pytest.approx(logprob)
        assert 5 <= len(top) <= 6
    streamed = [c.choices[0].logprobs for c in api.completions.create(
        model=base, prompt=prompt_ids, max_tokens=12, temperature=0, logprobs=5, stream=True,
        extra_body={"ignore_eos": True}) if c.choices and c.choices[0].logprobs]
    assert sum((s.tokens for s in streamed), []) == logprobs.tokens
    assert sum((s.token_logprobs for s in streamed), []) == logprobs.token_logprobs
    assert sum((s.text_offset for s in streamed), []) == logprobs.text_offset
    plain = api.completions.create(model=base, prompt=prompt_ids, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


def test_chat_logprobs_are_transformers_log_softmax(node, api, base, hf_model) -> None:
    codec = node.server.frontend.codec
    whole = api.chat.completions.create(model=base, messages=MESSAGES, max_tokens=12, temperature=0, logprobs=True,
                                        top_logprobs=3, extra_body={"ignore_eos": True})
    content = whole.choices[0].logprobs.content
    assert len(content) == 12 and whole.usage.completion_tokens == 12
    assert b"".join(bytes(e.bytes) for e in content).decode() == whole.choices[0].message.content
    vocab = codec.tokenizer.get_vocab(with_added_tokens=True)
    output_ids = codec.encode(whole.choices[0].message.content, add_special_tokens=False)
    assert len(output_ids) == 12 and [codec.token_bytes(t) for t in output_ids] == [bytes(e.bytes) for e in content]
    reference = hf_logprobs(hf_model, codec.encode_chat(MESSAGES), output_ids)
    for pos, entry in enumerate(content):
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token
        assert entry.logprob == pytest.approx(reference[pos, output_ids[pos]].item(), abs=2e-3)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(reference[pos].topk(3).values.tolist(),
                                                                         abs=2e-3)
    assert len(vocab) >= 49152
    streamed = [e for c in api.chat.completions.create(
        model=base, messages=MESSAGES, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3, stream=True,
        extra_body={"ignore_eos": True}) for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    plain = api.chat.completions.create(model=base, messages=MESSAGES, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


# -- seed, stop_token_ids -------------------------------------------------------------------------------
def test_a_seed_reproduces_its_answer_alone_and_in_company(node, api, base) -> None:
    args = dict(model=base, prompt=PROMPT, max_tokens=16, temperature=1.0, top_p=0.95, extra_body={"ignore_eos": True})
    alone = api.completions.create(**args, seed=1234).choices[0].text
    assert api.completions.create(**args, seed=1234).choices[0].text == alone
    texts: dict[int, str] = {}

    def run(i: int) -> None:
        texts[i] = api.completions.create(**args, seed=1234 if i == 0 else 99 + i).choices[0].text

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]   # one batch of four
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert texts[0] == alone
    assert len({alone, texts[1], texts[2], texts[3]}) == 4
    chat = dict(model=base, messages=MESSAGES, max_tokens=12, temperature=1.0)
    assert (api.chat.completions.create(**chat, seed=5).choices[0].message.content
            == api.chat.completions.create(**chat, seed=5).choices[0].message.content
            != api.chat.completions.create(**chat, seed=6).choices[0].message.content)


def test_stop_token_ids_end_the_answer_after_the_token(node, api, grpc_client, base) -> None:
    codec = node.server.frontend.codec
    full = grpc_client.generate(pb.GenerateRequest(prompt=PROMPT, max_tokens=16, ignore_eos=True), timeout=120)
    ids = list(full.token_ids)
    cut = next(i for i in range(4, len(ids)) if ids[i] not in ids[:i])
    stopped = grpc_client.generate(pb.GenerateRequest(prompt=PROMPT, max_tokens=16, stop_token_ids=[ids[cut]]),
                                   timeout=120)
    assert (list(stopped.token_ids), stopped.finish_reason) == (ids[:cut + 1], "stop")
    assert stopped.text == codec.decode(ids[:cut])
    whole = api.completions.create(model=base, prompt=PROMPT, max_tokens=16, temperature=0,
                                   extra_body={"stop_token_ids": [ids[cut]]})
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == (stopped.text, "stop")
    assert whole.usage.completion_tokens == cut + 1


# -- response_format -------------------------------------------------------------------------------------
def test_json_schema_answers_parse_and_validate(node, api, grpc_client, base) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    answers = []
    for seed in (None, 1, 2):
        temperature = 0 if seed is None else 0.9
        reply = api.chat.completions.create(model=base, messages=PERSON_MESSAGES, max_tokens=80, response_format=fmt,
                                            temperature=temperature, seed=seed)
        assert reply.choices[0].finish_reason == "stop"
        answers.append(reply.choices[0].message.content)
    texts, finishes, _, _ = streamed_choices(api.chat.completions.create(
        model=base, messages=PERSON_MESSAGES, max_tokens=80, response_format=fmt, temperature=0, stream=True), chat=True)
    assert texts[0] == answers[0] and finishes[0] == "stop"
    completion = api.completions.create(model=base, prompt="A person as JSON: ", max_tokens=80, temperature=0,
                                        extra_body={"response_format": fmt})
    answers.append(completion.choices[0].text)
    spec = pb.ResponseFormat(type=pb.ResponseFormat.JSON_SCHEMA, json_schema=json.dumps(PERSON))
    answers.append(grpc_client.generate(pb.GenerateRequest(messages=[pb.ChatMessage(**PERSON_MESSAGES[0])],
                                                           max_tokens=80, response_format=spec), timeout=120).text)
    for text in answers:
        jsonschema.validate(json.loads(text), PERSON)
    unconstrained = api.chat.completions.create(model=base, messages=PERSON_MESSAGES, max_tokens=30, temperature=0)
    assert not unconstrained.choices[0].message.content.startswith("{")   # the format made the JSON
    obj = api.chat.completions.create(model=base, messages=PERSON_MESSAGES, max_tokens=80, temperature=0,
                                      response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    node.check_idle()


def test_free_text_beside_structured_output_keeps_its_answer(node, api, base) -> None:
    args = dict(model=base, prompt=PROMPT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    alone = api.completions.create(**args).choices[0].text
    texts: dict[str, str] = {}

    def structured() -> None:
        texts["json"] = api.chat.completions.create(
            model=base, messages=PERSON_MESSAGES, max_tokens=80, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}).choices[0].message.content

    def free() -> None:
        texts["free"] = api.completions.create(**args).choices[0].text

    threads = [threading.Thread(target=structured), threading.Thread(target=free)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert texts["free"] == alone and json.loads(texts["json"])


# -- strict validation ------------------------------------------------------------------------------------
BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "strin"}}}
BAD = [  # (chat, extra fields, the param the error names, words its message holds)
    (False, dict(n=0), "n", "from 1 to 128"),
    (False, dict(n=129), "n", "from 1 to 128"),
    (False, dict(n=2, best_of=3), "best_of", "equal n"),
    (False, dict(logprobs=21), "logprobs", "from 0 to 20"),
    (False, dict(logprobs=-1), "logprobs", "from 0 to 20"),
    (False, dict(extra_body={"logprobs": True}), "logprobs", "must be an integer"),
    (False, dict(extra_body={"top_logprobs": 2}), "top_logprobs", "logprobs (0-20)"),
    (True, dict(logprobs=True, top_logprobs=21), "top_logprobs", "from 0 to 20"),
    (True, dict(top_logprobs=3), "top_logprobs", "needs logprobs"),
    (True, dict(extra_body={"logprobs": 2}), "logprobs", "true or false"),
    (True, dict(response_format={"type": "xml"}), "response_format", "is not one of"),
    (True, dict(extra_body={"response_format": "json"}), "response_format", "must be an object"),
    (True, dict(response_format={"type": "json_schema"}), "response_format.json_schema", "needs"),
    (True, dict(response_format={"type": "json_schema", "json_schema": {"schema": PERSON}}),
     "response_format.json_schema.name", "1-64"),
    (True, dict(response_format={"type": "json_schema", "json_schema": {"name": "a b", "schema": PERSON}}),
     "response_format.json_schema.name", "1-64"),
    (True, dict(response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": [1]}}),
     "response_format.json_schema.schema", "must be a JSON Schema"),
    (True, dict(response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON,
                                                                        "strict": "yes"}}),
     "response_format.json_schema.strict", "true or false"),
    (True, dict(response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": BAD_SCHEMA}}),
     "response_format", "strin"),
    (True, dict(response_format={"type": "json_schema", "json_schema": {
        "name": "p", "schema": {"type": "integer", "minimum": 5, "maximum": 2}}}), "response_format", "minimum"),
    (True, dict(response_format={"type": "json_object"}, extra_body={"ignore_eos": True}), "ignore_eos",
     "response_format"),
    (False, dict(extra_body={"stop_token_ids": "x"}), "stop_token_ids", "list of token ids"),
    (False, dict(extra_body={"stop_token_ids": [-1]}), "stop_token_ids", "list of token ids"),
    (False, dict(extra_body={"stop_token_ids": [49152]}), "stop_token_ids", "outside the vocabulary"),
    (False, dict(extra_body={"stop_token_ids": list(range(65))}), "stop_token_ids", "at most 64"),
]


def test_every_bad_value_of_the_new_fields_is_a_400_in_openais_shape(node, base) -> None:
    client = OneConnection(node.http_url)
    try:
        for chat, fields, param, words in BAD:
            request = dict(model=base, max_tokens=4) | fields
            with pytest.raises(openai.BadRequestError) as err:
                if chat:
                    client.api.chat.completions.create(messages=MESSAGES, **request)
                else:
                    client.api.completions.create(prompt=PROMPT, **request)
            error = _error_shape(err.value.response.json())
            assert error["param"] == param and words in error["message"], (fields, error)
            assert client.api.completions.create(model=base, prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2
        assert len(set(client.addresses)) == 1     # one keep-alive connection served them all
    finally:
        client.close()
    node.check_idle()


def test_grpc_refuses_the_same_values_with_the_same_messages(api, grpc_client, base) -> None:
    schema = pb.ResponseFormat(type=pb.ResponseFormat.JSON_SCHEMA, json_schema=json.dumps(BAD_SCHEMA))
    cases = [(dict(logprobs=True, top_logprobs=21), dict(logprobs=True, top_logprobs=21)),
             (dict(top_logprobs=3), dict(top_logprobs=3)),
             (dict(stop_token_ids=[49152]), dict(extra_body={"stop_token_ids": [49152]})),
             (dict(response_format=schema), dict(response_format={"type": "json_schema", "json_schema": {
                 "name": "p", "schema": BAD_SCHEMA}}))]
    for grpc_fields, http_fields in cases:
        with pytest.raises(grpc.RpcError) as err:
            grpc_client.generate(pb.GenerateRequest(messages=[pb.ChatMessage(**MESSAGES[0])], max_tokens=4,
                                                    **grpc_fields), timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(openai.BadRequestError) as http_err:
            api.chat.completions.create(model=base, messages=MESSAGES, max_tokens=4, **http_fields)
        assert http_err.value.body["message"] == err.value.details()
    for fmt in (pb.ResponseFormat(type=pb.ResponseFormat.JSON_SCHEMA, json_schema="{nope"),
                pb.ResponseFormat(type=pb.ResponseFormat.JSON_OBJECT, json_schema="{}")):
        with pytest.raises(grpc.RpcError) as err:
            grpc_client.generate(pb.GenerateRequest(prompt=PROMPT, max_tokens=4, response_format=fmt), timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "response_format" in err.value.details()
