"""The node's disk tier with a real store over a real SeaweedFS: an adapter the node loaded
once is served after a node restart from its disk (with the store stopped), listed as
ADAPTER_TIER_DISK; a disk copy that rotted is detected, deleted and fetched again from the
store, or refused while the store is down."""
from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import grpc
import pytest

from adapter_store.push import push_adapter
from harness import InProcessNode, make_peft_adapter, peft_greedy
from inference_node.config import NodeConfig
from lora.v1 import inference_pb2 as pb
from lora_client.node_client import NodeClient

PROMPT = [101, 2002, 3003, 4004, 505, 66]
WEIGHTS = "adapter_model.safetensors"


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_llama_path, s3, make_store):
    """The module's bucket with two adapters pushed, their PEFT outputs, and a store factory."""
    root = tmp_path_factory.mktemp("disk-tier")
    expected = {}
    for seed, name in enumerate(["alpha", "beta"]):
        folder = make_peft_adapter(tiny_llama_path, root / name, 8, 16.0, ["q_proj", "v_proj", "down_proj"],
                                   seed=seed, scale=3.0)
        push_adapter(folder, name, s3, "adapters/", progress=False)
        expected[name] = peft_greedy(tiny_llama_path, folder, [PROMPT], 24)[0]
    assert expected["alpha"] != expected["beta"]
    return root, make_store, expected


def start_node(tiny_llama_path: Path, store_address: str, disk: Path, fetch_timeout_s: float = 30.0) -> InProcessNode:
    return InProcessNode(NodeConfig.of(checkpoint=str(tiny_llama_path), device="cpu", num_kv_blocks=256, max_loras=1,
                                       max_lora_rank=16, adapter_store=store_address, adapter_disk_dir=str(disk),
                                       adapter_fetch_timeout_s=fetch_timeout_s, debug_checks=True))


def generate(node: InProcessNode, adapter: str):
    with NodeClient(node.address) as client:
        return client.generate(client.request(adapter=adapter, prompt_token_ids=PROMPT, max_tokens=24,
                                              ignore_eos=True), 120)


def listed(node: InProcessNode) -> dict[str, pb.AdapterStatus]:
    with NodeClient(node.address) as client:
        return {a.name: a for a in client.stub.ListAdapters(pb.ListAdaptersRequest(), timeout=30).adapters}


def disk_file(disk: Path, version: str, index: int) -> Path:
    [entry] = [p for p in disk.iterdir() if p.name.startswith(version)]
    return entry / str(index)


def test_a_restarted_node_serves_from_its_disk_with_the_store_stopped(world, tiny_llama_path, tmp_path) -> None:
    root, make_store, expected = world
    disk = tmp_path / "node-disk"
    store = make_store()
    node = start_node(tiny_llama_path, store.address, disk)
    try:
        first = generate(node, "alpha")
        assert first.token_ids == expected["alpha"]
        node.node.adapters.source.disk.flush()
        weights = disk_file(disk, first.adapter_version, 1).read_bytes()
        assert hashlib.sha256(weights).hexdigest() == hashlib.sha256(
            (root / "alpha" / WEIGHTS).read_bytes()).hexdigest()
        fetches = store.metrics.value("adapter_store_fetches_total")
    finally:
        node.stop()
    store.stop()  # from here on nothing answers at the store's address

    node = start_node(tiny_llama_path, store.address, disk)
    try:
        before = listed(node)
        assert before["alpha"].tier == pb.ADAPTER_TIER_DISK and before["alpha"].version == first.adapter_version
        assert "beta" not in before
        again = generate(node, "alpha")
        assert again.token_ids == expected["alpha"] and again.adapter_version == first.adapter_version
        assert listed(node)["alpha"].tier == pb.ADAPTER_TIER_GPU
        # An adapter the node never had cannot come from anywhere: UNAVAILABLE, the node keeps serving.
        node.node.adapters.source.fetch_deadline_s = 1.0
        with pytest.raises(grpc.RpcError) as info:
            generate(node, "beta")
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert generate(node, "alpha").token_ids == expected["alpha"]
        node.check_idle()
    finally:
        node.stop()
    assert store.metrics.value("adapter_store_fetches_total") == fetches


def test_a_rotten_disk_copy_is_refetched_or_refused_while_the_store_is_down(world, tiny_llama_path, tmp_path,
                                                                             caplog) -> None:
    root, make_store, expected = world
    caplog.set_level(logging.INFO)
    disk = tmp_path / "node-disk"
    store = make_store()
    node = start_node(tiny_llama_path, store.address, disk)
    try:
        version = generate(node, "beta").adapter_version
        node.node.adapters.source.disk.flush()
    finally:
        node.stop()

    def rot() -> None:
        path = disk_file(disk, version, 1)
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01  # one bit, as a bad disk would
        path.write_bytes(bytes(data))

    # The store is up: the bad copy is detected on read, deleted, and fetched again.
    rot()
    fetches = store.metrics.value("adapter_store_fetches_total")
    node = start_node(tiny_llama_path, store.address, disk)
    try:
        assert generate(node, "beta").token_ids == expected["beta"]
        assert store.metrics.value("adapter_store_fetches_total") == fetches + 1
        assert any("does not match its sha256" in m for m in caplog.messages), caplog.messages
        node.node.adapters.source.disk.flush()
        good = (root / "beta" / WEIGHTS).read_bytes()
        assert disk_file(disk, version, 1).read_bytes() == good  # rewritten from the store's copy
    finally:
        node.stop()

    # The store is down: the bad copy is refused, never served.
    rot()
    store.stop()
    node = start_node(tiny_llama_path, store.address, disk, fetch_timeout_s=1.0)
    try:
        with pytest.raises(grpc.RpcError) as info:
            generate(node, "beta")
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "failed its checksum" in info.value.details()
        assert "beta" not in listed(node)  # the bad copy was deleted
        node.check_idle()
    finally:
        node.stop()
