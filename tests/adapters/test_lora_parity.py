"""Mixed-adapter batches through gRPC equal Hugging Face PEFT running each adapter alone,
with less GPU adapter memory than the adapters need and fewer places in a step than adapters,
so eviction and reloading happen during the test."""
from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from harness import InProcessNode, make_peft_adapter, peft_greedy
from inference_node.adapters.slots import row_nbytes
from inference_node.model.config import ModelConfig
from inference_node.config import NodeConfig
from kernels.tuning_table import ModelShape, find_table
from lora_client.node_client import NodeClient

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name: (rank, alpha, target modules, rsLoRA)
ADAPTERS = {
    "r2-qv": (2, 4.0, ["q_proj", "v_proj"], False),
    "r8-all": (8, 16.0, ALL, False),
    "r16-attn-rs": (16, 8.0, ["q_proj", "k_proj", "v_proj", "o_proj"], True),
    "r32-mlp": (32, 32.0, ["gate_proj", "up_proj", "down_proj"], False),
    "r64-all-rs": (64, 16.0, ALL, True),
    "r4-ko": (4, 8.0, ["k_proj", "o_proj", "down_proj"], False),
}


def make_adapters(base: Path, root: Path, scale: float) -> Path:
    for seed, (name, (rank, alpha, targets, rs)) in enumerate(ADAPTERS.items()):
        make_peft_adapter(base, root / name, rank, alpha, targets, rs, seed=seed, scale=scale)
    return root


@pytest.mark.parametrize("which, scale, num_prompts, device", [
    ("tiny_llama", 3.0, 3, "cpu"),
    # SmolLM2 through PEFT, seven models: 40-380 s on a shared two-core machine.
    pytest.param("smollm2", 1.0, 2, "cpu", marks=pytest.mark.timeout(1200)),
    pytest.param("tiny_llama", 3.0, 3, "cuda", marks=pytest.mark.gpu),
    # Issue 33's 8B fast paths: the decode GEMM and LoRA folds at 8B widths, the table's tilings.
    pytest.param("llama_8b_widths", 1.0, 2, "cuda", marks=[pytest.mark.gpu, pytest.mark.timeout(1200)]),
])
def test_mixed_adapter_batch_matches_peft_with_eviction(which, scale, num_prompts, device, request,
                                                        tmp_path) -> None:
    base = request.getfixturevalue(f"{which}_path")
    adapter_dir = make_adapters(base, tmp_path / "adapters", scale)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randrange(4, 60))] for _ in range(num_prompts)]
    max_new = 12
    expected = {name: peft_greedy(base, adapter_dir / name, prompts, max_new) for name in ADAPTERS}
    expected[""] = peft_greedy(base, None, prompts, max_new)
    differs = sum(expected[n] != expected[""] for n in ADAPTERS)
    assert differs >= len(ADAPTERS) - 1, "the adapters barely change the model: the test would be weak"

    # Room for 96 rank rows per module: ranks 64 and 32 together, not all six adapters (126).
    row = sum(row_nbytes(ModelConfig.from_checkpoint(base), torch.float32).values())
    # On a GPU, the repository's table for its shape where one is filed: tables are tuned in
    # bfloat16, and this float32 node's `auto` looks for a float32 one.
    seed = find_table(torch.cuda.get_device_name(), ModelShape.of(ModelConfig.from_checkpoint(base)),
                      "bfloat16") if device == "cuda" else None
    node = InProcessNode(NodeConfig.of(checkpoint=str(base), device=device, dtype="float32", num_kv_blocks=256,
                                       max_loras=3, max_lora_rank=64, max_cpu_loras=4,
                                       lora_memory_bytes=96 * row,
                                       adapter_dir=str(adapter_dir), debug_checks=True,
                                       max_num_batched_tokens=128,
                                       tuning_table=str(seed) if seed else "auto"))
    try:
        jobs = [(name, i) for name in [""] + list(ADAPTERS) for i in range(len(prompts))]
        rng.shuffle(jobs)

        def run(job):
            name, i = job
            with NodeClient(node.address) as client:
                return client.generate(client.request(adapter=name, prompt_token_ids=prompts[i],
                                                      max_tokens=max_new, ignore_eos=True), timeout=300)

        with ThreadPoolExecutor(len(jobs)) as pool:
            results = list(pool.map(run, jobs))
        for (name, i), got in zip(jobs, results):
            assert got.token_ids == expected[name][i], f"adapter {name or 'base'} prompt {i} diverged"
        stats = node.node.adapters.stats
        assert stats["evictions"] > 0, "adapter memory < the adapters' sizes should have forced evictions"
        assert node.node.adapters.buffers.rows == 96
        node.check_idle()
        assert all(e.refs == 0 for e in node.node.adapters.entries())
    finally:
        node.stop()
