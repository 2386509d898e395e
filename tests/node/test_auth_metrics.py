"""Admin RPCs and Generate behind bearer tokens; Prometheus metrics; no secret in logs."""
from __future__ import annotations

import logging
import urllib.request

import grpc
import pytest

from harness import InProcessNode, make_peft_adapter
from inference_node.config import NodeConfig
from lora.v1 import inference_pb2 as pb
from lora_client.node_client import NodeClient
from lora_client.processes import free_port

ADMIN, GEN = "admin-s3cret-token", "generate-s3cret-token"


@pytest.fixture(scope="module")
def node(tmp_path_factory, tiny_llama_path):
    root = tmp_path_factory.mktemp("auth-adapters")
    make_peft_adapter(tiny_llama_path, root / "a", 4, 8.0, ["q_proj"], seed=1)
    n = InProcessNode(NodeConfig.of(checkpoint=str(tiny_llama_path), device="cpu", num_kv_blocks=64, max_loras=2,
                                    adapter_dir=str(root), admin_token=ADMIN, generate_token=GEN,
                                    metrics_port=free_port()))
    yield n
    n.stop()


@pytest.mark.parametrize("token", [None, "wrong", GEN])
def test_admin_rpcs_refuse_missing_or_wrong_tokens(node, token) -> None:
    with NodeClient(node.address, token=token) as client:
        for call in (lambda: client.stub.LoadAdapter(pb.LoadAdapterRequest(name="a"), metadata=client.metadata),
                     lambda: client.stub.UnloadAdapter(pb.UnloadAdapterRequest(name="a"), metadata=client.metadata)):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "Bearer" in err.value.details() and ADMIN not in err.value.details()


def test_admin_token_opens_admin_rpcs(node) -> None:
    with NodeClient(node.address, token=ADMIN) as client:
        reply = client.stub.LoadAdapter(pb.LoadAdapterRequest(name="a"), metadata=client.metadata, timeout=60)
        assert reply.tier == pb.ADAPTER_TIER_GPU


def test_generate_needs_its_own_token(node) -> None:
    request = NodeClient.request(prompt_token_ids=[5, 6, 7], max_tokens=3, ignore_eos=True)
    with NodeClient(node.address) as anonymous:
        with pytest.raises(grpc.RpcError) as err:
            anonymous.generate(request, 30)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with NodeClient(node.address, token=GEN) as client:
        assert len(client.generate(request, 30).token_ids) == 3


def test_metrics_endpoint_reports_requests_latency_and_engine_state(node) -> None:
    shared = list(range(300, 340))  # 40 tokens: two full blocks of 16 are reused the second time
    with NodeClient(node.address, token=GEN) as client:
        client.generate(NodeClient.request(prompt_token_ids=[5, 6, 7], max_tokens=4, ignore_eos=True), 30)
        for tail in ([1], [2]):
            client.generate(NodeClient.request(prompt_token_ids=shared + tail, max_tokens=2, ignore_eos=True), 30)
    port = node.node.config.server.metrics_port
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert 'lora_node_requests_total{adapter="",status="length"}' in text
    assert "lora_node_time_to_first_token_seconds_count" in text
    assert "lora_node_time_per_output_token_seconds_bucket" in text
    assert "lora_node_kv_blocks_total 64.0" in text
    assert "lora_node_waiting" in text and "lora_node_adapters_gpu" in text
    assert 'lora_node_prefix_cache_hit_tokens{adapter=""} 32.0' in text
    assert 'lora_node_prefix_cache_hits{adapter=""} 1.0' in text


def test_tokens_never_reach_logs_or_help(caplog, tiny_llama_path, monkeypatch) -> None:
    monkeypatch.setenv("INFERENCE_NODE_ADMIN_TOKEN", ADMIN)
    from inference_node.cli import parser
    help_text = parser()._subparsers._group_actions[0].choices["serve"].format_help()
    assert ADMIN not in help_text and "INFERENCE_NODE_ADMIN_TOKEN" in help_text
    assert ADMIN not in repr(NodeConfig.of(admin_token=ADMIN))
    with caplog.at_level(logging.DEBUG):
        n = InProcessNode(NodeConfig.of(checkpoint=str(tiny_llama_path), device="cpu", num_kv_blocks=16,
                                        admin_token=ADMIN, generate_token=GEN))
        n.stop()
    assert ADMIN not in caplog.text and GEN not in caplog.text
