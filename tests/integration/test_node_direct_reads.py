"""The node's direct reads (--adapter-direct-reads) with a real store over a real SeaweedFS: a
node whose store offers read plans loads adapters straight from S3 (no FetchAdapter call)
and generates what PEFT does; bytes that fail the catalog's BLAKE3 are refused and the
adapter is streamed from the store instead (logged without the URL, counted); a store
without --direct-reads is streamed from; unknown and invalid adapters are refused as
before."""
from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from adapter_store.push import push_adapter
from adapter_store.read_plans import DirectReads
from tcp_proxy import CorruptingProxy
from harness import InProcessNode, make_peft_adapter, peft_greedy
from inference_node.adapters.direct_reads import DirectReadSettings
from inference_node.adapters.errors import AdapterNotFound, AdapterRejected
from inference_node.adapters.store_source import StoreSource
from inference_node.metrics import NodeMetrics
from inference_node.model.config import ModelConfig
from inference_node.config import NodeConfig
from lora_client.node_client import NodeClient

PROMPT = [101, 2002, 3003, 4004, 505, 66]
WEIGHTS = "adapter_model.safetensors"


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_llama_path, seaweed, bucket, s3, make_store):
    """The module's bucket with one adapter (and one invalid) pushed, its PEFT output, and a store factory."""
    root = tmp_path_factory.mktemp("direct-reads")
    folder = make_peft_adapter(tiny_llama_path, root / "alpha", 8, 16.0, ["q_proj", "v_proj", "down_proj"],
                               seed=3, scale=3.0)
    push_adapter(folder, "alpha", s3, "adapters/", progress=False)
    seaweed.boto3_client().put_object(Bucket=bucket, Key="adapters/broken/adapter_config.json", Body=b"{}")
    seaweed.boto3_client().upload_file(str(folder / WEIGHTS), bucket, f"adapters/broken/{WEIGHTS}")
    expected = peft_greedy(tiny_llama_path, folder, [PROMPT], 24)[0]
    return seaweed, make_store, folder, expected


def test_a_node_reads_adapters_straight_from_s3(world, tiny_llama_path) -> None:
    seaweed, make_store, folder, expected = world
    store = make_store(direct_reads=DirectReads(enabled=True))
    node = InProcessNode(NodeConfig.of(checkpoint=str(tiny_llama_path), device="cpu", num_kv_blocks=256, max_loras=1,
                                       max_lora_rank=16, adapter_store=store.address, adapter_direct_reads=True,
                                       adapter_disk_tier=False,
                                       debug_checks=True))
    try:
        with NodeClient(node.address) as client:
            result = client.generate(client.request(adapter="alpha", prompt_token_ids=PROMPT, max_tokens=24,
                                                    ignore_eos=True), 120)
        assert result.token_ids == expected
        snap = node.engine.call(node.node.snapshot).result(30)
        assert snap["adapter_direct_reads"] == {"direct": 1, "fallback": 0, "declined": 0}
        exported = NodeMetrics(lambda: node.engine.call(node.node.snapshot).result(30)).registry
        assert [exported.get_sample_value("lora_node_adapter_direct_reads_total", {"outcome": o})
                for o in ("direct", "fallback", "declined")] == [1, 0, 0]
        assert store.metrics.value("adapter_store_fetches_total") == 0  # no byte went through the store
        assert store.metrics.value("adapter_store_read_plans_total", outcome="offered") == 1
    finally:
        node.stop()


def source(tiny_llama_path, address: str) -> StoreSource:
    return StoreSource(address, ModelConfig.from_checkpoint(tiny_llama_path), 16, fetch_deadline_s=20,
                       direct_reads=DirectReadSettings(range_bytes=64 << 10))


def test_bytes_failing_the_catalogs_digest_are_streamed_from_the_store_instead(world, tiny_llama_path, monkeypatch,
                                                                               caplog) -> None:
    seaweed, make_store, folder, _ = world
    proxy = CorruptingProxy(seaweed.ports["s3"])
    for key, value in seaweed.env().items():  # credentials of the store's presigning client
        monkeypatch.setenv(key, value)
    caplog.set_level(logging.INFO, logger="inference_node")
    try:
        store = make_store(direct_reads=DirectReads(enabled=True, endpoint=proxy.url))
        loads = source(tiny_llama_path, store.address)
        try:
            weights = loads.load("alpha", "")
        finally:
            loads.close()
        assert proxy.flipped >= 1
    finally:
        proxy.close()
    assert loads.direct_reads == {"direct": 0, "fallback": 1, "declined": 0}
    assert store.metrics.value("adapter_store_fetches_total") == 1
    failure = [r.getMessage() for r in caplog.records if "streaming it from the store instead" in r.getMessage()]
    assert len(failure) == 1 and "BLAKE3" in failure[0] and WEIGHTS in failure[0]
    assert "X-Amz" not in caplog.text and proxy.url not in caplog.text
    reference = source(tiny_llama_path, make_store().address)
    try:
        streamed = reference.load("alpha", "")
    finally:
        reference.close()
    assert weights.version == streamed.version and weights.tensors.keys() == streamed.tensors.keys()
    for key, (a, b) in streamed.tensors.items():
        assert a.equal(weights.tensors[key][0]) and b.equal(weights.tensors[key][1])


def test_a_store_without_direct_reads_is_streamed_from(world, tiny_llama_path) -> None:
    _, make_store, _, _ = world
    store = make_store()
    loads = source(tiny_llama_path, store.address)
    try:
        assert loads.load("alpha", "").rank == 8
        with pytest.raises(AdapterNotFound):
            loads.load("nobody", "")
        with pytest.raises(AdapterRejected, match="invalid"):
            loads.load("broken", "")
    finally:
        loads.close()
    assert loads.direct_reads == {"direct": 0, "fallback": 0, "declined": 1}
    assert store.metrics.value("adapter_store_fetches_total") == 3


def test_unknown_and_invalid_adapters_get_no_plan_and_are_refused(world, tiny_llama_path) -> None:
    _, make_store, _, _ = world
    store = make_store(direct_reads=replace(DirectReads(), enabled=True))
    loads = source(tiny_llama_path, store.address)
    try:
        with pytest.raises(AdapterNotFound):
            loads.load("nobody", "")
        with pytest.raises(AdapterRejected, match="invalid"):
            loads.load("broken", "")
        assert loads.load("alpha", "").rank == 8
    finally:
        loads.close()
    assert loads.direct_reads == {"direct": 1, "fallback": 0, "declined": 0}
    assert store.metrics.value("adapter_store_read_plans_total", outcome="not_found") == 1
    assert store.metrics.value("adapter_store_read_plans_total", outcome="failed_precondition") == 1
