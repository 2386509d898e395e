"""GET /v1/models of a node fed by a real adapter store: the store's valid adapters are listed
before any is loaded (an invalid one is not, nor one over the node's rank limit, which every
request is refused from the catalog without a byte fetched), `model` loads one on demand, and
a store that goes away leaves the listing of what the node holds. The same adapter bytes have
one version id from the store and from a folder."""
from __future__ import annotations

import openai
import pytest

from adapter_store.client import AdapterStoreClient
from adapter_store.push import push_adapter
from harness import InProcessNode, make_peft_adapter, wait_for
from inference_node.adapters.sources import LocalDirSource
from inference_node.config import NodeConfig
from inference_node.model.config import ModelConfig

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


@pytest.fixture(scope="module")
def wide_stack(tmp_path_factory, tiny_llama_path, s3, make_store):
    """A node serving ranks up to 8 (all modules) from a store that also holds a rank-16 adapter."""
    root = tmp_path_factory.mktemp("openai-store-wide")
    folders = {"wide": make_peft_adapter(tiny_llama_path, root / "wide", 16, 32.0, ["q_proj", "v_proj"], seed=5),
               "narrow": make_peft_adapter(tiny_llama_path, root / "narrow", 8, 16.0, ["q_proj", "v_proj"], seed=6)}
    for name, folder in folders.items():
        push_adapter(folder, name, s3, "adapters/", progress=False)
    store = make_store()
    node = InProcessNode(NodeConfig.of(checkpoint=str(tiny_llama_path), device="cpu", num_kv_blocks=128, max_loras=2,
                                       max_lora_rank=8, adapter_store=store.address), http=True)
    yield store, node, root
    node.stop()


def test_an_adapter_over_the_rank_limit_is_refused_from_the_catalog_without_a_byte(wide_stack, tiny_llama_path):
    store, node, _ = wide_stack
    wait_for(lambda: store.catalog.get("wide") is not None and store.catalog.get("narrow") is not None, 30,
             "the store to list both adapters")

    def fetched() -> tuple[float, float]:
        return (store.metrics.value("adapter_store_fetches_total"), store.metrics.value("adapter_store_fetch_bytes_total"))

    before = fetched()
    with openai.OpenAI(base_url=node.http_url, api_key="-", max_retries=0, timeout=60) as api:
        for _ in range(3):  # every request, not only the first
            with pytest.raises(openai.BadRequestError) as err:
                api.completions.create(model="wide", prompt=PROMPT, max_tokens=2)
            assert err.value.body["message"] == ("adapter 'wide' has rank 16; this node serves ranks up to 8 "
                                                 "(--max-lora-rank)")
        assert fetched() == before  # zero fetches, zero bytes
        listed = {m.id for m in api.models.list().data}  # the module's bucket holds others' adapters too
        assert "narrow" in listed and "wide" not in listed
        with pytest.raises(openai.NotFoundError):
            api.models.retrieve("wide")
        assert api.completions.create(model="narrow", prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2
    assert fetched()[0] == before[0] + 1
    node.check_idle()


def test_the_same_bytes_have_one_version_from_a_folder_and_from_the_store(wide_stack, tiny_llama_path) -> None:
    store, _, root = wide_stack
    folder = LocalDirSource(root, ModelConfig.from_checkpoint(tiny_llama_path), max_rank=8)
    with AdapterStoreClient(store.address) as client:
        assert folder.load("narrow", "").version == client.get_manifest("narrow").info.version
