"""The node fed by a real adapter store over a real SeaweedFS: adapters load on demand and
match PEFT; a re-upload is served at its new version to new requests while a running one
finishes on the old; a deletion makes the adapter NOT_FOUND."""
from __future__ import annotations

import threading

import grpc
import pytest

from adapter_store.client import AdapterStoreClient
from adapter_store.push import push_adapter
from harness import InProcessNode, make_peft_adapter, peft_greedy, wait_for
from inference_node.config import NodeConfig
from lora_client.node_client import NodeClient

PROMPT = [101, 2002, 3003, 4004, 505, 66]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_llama_path, s3, make_store):
    root = tmp_path_factory.mktemp("stack")
    store = make_store()
    node = InProcessNode(NodeConfig.of(checkpoint=str(tiny_llama_path), device="cpu", num_kv_blocks=256,
                                       max_loras=1, max_lora_rank=16, adapter_store=store.address,
                                       adapter_disk_tier=False, debug_checks=True))
    yield root, s3, store, node
    node.stop()


def test_adapters_from_the_store(stack, tiny_llama_path) -> None:
    root, s3, store, node = stack
    folders = {}
    for seed, name in enumerate(["alpha", "beta"]):
        folders[name] = make_peft_adapter(tiny_llama_path, root / name, 8, 16.0, ["q_proj", "v_proj", "down_proj"],
                                          seed=seed, scale=3.0)
        push_adapter(folders[name], name, s3, "adapters/", progress=False)
    v2_folder = make_peft_adapter(tiny_llama_path, root / "alpha-v2", 8, 16.0, ["q_proj", "v_proj"], seed=7, scale=3.0)
    expected = {name: peft_greedy(tiny_llama_path, folder, [PROMPT], 40)[0] for name, folder in folders.items()}
    expected_v2 = peft_greedy(tiny_llama_path, v2_folder, [PROMPT], 40)[0]
    assert len({tuple(v) for v in (*expected.values(), expected_v2)}) == 3

    with NodeClient(node.address) as client:
        # On demand, both adapters through one slot (max_loras=1), concurrently.
        results = {}
        threads = [threading.Thread(target=lambda n=n: results.__setitem__(n, client.generate(
            client.request(adapter=n, prompt_token_ids=PROMPT, max_tokens=40, ignore_eos=True), 120)))
            for n in ("alpha", "beta")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        v1 = results["alpha"].adapter_version
        for name in ("alpha", "beta"):
            assert results[name].token_ids == expected[name]
        with AdapterStoreClient(store.address) as store_client:
            assert v1 == store_client.get_manifest("alpha").info.version

        # A running request keeps v1 while a re-upload makes v2 current for new requests.
        running = client.stream(client.request(adapter="alpha", prompt_token_ids=PROMPT, max_tokens=40,
                                               ignore_eos=True), timeout=120)
        first = next(running)
        push_adapter(v2_folder, "alpha", s3, "adapters/", progress=False)
        manager = node.node.adapters
        wait_for(lambda: node.engine.call(lambda: getattr(manager.current.get("alpha"), "version", v1)).result() != v1,
                 30, "the node to see alpha's new version")
        fresh = client.generate(client.request(adapter="alpha", prompt_token_ids=PROMPT, max_tokens=40,
                                               ignore_eos=True), 120)
        rest = list(running)
        old_tokens = list(first.token_ids) + [t for m in rest for t in m.token_ids]
        assert rest[-1].adapter_version == v1 and old_tokens == expected["alpha"]
        assert fresh.adapter_version != v1 and fresh.token_ids == expected_v2

        # Deleted in the bucket: new requests get NOT_FOUND.
        for filename in ("adapter_model.safetensors", "adapter_config.json"):
            s3.delete(f"adapters/beta/{filename}")
        wait_for(lambda: "beta" not in node.engine.call(lambda: set(manager.current)).result(), 30,
                 "the node to forget beta")
        with pytest.raises(grpc.RpcError) as err:
            client.generate(client.request(adapter="beta", prompt_token_ids=PROMPT, max_tokens=4), 60)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    node.check_idle()
