"""The node's forward of every family against transformers' logits on the same tiny
checkpoint (float32, CPU): a prompt longer than the sliding window, run in chunks through the
paged KV cache, so every switch (biases, q/k norms, windows, soft-caps, Gemma's norms and
scaled embeddings, Phi-3's fused weights) shows in the logits."""
from __future__ import annotations

import pytest
import torch

from family_checkpoints import FAMILIES
from inference_node.engine.kv_cache import KVCache
from inference_node.model.forward import ForwardBatch
from inference_node.model.launch import LaunchChoices
from inference_node.model.llama import LlamaModel
from inference_node.model.loader import load_model
from kernels.tuning import DEFAULT_TUNING


def run_chunks(model: LlamaModel, tokens: list[int], chunks: list[int], block_size: int = 4) -> torch.Tensor:
    """The logits of every token, the prompt fed in chunks of these sizes over one sequence's
    blocks (in reverse order, so block ids and positions differ)."""
    kv = KVCache(model.config, 64, block_size, model.dtype, model.device)
    blocks = list(range(63, 63 - (len(tokens) + block_size - 1) // block_size, -1))
    out, start = [], 0
    for n in chunks:
        end = start + n
        positions = list(range(start, end))
        batch = ForwardBatch(
            input_ids=torch.tensor(tokens[start:end]), positions=torch.tensor(positions),
            slot_mapping=torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in positions]),
            block_tables=torch.tensor([blocks], dtype=torch.int32),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32),
            seq_lens=torch.tensor([end], dtype=torch.int32), logits_indices=None,
            max_query_len=n, max_seq_len=end)
        out.append(model.forward(batch, kv.k, kv.v, LaunchChoices.of(model.device, DEFAULT_TUNING)))
        start = end
    return torch.cat(out)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(family: str, request: pytest.FixtureRequest) -> None:
    from transformers import AutoModelForCausalLM

    path = request.getfixturevalue(f"tiny_{family}_path")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = load_model(path, torch.device("cpu"), torch.float32)
    assert model.config.family == family
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(100, 40000, (45,), generator=gen).tolist()
    ours = run_chunks(model, tokens, [17, 9, 1, 1, 16, 1])
    with torch.no_grad():
        theirs = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
