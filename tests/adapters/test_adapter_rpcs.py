"""Adapters through the node's gRPC surface: admin RPCs, statuses, cancellation, fairness."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import grpc
import pytest

from harness import InProcessNode, make_peft_adapter
from inference_node.config import NodeConfig
from lora.v1 import inference_pb2 as pb
from lora_client.node_client import NodeClient


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory, tiny_llama_path) -> Path:
    root = tmp_path_factory.mktemp("rpc-adapters")
    for seed, name in enumerate(["a", "b", "c"]):
        make_peft_adapter(tiny_llama_path, root / name, 4, 8.0, ["q_proj", "v_proj"], seed=seed, scale=3.0)
    make_peft_adapter(tiny_llama_path, root / "too-big", 32, 32.0, ["q_proj"], seed=9)
    # An adapter made for another model: hidden 64 here, 96 there.
    other = root / "other-model"
    make_peft_adapter(tiny_llama_path, other, 4, 8.0, ["q_proj"], seed=3)
    from safetensors.torch import load_file, save_file
    tensors = load_file(other / "adapter_model.safetensors")
    save_file({k: (v.repeat(1, 2)[:, :96].contiguous() if "lora_A" in k else v) for k, v in tensors.items()},
              other / "adapter_model.safetensors")
    bad = root / "not-lora"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(json.dumps({"peft_type": "PREFIX_TUNING", "r": 4}))
    (bad / "adapter_model.safetensors").write_bytes((root / "a" / "adapter_model.safetensors").read_bytes())
    return root


@pytest.fixture(scope="module")
def node(tiny_llama_path, adapter_dir):
    n = InProcessNode(NodeConfig.of(checkpoint=str(tiny_llama_path), device="cpu", num_kv_blocks=256,
                                    max_loras=2, max_lora_rank=16, adapter_dir=str(adapter_dir),
                                    debug_checks=True))
    yield n
    n.stop()


@pytest.fixture()
def client(node):
    with NodeClient(node.address) as c:
        yield c


def test_load_list_unload(client) -> None:
    loaded = client.stub.LoadAdapter(pb.LoadAdapterRequest(name="a", pin=True), timeout=60)
    assert loaded.tier == pb.ADAPTER_TIER_GPU and len(loaded.version) == 64
    listed = {a.name: a for a in client.stub.ListAdapters(pb.ListAdaptersRequest()).adapters}
    assert listed["a"].pinned and listed["a"].ref_count == 0 and listed["a"].slot >= 0
    assert listed["a"].rank == 4 and set(listed["a"].target_modules) == {"q_proj", "v_proj"}
    assert client.stub.UnloadAdapter(pb.UnloadAdapterRequest(name="a")).deferred is False
    assert "a" not in {a.name for a in client.stub.ListAdapters(pb.ListAdaptersRequest()).adapters}
    with pytest.raises(grpc.RpcError) as err:
        client.stub.UnloadAdapter(pb.UnloadAdapterRequest(name="a"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("name, code, words", [
    ("nobody", grpc.StatusCode.NOT_FOUND, "not found"),
    ("too-big", grpc.StatusCode.FAILED_PRECONDITION, "rank 32"),
    ("other-model", grpc.StatusCode.FAILED_PRECONDITION, "this base model needs"),
    ("not-lora", grpc.StatusCode.FAILED_PRECONDITION, "only LORA"),
])
def test_bad_adapters_get_clear_statuses(client, node, name, code, words) -> None:
    for call in (lambda: client.generate(client.request(adapter=name, prompt_token_ids=[5, 6], max_tokens=3), 60),
                 lambda: client.stub.LoadAdapter(pb.LoadAdapterRequest(name=name), timeout=60)):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == code
        assert words in err.value.details()
    node.check_idle()


def test_cancelled_adapter_request_returns_references(client, node) -> None:
    call = client.stream(client.request(adapter="b", prompt_token_ids=list(range(10, 60)), max_tokens=500,
                                        ignore_eos=True), timeout=60)
    next(call)
    assert node.node.adapters.current["b"].refs == 1
    call.cancel()
    deadline = time.monotonic() + 10
    while node.engine.num_inflight():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    node.check_idle()
    assert all(e.refs == 0 for e in node.node.adapters.entries())


def test_cold_adapter_is_served_under_steady_traffic_of_resident_ones(node) -> None:
    stop = threading.Event()
    done_after_cold: list[str] = []
    cold_started = threading.Event()

    def steady(adapter: str) -> None:
        with NodeClient(node.address) as c:
            while not stop.is_set():
                c.generate(c.request(adapter=adapter, prompt_token_ids=[7, 8, 9], max_tokens=30,
                                     ignore_eos=True), 60)
                if cold_started.is_set():
                    done_after_cold.append(adapter)

    threads = [threading.Thread(target=steady, args=(a,)) for a in ("a", "b", "a", "b")]
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)                     # both slots busy with a and b
        cold_started.set()
        started = time.monotonic()
        with NodeClient(node.address) as c:
            out = c.generate(c.request(adapter="c", prompt_token_ids=[7, 8, 9], max_tokens=5,
                                       ignore_eos=True), 60)
        waited = time.monotonic() - started
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert len(out.token_ids) == 5
    assert waited < 30, f"cold adapter waited {waited:.1f}s"
    assert done_after_cold, "steady traffic should have kept flowing"
    assert node.engine.call(node.engine.snapshot).result()["max_adapters_in_step"] <= 2
    node.check_idle()
