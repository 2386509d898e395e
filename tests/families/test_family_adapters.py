"""An adapter is checked against its base model's family: a PEFT adapter on module names the
family does not have is refused in one line naming the modules it may target, on load and
through the node (FAILED_PRECONDITION), while the node serves everyone else."""
from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from family_checkpoints import make_family_adapter
from harness import InProcessNode
from inference_node.adapters.errors import AdapterRejected
from inference_node.adapters.sources import LocalDirSource
from inference_node.model.config import ModelConfig
from inference_node.config import NodeConfig
from lora_client.node_client import NodeClient


@pytest.fixture(scope="module")
def foreign_adapters(tmp_path_factory, tiny_llama_path, tiny_phi3_path) -> Path:
    """A Llama adapter on q_proj/v_proj and a Phi-3 one on qkv_proj, side by side."""
    root = tmp_path_factory.mktemp("foreign")
    make_family_adapter(tiny_llama_path, root / "llama-qv", 4, 8.0, ["q_proj", "v_proj"])
    make_family_adapter(tiny_phi3_path, root / "phi3-qkv", 4, 8.0, ["qkv_proj", "lm_head"])
    return root


@pytest.mark.parametrize("base, adapter, message", [
    ("phi3", "llama-qv", "targets q_proj, v_proj, which this phi3 base model does not have: its adapters "
                         "target qkv_proj, o_proj, gate_up_proj, down_proj, embed_tokens, lm_head"),
    ("llama", "phi3-qkv", "targets qkv_proj, which this llama base model does not have: its adapters target "
                          "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, embed_tokens, lm_head"),
])
def test_an_adapter_of_another_family_is_refused_naming_the_modules(base, adapter, message, foreign_adapters,
                                                                    request) -> None:
    path = request.getfixturevalue(f"tiny_{base}_path")
    source = LocalDirSource(foreign_adapters, ModelConfig.from_checkpoint(path), max_rank=16)
    with pytest.raises(AdapterRejected) as refused:
        source.load(adapter, "")
    assert message in str(refused.value) and "\n" not in str(refused.value)
    own = "phi3-qkv" if base == "phi3" else "llama-qv"
    assert source.load(own, "").rank == 4


def test_node_refuses_a_foreign_adapter_and_serves_the_rest(foreign_adapters, tiny_phi3_path) -> None:
    node = InProcessNode(NodeConfig.of(checkpoint=str(tiny_phi3_path), device="cpu", num_kv_blocks=64,
                                      max_lora_rank=16, adapter_dir=str(foreign_adapters)))
    try:
        with NodeClient(node.address) as client:
            with pytest.raises(grpc.RpcError) as refused:
                client.generate(client.request(adapter="llama-qv", prompt_token_ids=[5, 6, 7], max_tokens=3))
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "which this phi3 base model does not have" in refused.value.details()
            answer = client.generate(client.request(adapter="phi3-qkv", prompt_token_ids=[5, 6, 7], max_tokens=3,
                                                    ignore_eos=True))
            assert len(answer.token_ids) == 3
        node.check_idle()
    finally:
        node.stop()
