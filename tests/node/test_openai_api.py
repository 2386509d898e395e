"""The OpenAI-compatible HTTP API, driven by the real `openai` client against a node whose
gRPC API serves the same requests: greedy answers equal gRPC's text for text (and gRPC's
tokens equal PEFT's), for completions and chat, streamed and whole, on the base model and on
adapters named in `model`; refusals carry the HTTP codes and the messages gRPC's statuses
carry; a client that goes away frees the engine's KV blocks and adapter references.
"""
from __future__ import annotations

import json
import threading
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from harness import InProcessNode, make_peft_adapter, peft_greedy, wait_for
from inference_node.config import NodeConfig, RequestLimits
from lora.v1 import inference_pb2 as pb
from lora_client.node_client import NodeClient

ADAPTERS = {"qv8": (8, ["q_proj", "v_proj"]), "all4": (4, ["q_proj", "k_proj", "v_proj", "o_proj",
                                                               "gate_proj", "up_proj", "down_proj"])}
NEW_TOKENS = 24
PROMPT = "The quick brown fox jumps over"
PROMPT_IDS = [11, 2345, 876, 40, 7]
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
LONG = 900  # tokens: far more than a client that hangs up after a few chunks waits for
TOKEN = "s3cret-generate-token"


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory, tiny_llama_path) -> Path:
    root = tmp_path_factory.mktemp("openai-adapters")
    for seed, (name, (rank, targets)) in enumerate(ADAPTERS.items(), start=1):
        make_peft_adapter(tiny_llama_path, root / name, rank, 2.0 * rank, targets, seed=seed, scale=3.0)
    (root / "not-an-adapter").mkdir()             # no files: never listed
    (root / "_hidden").mkdir()                     # a name no adapter may have
    return root


@pytest.fixture(scope="module")
def node(tiny_llama_path, adapter_dir):
    n = InProcessNode(NodeConfig.of(checkpoint=str(tiny_llama_path), device="cpu", num_kv_blocks=256, max_loras=2,
                                    max_lora_rank=8, adapter_dir=str(adapter_dir), max_model_len=1024,
                                    limits=RequestLimits(max_concurrent_streams=3, max_request_bytes=1 << 16)),
                      http=True)
    yield n
    n.stop()


def grpc_answer(client: NodeClient, **fields):
    fields.setdefault("ignore_eos", True)
    return client.generate(pb.GenerateRequest(**fields), timeout=60)


def grpc_error(client: NodeClient, **fields) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        grpc_answer(client, **fields)
    return err.value


def streamed_text(stream, chat: bool) -> tuple[str, str | None, object]:
    """The concatenated text, the finish reason and the usage of an openai stream."""
    text, finish, usage = "", None, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text += (choice.delta.content or "") if chat else choice.text
            finish = choice.finish_reason or finish
    return text, finish, usage


def model_of(adapter: str, base: str) -> str:
    return adapter or base


@pytest.mark.parametrize("adapter", ["", *ADAPTERS])
def test_completions_equal_grpc_text_for_text_streamed_and_whole(api, grpc_client, base, adapter) -> None:
    expected = grpc_answer(grpc_client, adapter=adapter, prompt=PROMPT, max_tokens=NEW_TOKENS)
    assert len(expected.token_ids) == NEW_TOKENS and expected.text
    whole = api.completions.create(model=model_of(adapter, base), prompt=PROMPT, max_tokens=NEW_TOKENS,
                                   temperature=0, extra_body={"ignore_eos": True})
    assert whole.choices[0].text == expected.text
    assert whole.choices[0].finish_reason == "length" and whole.model == model_of(adapter, base)
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (expected.prompt_tokens, NEW_TOKENS)
    assert whole.usage.total_tokens == expected.prompt_tokens + NEW_TOKENS
    text, finish, usage = streamed_text(api.completions.create(
        model=model_of(adapter, base), prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}), chat=False)
    assert (text, finish) == (expected.text, "length")
    assert usage.completion_tokens == NEW_TOKENS and usage.prompt_tokens == expected.prompt_tokens


@pytest.mark.parametrize("adapter", ["", "qv8"])
def test_chat_completions_equal_grpc_text_for_text_streamed_and_whole(api, grpc_client, base, adapter) -> None:
    expected = grpc_answer(grpc_client, adapter=adapter, max_tokens=NEW_TOKENS,
                           messages=[pb.ChatMessage(**m) for m in MESSAGES])
    whole = api.chat.completions.create(model=model_of(adapter, base), messages=MESSAGES, max_tokens=NEW_TOKENS,
                                        temperature=0, extra_body={"ignore_eos": True})
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == expected.text
    assert whole.usage.prompt_tokens == expected.prompt_tokens  # the same chat template, the same tokens
    stream = api.chat.completions.create(model=model_of(adapter, base), messages=MESSAGES, max_tokens=NEW_TOKENS,
                                         temperature=0, stream=True, extra_body={"ignore_eos": True})
    assert streamed_text(stream, chat=True)[:2] == (expected.text, "length")


def test_token_id_prompts_follow_peft_through_both_apis(api, grpc_client, base, tiny_llama_path, adapter_dir) -> None:
    """gRPC's tokens are PEFT's, and the HTTP text is gRPC's: the HTTP path is PEFT's too."""
    for adapter in ("", "all4"):
        oracle = peft_greedy(tiny_llama_path, adapter_dir / adapter if adapter else None, [PROMPT_IDS], NEW_TOKENS)[0]
        expected = grpc_answer(grpc_client, adapter=adapter, prompt_token_ids=PROMPT_IDS, max_tokens=NEW_TOKENS)
        assert expected.token_ids == oracle
        whole = api.completions.create(model=model_of(adapter, base), prompt=PROMPT_IDS, max_tokens=NEW_TOKENS,
                                       temperature=0, extra_body={"ignore_eos": True})
        assert whole.choices[0].text == expected.text
        assert whole.usage.prompt_tokens == len(PROMPT_IDS)


def test_adapters_change_the_answer(api, base) -> None:
    texts = {name: api.completions.create(model=name, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].text
             for name in (base, *ADAPTERS)}
    assert len(set(texts.values())) == len(texts), texts


def test_stop_strings_seeds_and_top_p_mean_what_grpc_means(api, grpc_client, base) -> None:
    full = grpc_answer(grpc_client, prompt=PROMPT, max_tokens=NEW_TOKENS)
    stop = full.text[len(full.text) // 2:][:3]
    assert stop.strip()
    expected = grpc_answer(grpc_client, prompt=PROMPT, max_tokens=NEW_TOKENS, stop=[stop])
    assert expected.finish_reason == "stop" and stop not in expected.text
    whole = api.completions.create(model=base, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0, stop=stop,
                                   extra_body={"ignore_eos": True})
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == (expected.text, "stop")
    assert whole.usage.completion_tokens == expected.completion_tokens
    text, finish, _ = streamed_text(api.completions.create(
        model=base, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0, stop=[stop], stream=True,
        extra_body={"ignore_eos": True}), chat=False)
    assert (text, finish) == (expected.text, "stop")

    sampled = grpc_answer(grpc_client, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0.9, top_p=0.8, seed=1234)
    again = api.completions.create(model=base, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0.9, top_p=0.8,
                                   seed=1234, extra_body={"ignore_eos": True})
    assert again.choices[0].text == sampled.text != full.text


def test_models_lists_the_base_model_and_the_directory_adapters(api, base) -> None:
    models = {m.id: m for m in api.models.list().data}
    assert set(models) == {base, *ADAPTERS}
    assert models[base].owned_by == "lora-serving"
    for name in ADAPTERS:
        assert models[name].model_extra["parent"] == base


@pytest.mark.parametrize("model", ["no-such-adapter", "org/some-model"])
def test_an_unknown_model_is_404(api, grpc_client, model) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        api.completions.create(model=model, prompt=PROMPT, max_tokens=4)
    assert err.value.code == "model_not_found" and model in err.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        list(api.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, stream=True))


@pytest.mark.parametrize("fields, grpc_fields", [
    (dict(temperature=-0.5), dict(temperature=-0.5)),
    (dict(top_p=1.5), dict(top_p=1.5)),
    (dict(max_tokens=10**9), dict(max_tokens=10**9)),
    (dict(prompt=[5, 49152]), dict(prompt_token_ids=[5, 49152])),
])
def test_bad_parameters_are_400_with_grpcs_message(api, grpc_client, base, fields, grpc_fields) -> None:
    error = grpc_error(grpc_client, **({"prompt": PROMPT} | grpc_fields))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as err:
            api.completions.create(**({"model": base, "prompt": PROMPT, "max_tokens": 4, "stream": stream} | fields))
        assert err.value.status_code == 400 and err.value.body["message"] == error.details()


@pytest.mark.parametrize("fields, param", [
    (dict(n=0), "n"), (dict(max_tokens=0), "max_tokens"), (dict(stop=5), "stop"),
    (dict(prompt=["a", "b"]), "prompt"), (dict(logprobs=21), "logprobs"), (dict(presence_penalty=0.5), "presence_penalty"),
    (dict(temperature="hot"), "temperature"), (dict(model=None), "model"),
])
def test_what_the_openai_api_has_and_grpc_lacks_is_checked_too(node, base, fields, param) -> None:
    body = {"model": base, "prompt": PROMPT, "max_tokens": 4} | fields
    reply = httpx.post(f"{node.http_url}/completions", json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def test_malformed_bodies_paths_and_sizes(node, base) -> None:
    reply = httpx.post(f"{node.http_url}/completions", content=b"{not json", timeout=30)
    assert reply.status_code == 400 and "not valid JSON" in reply.json()["error"]["message"]
    reply = httpx.post(f"{node.http_url}/completions", json={"model": base, "prompt": "x" * (1 << 17)}, timeout=30)
    assert reply.status_code == 413 and "--max-request-mb" in reply.json()["error"]["message"]
    reply = httpx.get(f"{node.http_url}/engines", timeout=30)
    assert reply.status_code == 404 and reply.json()["error"]["message"]
    reply = httpx.get(f"{node.http_url}/completions", timeout=30)
    assert reply.status_code == 405


def test_the_sse_stream_is_well_formed(node) -> None:
    body = {"model": "qv8", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{node.http_url}/completions", json=body, timeout=30) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        events = [line for line in reply.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert len({c["id"] for c in chunks}) == 1 and chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_overload_is_429_and_drain_is_503_shared_with_grpc(node, api, grpc_client, base) -> None:
    """The stream limit counts both APIs' requests: gRPC streams fill it, HTTP is refused."""
    streams = [grpc_client.stream(pb.GenerateRequest(prompt=PROMPT, max_tokens=LONG, ignore_eos=True), timeout=60)
               for _ in range(3)]
    try:
        for s in streams:
            next(s)
        with pytest.raises(openai.RateLimitError) as err:
            api.completions.create(model=base, prompt=PROMPT, max_tokens=4)
        assert "--max-concurrent-streams" in err.value.body["message"]
        assert err.value.response.headers["retry-after"] == "1"
    finally:
        for s in streams:
            s.cancel()
    wait_for(lambda: node.server.frontend.streams.open == 0, 10, "the streams to close")

    node.server.frontend.draining = True  # what a drain (NodeServer.stop) sets first
    try:
        with pytest.raises(openai.InternalServerError) as err:
            api.chat.completions.create(model=base, messages=MESSAGES, max_tokens=4)
        assert err.value.status_code == 503 and err.value.response.headers["retry-after"] == "1"
        assert err.value.body["message"] == grpc_error(grpc_client, prompt=PROMPT).details()
    finally:
        node.server.frontend.draining = False


def _idle_with_no_adapter_refs(node, grpc_client) -> bool:
    snap = node.engine.call(node.engine.snapshot).result(10)
    refs = [a.ref_count for a in grpc_client.stub.ListAdapters(pb.ListAdaptersRequest()).adapters]
    return snap["live_requests"] == 0 and snap["kv_blocks_free"] == snap["kv_blocks_total"] and not any(refs)


def test_closing_the_stream_aborts_the_engine_request(node, api, grpc_client) -> None:
    metrics = node.server.frontend.metrics.registry
    cancelled = metrics.get_sample_value("lora_node_requests_total", {"adapter": "qv8", "status": "cancelled"}) or 0
    before = node.engine.call(node.engine.snapshot).result(10)["generated_tokens"]
    stream = api.chat.completions.create(model="qv8", messages=MESSAGES, max_tokens=LONG, temperature=0,
                                         stream=True, extra_body={"ignore_eos": True})
    for _, chunk in zip(range(3), stream):
        assert chunk.choices
    stream.close()
    wait_for(lambda: _idle_with_no_adapter_refs(node, grpc_client), 10, "the engine to free the closed stream")
    node.check_idle()
    assert node.engine.call(node.engine.snapshot).result(10)["generated_tokens"] - before < LONG
    assert metrics.get_sample_value("lora_node_requests_total", {"adapter": "qv8", "status": "cancelled"}) == cancelled + 1


def test_a_client_that_gives_up_on_a_whole_answer_aborts_it(node, grpc_client, base) -> None:
    before = node.engine.call(node.engine.snapshot).result(10)["generated_tokens"]
    with openai.OpenAI(base_url=node.http_url, api_key="unused", max_retries=0, timeout=0.5) as impatient:
        with pytest.raises(openai.APITimeoutError):
            impatient.completions.create(model="all4", prompt=PROMPT, max_tokens=LONG, temperature=0,
                                         extra_body={"ignore_eos": True})
    wait_for(lambda: _idle_with_no_adapter_refs(node, grpc_client), 10, "the engine to free the abandoned request")
    node.check_idle()
    assert node.engine.call(node.engine.snapshot).result(10)["generated_tokens"] - before < LONG


def test_both_apis_are_counted_in_the_same_metrics(node, api, grpc_client) -> None:
    registry = node.server.frontend.metrics.registry

    def finished() -> float:
        return registry.get_sample_value("lora_node_requests_total", {"adapter": "all4", "status": "length"}) or 0

    def streamed() -> float:
        return registry.get_sample_value("lora_node_generated_tokens_total", {"adapter": "all4"}) or 0

    requests, tokens = finished(), streamed()
    grpc_answer(grpc_client, adapter="all4", prompt=PROMPT, max_tokens=5)
    api.completions.create(model="all4", prompt=PROMPT, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert (finished(), streamed()) == (requests + 2, tokens + 10)


def test_concurrent_requests_of_three_models_mix_in_one_batch(node, api, grpc_client, base) -> None:
    expected = {a: grpc_answer(grpc_client, adapter=a, prompt=PROMPT, max_tokens=NEW_TOKENS).text
                for a in ("", *ADAPTERS)}
    got: dict[tuple[str, int], str] = {}

    def run(adapter: str, i: int) -> None:
        got[(adapter, i)] = api.completions.create(
            model=model_of(adapter, base), prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0,
            extra_body={"ignore_eos": True}).choices[0].text

    threads = [threading.Thread(target=run, args=(a, 0)) for a in expected]  # the node's 3 streams
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == {(a, 0): expected[a] for a in expected}


@pytest.fixture(scope="module")
def guarded(tiny_llama_path):
    n = InProcessNode(NodeConfig.of(checkpoint=str(tiny_llama_path), device="cpu", num_kv_blocks=64, max_loras=0,
                                    generate_token=TOKEN), http=True)
    yield n
    n.stop()


def test_the_generate_token_guards_the_http_api(guarded) -> None:
    base = guarded.node.model_name
    for key in ("wrong", ""):
        with openai.OpenAI(base_url=guarded.http_url, api_key=key or "-", max_retries=0) as api:
            with pytest.raises(openai.AuthenticationError) as err:
                api.completions.create(model=base, prompt=PROMPT, max_tokens=2)
            assert "Bearer" in err.value.body["message"] and TOKEN not in err.value.body["message"]
            with pytest.raises(openai.AuthenticationError):
                api.models.list()
    with openai.OpenAI(base_url=guarded.http_url, api_key=TOKEN, max_retries=0) as api:
        assert api.completions.create(model=base, prompt=PROMPT, max_tokens=2).usage.completion_tokens >= 1
        assert [m.id for m in api.models.list().data] == [base]  # LoRA off: the base model only


# -- strict validation: every bad input a 400 in OpenAI's shape, on a connection that stays open ----
class OneConnection:
    """An openai client over one httpx client whose every answer records the local address of
    the connection it came on: one address for all of them means one keep-alive connection."""

    def __init__(self, base_url: str) -> None:
        self.addresses: list[tuple[str, int]] = []
        self.http = httpx.Client(base_url=base_url, timeout=60, event_hooks={"response": [self._seen]},
                                 limits=httpx.Limits(max_connections=1))
        self.api = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, http_client=self.http)

    def _seen(self, response: httpx.Response) -> None:
        self.addresses.append(response.extensions["network_stream"].get_extra_info("client_addr"))

    def close(self) -> None:
        self.api.close()
        self.http.close()


@pytest.fixture()
def one_connection(node):
    client = OneConnection(node.http_url)
    yield client
    client.close()


def _deep(depth: int) -> bytes:
    return b'{"model": "m", "prompt": ' + b"[" * depth + b"]" * depth + b"}"


BAD_COMPLETIONS = [  # (extra fields, the param the error names, words its message holds)
    (dict(max_tokens=2**31), "max_tokens", "does not fit"),
    (dict(max_tokens=2**40), "max_tokens", "--max-model-len"),
    (dict(max_tokens=2**64), "max_tokens", "does not fit"),
    (dict(extra_body={"top_k": 2**31}), "top_k", "from -1 to 2147483647"),
    (dict(extra_body={"top_k": 2**40}), "top_k", "from -1 to 2147483647"),
    (dict(extra_body={"top_k": -2}), "top_k", "from -1"),
    (dict(temperature=1e9), "temperature", "[0, 2]"),
    (dict(temperature=2.5), "temperature", "[0, 2]"),
    (dict(top_p=1.5), "top_p", "[0, 1]"),
    (dict(seed=2**64), "seed", "seed must be an integer from"),
    (dict(seed=-(2**63) - 1), "seed", "seed must be an integer from"),
    (dict(prompt=[5, 2**31]), "prompt", "[0, 2**31)"),
    (dict(stream_options={"include_usage": "yes"}, stream=True), "stream_options", "true or false"),
]
BAD_CHATS = [
    (dict(max_completion_tokens=2**63), "max_completion_tokens", "does not fit"),
    (dict(messages=[{"role": "wizard", "content": "hi"}]), "messages[0].role", "'wizard'"),
    (dict(messages=[{"role": "user", "content": "hi"}, {"role": "tool", "content": "42", "tool_call_id": "x"}]),
     "messages[1].role", "tool results"),
    (dict(messages=[{"role": "user", "content": None}]), "messages[0].content", "is required"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     "messages[0].content[0]", "'image_url'"),
    (dict(messages=[{"role": "user", "content": 7}]), "messages[0].content", "string or a list"),
    (dict(messages=[{"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}]), "messages[0]",
     "function calling"),
    (dict(temperature=1e9), "temperature", "[0, 2]"),
]
RAW_BODIES = [  # bodies the openai client would not send
    (_deep(30_000), None, "too deeply"),
    (b'{"model": "MODEL", "prompt": "hi", "temperature": NaN}', "temperature", "finite number"),
    (b'{"model": "MODEL", "prompt": "hi", "max_tokens": 1e400}', "max_tokens", "must be an integer"),
    (b'{"model": "MODEL", "prompt": "hi", "top_k": ' + b"9" * 5000 + b"}", None, "not valid JSON"),
]


def _error_shape(body: dict) -> dict:
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    return error


def test_every_bad_input_is_a_400_and_the_connection_serves_the_next_request(one_connection, base) -> None:
    api, http = one_connection.api, one_connection.http
    good = dict(model=base, prompt=PROMPT, max_tokens=2, temperature=0)
    answers = 0
    for fields, param, words in BAD_COMPLETIONS:
        with pytest.raises(openai.BadRequestError) as err:
            api.completions.create(**({"model": base, "prompt": PROMPT, "max_tokens": 4} | fields))
        error = _error_shape(err.value.response.json())
        assert error["param"] == param and words in error["message"], (fields, error)
        assert api.completions.create(**good).usage.completion_tokens == 2
        answers += 2
    for fields, param, words in BAD_CHATS:
        with pytest.raises(openai.BadRequestError) as err:
            api.chat.completions.create(**({"model": base, "messages": MESSAGES, "max_tokens": 4} | fields))
        error = _error_shape(err.value.response.json())
        assert error["param"] == param and words in error["message"], (fields, error)
        assert api.chat.completions.create(model=base, messages=MESSAGES, max_tokens=2).choices[0].message.content
        answers += 2
    for body, param, words in RAW_BODIES:
        reply = http.post("/completions", content=body.replace(b"MODEL", base.encode()),
                          headers={"content-type": "application/json"})
        assert reply.status_code == 400, reply.text
        error = _error_shape(reply.json())
        assert error["param"] == param and words in error["message"], error
        assert api.completions.create(**good).usage.completion_tokens == 2
        answers += 2
    assert len(one_connection.addresses) == answers and len(set(one_connection.addresses)) == 1


def test_a_fault_of_the_nodes_is_a_json_500_on_a_connection_that_stays_open(node, one_connection, base,
                                                                            monkeypatch) -> None:
    api = one_connection.api

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    with monkeypatch.context() as patch:
        patch.setattr(node.server.frontend.codec, "encode", broken)
        with pytest.raises(openai.InternalServerError) as err:
            api.completions.create(model=base, prompt=PROMPT, max_tokens=2)
    error = err.value.response.json()["error"]
    assert err.value.status_code == 500 and error["code"] == "internal_error" and "a bug" not in error["message"]
    assert api.completions.create(model=base, prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2
    assert len(one_connection.addresses) == 2 and len(set(one_connection.addresses)) == 1


def test_grpc_has_the_same_bounds(api, grpc_client, base) -> None:
    for fields, grpc_fields in [(dict(temperature=1e9), dict(prompt=PROMPT, temperature=1e9)),
                                (dict(temperature=2.5), dict(prompt=PROMPT, temperature=2.5))]:
        error = grpc_error(grpc_client, **grpc_fields)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "[0, 2]" in error.details()
        with pytest.raises(openai.BadRequestError) as err:
            api.completions.create(model=base, prompt=PROMPT, max_tokens=2, **fields)
        assert err.value.body["message"] == error.details()
    error = grpc_error(grpc_client, messages=[pb.ChatMessage(role="wizard", content="hi")])
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "'wizard'" in error.details()
    with pytest.raises(openai.BadRequestError) as err:
        api.chat.completions.create(model=base, messages=[{"role": "wizard", "content": "hi"}], max_tokens=2)
    assert err.value.body["message"] == error.details()


def test_developer_messages_are_system_messages(api, grpc_client, base) -> None:
    developer = [{"role": "developer", "content": "You are terse."}, MESSAGES[1]]
    as_system = api.chat.completions.create(model=base, messages=MESSAGES, max_tokens=6, temperature=0)
    as_developer = api.chat.completions.create(model=base, messages=developer, max_tokens=6, temperature=0)
    assert as_developer.choices[0].message.content == as_system.choices[0].message.content
    assert as_developer.usage.prompt_tokens == as_system.usage.prompt_tokens


def test_models_retrieve_gives_one_model_or_404(api, base) -> None:
    adapter = api.models.retrieve("qv8")
    assert (adapter.id, adapter.object, adapter.owned_by) == ("qv8", "model", "lora-serving")
    assert adapter.model_extra["parent"] == base
    model = api.models.retrieve(base)
    assert model.id == base and model.model_extra["parent"] is None
    assert {m.id: m for m in api.models.list().data}["qv8"] == adapter
    for missing in ("no-such-adapter", "_hidden", "org/x"):
        with pytest.raises(openai.NotFoundError) as err:
            api.models.retrieve(missing)
        assert err.value.code == "model_not_found" and missing in err.value.body["message"]
