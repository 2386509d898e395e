"""FP8 weights under tensor parallelism on the CPU (gloo): each rank keeps its rows or columns
of every FP8 projection with the scales that go with them (cut off the block edges here: the
shards start mid-block), so TP=2 gives TP=1's greedy tokens, base and adapters alike; with
`--quantization fp8` a row-parallel projection's per-channel scales come from its whole rows."""
from __future__ import annotations

from pathlib import Path

import pytest

from fp8_checkpoints import write_fp8_checkpoint
from harness import make_peft_adapter

PROMPTS = [[11, 2345, 876, 40], [7, 8, 9, 10, 11, 12], [3000, 12, 4]]
ADAPTERS = {"qv2": (2, ["q_proj", "v_proj"]), "od8": (8, ["o_proj", "down_proj", "gate_proj"])}


def greedy(model: Path, size: int, adapter_dir: Path, **settings: object) -> list[list[int]]:
    from inference_node.llm import LLM

    with LLM(checkpoint=str(model), device="cpu", num_kv_blocks=64, cpu_threads=1, tensor_parallel_size=size,
             max_loras=2, max_lora_rank=8, adapter_dir=str(adapter_dir), debug_checks=True, **settings) as llm:
        return [a.token_ids for name in ["", *ADAPTERS] for a in llm.generate(PROMPTS, 8, adapter=name,
                                                                               ignore_eos=True)]


@pytest.mark.parametrize("source", ["block", "at-load"])
def test_fp8_over_two_ranks_gives_one_ranks_tokens(source: str, tiny_llama_path: Path, tmp_path: Path) -> None:
    if source == "block":  # 48-wide blocks: every shard edge (32 of q's 64 rows, 80 of down's 160 columns) mid-block
        model, settings = write_fp8_checkpoint(tiny_llama_path, tmp_path / "fp8", "fp8", (48, 48)), {}
    else:
        model, settings = tiny_llama_path, {"quantization": "fp8"}
    adapters = tmp_path / "adapters"
    for seed, (name, (rank, targets)) in enumerate(ADAPTERS.items()):
        make_peft_adapter(tiny_llama_path, adapters / name, rank, 2.0 * rank, targets, seed=seed)
    one = greedy(model, 1, adapters, **settings)
    assert one == greedy(model, 2, adapters, **settings)
    assert len(set(map(tuple, one))) > len(PROMPTS)  # the adapters answer apart from the base
