"""--lora-modules: adapter memory only for the fused groups of the modules adapters may target.
A q/v node's memory is its q,k,v arenas plus one row per other group; its q/v adapters match
PEFT through the graph paths (decode and piecewise, on CPU through their static buffers),
and an adapter of another module gets a clear status while the node keeps serving."""
from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch

from harness import InProcessNode, make_peft_adapter, peft_greedy
from inference_node.adapters.slots import row_nbytes
from inference_node.model.config import ModelConfig
from inference_node.config import NodeConfig
from lora_client.node_client import NodeClient

QV = ("q_proj", "v_proj")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_qv_node_keeps_memory_for_qkv_only_and_matches_peft(tiny_llama_path: Path, tmp_path: Path,
                                                             device: str) -> None:
    root = tmp_path / "adapters"
    make_peft_adapter(tiny_llama_path, root / "qv", 8, 16.0, list(QV), seed=1, scale=3.0)
    make_peft_adapter(tiny_llama_path, root / "qv2", 16, 16.0, list(QV), seed=2, scale=3.0)
    make_peft_adapter(tiny_llama_path, root / "mlp", 4, 8.0, ["down_proj"], seed=3, scale=3.0)
    prompts = [[11, 400, 9000, 23, 7], [300, 301, 302, 303, 304, 305, 306, 307, 308]]
    expected = {n: peft_greedy(tiny_llama_path, root / n, prompts, 8) for n in ("qv", "qv2")}
    config = ModelConfig.from_checkpoint(tiny_llama_path)
    sizes = row_nbytes(config, torch.float32)
    node = InProcessNode(NodeConfig.of(checkpoint=str(tiny_llama_path), device=device, dtype="float32",
                                       num_kv_blocks=128, max_loras=2, max_lora_rank=16,
                                       lora_memory_bytes=24 * sum(sizes[m] for m in ("q_proj", "k_proj", "v_proj")),
                                       lora_modules=QV, adapter_dir=str(root), decode_graphs="on",
                                       mixed_graphs="on", debug_checks=True))
    try:
        buffers = node.node.adapters.buffers
        assert buffers.rows == 24
        qkv = sum(sizes[m] for m in ("q_proj", "k_proj", "v_proj"))
        assert buffers.nbytes() == 24 * qkv + sum(sizes.values()) - qkv  # other groups: one row
        with NodeClient(node.address) as client:
            for name in ("qv", "qv2"):
                for i, prompt in enumerate(prompts):
                    got = client.generate(client.request(adapter=name, prompt_token_ids=prompt, max_tokens=8,
                                                         ignore_eos=True), timeout=120)
                    assert got.token_ids == expected[name][i], f"{name} prompt {i} diverged"
            with pytest.raises(grpc.RpcError) as err:
                client.generate(client.request(adapter="mlp", prompt_token_ids=prompts[0], max_tokens=3), timeout=120)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--lora-modules" in err.value.details() and "down_proj" in err.value.details()
            again = client.generate(client.request(adapter="qv", prompt_token_ids=prompts[1], max_tokens=8,
                                                   ignore_eos=True), timeout=120)
            assert again.token_ids == expected["qv"][1]
        node.check_idle()
    finally:
        node.stop()
