"""Numerically broken adapters: refused at load when their weights are out of bounds (the
shared validation, and the node's probe in the dtype it serves in); and at run time a row
whose logits are not finite ends its request with a clear status instead of tokens, marks
the adapter version unhealthy, and leaves the other rows of the batch untouched, through
the eager path and the graphs' static-buffer paths (decode, and piecewise for prompt steps)
alike."""
from __future__ import annotations

import threading
import urllib.request

import grpc
import pytest
import torch

from harness import InProcessNode, make_peft_adapter, wait_for
from inference_node.adapters.errors import AdapterRejected
from inference_node.adapters.sources import LocalDirSource, weights_from_files
from inference_node.model.config import ModelConfig
from inference_node.config import NodeConfig
from lora.v1 import inference_pb2 as pb
from lora_client.node_client import NodeClient
from lora_client.processes import free_port

PROMPTS = {"base": [5, 6, 7, 8], "good": [9, 10, 11, 12], "broken": [13, 14, 15, 16]}


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory, tiny_llama_path):
    root = tmp_path_factory.mktemp("health-adapters")
    make_peft_adapter(tiny_llama_path, root / "good", 4, 8.0, ["q_proj", "v_proj"], seed=1)
    make_peft_adapter(tiny_llama_path, root / "broken", 4, 8.0, ["q_proj", "v_proj", "down_proj"], seed=2)
    make_peft_adapter(tiny_llama_path, root / "huge", 4, 8.0, ["v_proj"], seed=3, scale=1e30)
    return root


class OverflowAfterValidation:
    """A source whose `broken` adapter passes validation, then has its weights scaled x1e30 in
    host memory: what the run-time check must catch when a check upstream misses something."""

    def __init__(self, inner: LocalDirSource) -> None:
        self.inner = inner

    def load(self, name: str, version: str, cancel=None):
        weights = self.inner.load(name, version)
        if name == "broken":
            weights.tensors = {k: (a * 1e30, b * 1e30) for k, (a, b) in weights.tensors.items()}
        return weights


# on: decode and prompt steps through the graphs' static buffers; cuda: captured CUDA graphs
GRAPH_MODES = ["off", "on", pytest.param("cuda", marks=pytest.mark.gpu)]


def start_node(tiny_llama_path, adapter_root, decode_graphs: str) -> InProcessNode:
    device = "cuda" if decode_graphs == "cuda" else "cpu"
    decode_graphs = "on" if decode_graphs == "cuda" else decode_graphs
    node = InProcessNode(NodeConfig.of(checkpoint=str(tiny_llama_path), device=device, dtype="float32",
                                       num_kv_blocks=64, max_loras=4,
                                       adapter_dir=str(adapter_root), decode_graphs=decode_graphs,
                                       mixed_graphs=decode_graphs, prefix_caching=False,
                                       metrics_port=free_port()))
    node.node.adapters.source = OverflowAfterValidation(node.node.adapters.source)
    return node


def alone(client: NodeClient, name: str, temperature: float = 0.0) -> list[int]:
    adapter = "" if name == "base" else name
    return client.generate(client.request(adapter=adapter, prompt_token_ids=PROMPTS[name], max_tokens=12,
                                          ignore_eos=True, temperature=temperature, seed=7), 60).token_ids


@pytest.mark.parametrize("decode_graphs", GRAPH_MODES)
def test_a_non_finite_row_fails_its_request_and_spares_the_batch(tiny_llama_path, adapter_root, decode_graphs):
    node = start_node(tiny_llama_path, adapter_root, decode_graphs)
    try:
        with NodeClient(node.address) as client:
            expected = {name: alone(client, name) for name in ("base", "good")}
            results: dict[str, object] = {}

            def run(name: str, temperature: float = 0.0) -> None:
                try:
                    results[(name, temperature)] = alone(client, name, temperature)
                except grpc.RpcError as exc:
                    results[(name, temperature)] = exc

            # One burst: the broken adapter's greedy and sampled rows share steps with the others.
            threads = [threading.Thread(target=run, args=args) for args in
                       (("base",), ("good",), ("broken",), ("broken", 0.8), ("base",), ("good",))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            for key in (("broken", 0.0), ("broken", 0.8)):
                error = results[key]
                assert isinstance(error, grpc.RpcError), f"{key}: {error}"
                assert error.code() == grpc.StatusCode.DATA_LOSS
                assert "adapter 'broken' version" in error.details() and "not finite" in error.details()
            assert results[("base", 0.0)] == expected["base"]
            assert results[("good", 0.0)] == expected["good"]

            adapters = {a.name: a for a in client.stub.ListAdapters(pb.ListAdaptersRequest(), timeout=10).adapters}
            assert adapters["broken"].unhealthy and adapters["broken"].numerical_faults == 2
            assert not adapters["good"].unhealthy and adapters["good"].numerical_faults == 0
            assert alone(client, "good") == expected["good"]  # the node keeps serving
            if decode_graphs != "off":  # the broken rows' first samples came from prompt steps
                assert node.engine.stats.piecewise_graph_steps > 0 and node.engine.stats.eager_prefill_steps == 0
        port = node.node.config.server.metrics_port
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert 'lora_node_adapter_numerical_faults_total{adapter="broken"} 2.0' in text
        assert 'lora_node_requests_total{adapter="broken",status="data_loss"} 2.0' in text
        assert "lora_node_non_finite_rows 2.0" in text
        wait_for(lambda: node.engine.call(node.engine.snapshot).result(10)["live_requests"] == 0, 30, "idle")
        snap = node.check_idle()
        assert snap["non_finite_rows"] == 2
    finally:
        node.stop()


@pytest.mark.parametrize("decode_graphs", GRAPH_MODES)
def test_a_base_row_gone_non_finite_in_decode_is_internal(tiny_llama_path, adapter_root, decode_graphs):
    """NaN written into one request's KV blocks after its prefill: its next decode step (a
    graph step when graphs are on) yields NaN logits for that row only."""
    node = start_node(tiny_llama_path, adapter_root, decode_graphs)
    try:
        with NodeClient(node.address) as client:
            expected = alone(client, "good")
            victim = client.stream(client.request(prompt_token_ids=PROMPTS["base"], max_tokens=400,
                                                  ignore_eos=True), timeout=60)
            assert next(victim).token_ids
            engine = node.engine

            def poison() -> None:
                req = next(r for r in engine._requests.values() if not r.adapter)
                engine.runner.kv._v[:, req.block_ids] = float("nan")

            other = client.stream(client.request(adapter="good", prompt_token_ids=PROMPTS["good"], max_tokens=12,
                                                 ignore_eos=True), timeout=60)
            engine.call(poison).result(10)
            with pytest.raises(grpc.RpcError) as err:
                for _ in victim:
                    pass
            assert err.value.code() == grpc.StatusCode.INTERNAL
            assert "base model's logits were not finite" in err.value.details()
            assert [t for m in other for t in m.token_ids] == expected
            if decode_graphs == "on":
                assert engine.stats.graph_steps > 0
        wait_for(lambda: node.engine.call(node.engine.snapshot).result(10)["live_requests"] == 0, 30, "idle")
        node.engine.runner.kv._v.zero_()
        node.check_idle()
    finally:
        node.stop()


def test_out_of_bound_weights_are_refused_at_load(tiny_llama_path, adapter_root):
    node = start_node(tiny_llama_path, adapter_root, "off")
    try:
        with NodeClient(node.address) as client:
            with pytest.raises(grpc.RpcError) as err:
                alone_huge = client.request(adapter="huge", prompt_token_ids=[5, 6], max_tokens=2)
                client.generate(alone_huge, 30)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "--max-weight-abs" in err.value.details()
            assert len(alone(client, "base")) == 12
    finally:
        node.stop()


def test_the_node_probes_in_the_dtype_it_serves(tiny_llama_path, adapter_root, tmp_path):
    """Weights of 300 are under the bound and fine in float32 and bfloat16, but their LoRA
    update of a unit input (about 300 * 64 * 300 * 4 * 2) overflows float16."""
    folder = make_peft_adapter(tiny_llama_path, tmp_path / "loud", 4, 8.0, ["q_proj"], seed=4)
    from safetensors.torch import load_file, save_file
    tensors = {k: torch.full_like(v, 300.0) for k, v in load_file(folder / "adapter_model.safetensors").items()}
    save_file(tensors, folder / "adapter_model.safetensors")
    config = ModelConfig.from_checkpoint(tiny_llama_path)
    files = ((folder / "adapter_config.json").read_bytes(), bytearray((folder / "adapter_model.safetensors").read_bytes()))
    for dtype in (torch.float32, torch.bfloat16):
        weights_from_files("loud", "v1", *files, config, 16, dtype=dtype)
    with pytest.raises(AdapterRejected, match="overflows float16, the dtype this node serves in"):
        weights_from_files("loud", "v1", *files, config, 16, dtype=torch.float16)


def test_the_dtype_probe_is_skipped_only_where_the_weight_bound_proves_it_finite():
    """Under a weight bound, a module whose worst-case update fits the dtype far over is not
    probed; float16, or no bound, still is. Weights of 1e38 (over any bound, as from a disk copy
    whose scan is skipped) show which modules were probed: they overflow bfloat16's cast."""
    from inference_node.adapters.weights import AdapterIncompatible, AdapterWeights, probe_in_dtype

    a, b = torch.full((4, 64), 3e38), torch.full((64, 4), 3e38)
    weights = AdapterWeights("w", "v1", 4, 2.0, ("q_proj",), {(0, "q_proj"): (a, b)})
    probe_in_dtype(weights, torch.bfloat16, max_weight_abs=1000.0)   # bound proves it: not probed
    with pytest.raises(AdapterIncompatible, match="bfloat16"):
        probe_in_dtype(weights, torch.bfloat16, max_weight_abs=0.0)  # no bound: probed
    with pytest.raises(AdapterIncompatible, match="float16"):
        probe_in_dtype(weights, torch.float16, max_weight_abs=1000.0)  # 2 * 4 * 64 * 1e6 > 65504 / 1024
