"""GET /v1/models of a node fed by a real adapter store: the store's valid adapters are listed
before any is loaded (an invalid one is not), `model` loads one on demand, and a store that
goes away leaves the listing of what the node holds."""
from __future__ import annotations

import openai
import pytest

from adapter_store.push import push_adapter
from harness import InProcessNode, make_peft_adapter, wait_for
from inference_node.config import NodeConfig

PROMPT = [101, 2002, 3003, 4004, 505, 66]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_llama_path, seaweed, bucket, s3, make_store):
    root = tmp_path_factory.mktemp("openai-store")
    for seed, name in enumerate(["alpha", "beta"]):
        folder = make_peft_adapter(tiny_llama_path, root / name, 8, 16.0, ["q_proj", "v_proj"], seed=seed, scale=3.0)
        push_adapter(folder, name, s3, "adapters/", progress=False)
    seaweed.boto3_client().put_object(Bucket=bucket, Key="adapters/broken/adapter_config.json", Body=b"{}")
    store = make_store()
    node = InProcessNode(NodeConfig.of(checkpoint=str(tiny_llama_path), device="cpu", num_kv_blocks=128, max_loras=2,
                                       max_lora_rank=8, adapter_store=store.address, adapter_fetch_timeout_s=3.0,
                                       adapter_disk_tier=False),
                         http=True)
    yield store, node
    node.stop()


def test_models_come_from_the_store_catalog(stack, tiny_llama_path) -> None:
    store, node = stack
    base = tiny_llama_path.name
    with openai.OpenAI(base_url=node.http_url, api_key="-", max_retries=0, timeout=60) as api:
        wait_for(lambda: {m.id for m in api.models.list().data} == {base, "alpha", "beta"}, 30,
                 "the store's catalog (without 'broken') in /v1/models")
        assert not node.node.adapters.entries()  # listed, none loaded yet
        answer = api.completions.create(model="beta", prompt=PROMPT, max_tokens=6, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert answer.usage.completion_tokens == 6 and answer.system_fingerprint  # the adapter version
        with pytest.raises(openai.NotFoundError):
            api.completions.create(model="gamma", prompt=PROMPT, max_tokens=2)
        store.stop()  # the listing falls back to what the node holds
        assert {m.id for m in api.models.list().data} == {base, "beta"}
