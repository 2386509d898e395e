"""How many KV blocks a CUDA node can afford: what the device has free, less what the node may
not take (1 - gpu_memory_utilization of it all), less the peak of the largest eager step's
activations (measured by running one), less a reserve for the decode graphs' memory pool and
the libraries' workspaces. With piecewise graphs for prefill and mixed steps (piecewise_graphs.py)
the largest step's activations are counted twice: their pool holds one piece's worth, which
eager steps (and the warm-up) cannot use, beside the static buffers between the pieces. The
weights and adapter slots are already allocated, so the free memory counts them."""
from __future__ import annotations

import logging

import torch

from ..model.forward import Decoder, ForwardBatch
from ..model.launch import LaunchChoices
from ..engine.kv_cache import KVCache

log = logging.getLogger(__name__)
GRAPHS_AND_WORKSPACES = 768 << 20  # decode graphs' pool (<= 64-row activations), cuBLAS/Triton scratch


def forward_peak_bytes(model: Decoder, launch: LaunchChoices, tokens: int, sampled_rows: int) -> int:
    """Peak memory one eager forward of `tokens` tokens takes beyond what is allocated now,
    with `sampled_rows` rows of logits (each token its own one-token sequence, writing its
    K/V into a one-block scratch cache: the activations are what a prefill step's are)."""
    device, cfg = model.device, model.config
    scratch = KVCache(cfg, 1, 16, model.dtype, device)
    rows = min(sampled_rows, tokens)
    batch = ForwardBatch(
        input_ids=torch.zeros(tokens, dtype=torch.long, device=device),
        positions=torch.zeros(tokens, dtype=torch.long, device=device),
        slot_mapping=torch.arange(tokens, device=device) % 16,
        block_tables=torch.zeros(tokens, 1, dtype=torch.int32, device=device),
        query_start_loc=torch.arange(tokens + 1, dtype=torch.int32, device=device),
        seq_lens=torch.ones(tokens, dtype=torch.int32, device=device),
        logits_indices=torch.arange(rows, device=device), max_query_len=1, max_seq_len=1)
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    logits = model.forward(batch, scratch.k, scratch.v, launch)
    widened = logits.float()  # the sampler's float32 copy of rows that sample
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del logits, widened, scratch
    torch.cuda.empty_cache()
    return peak


def kv_blocks_for_memory(model: Decoder, launch: LaunchChoices, utilization: float, block_size: int,
                         tokens: int, sampled_rows: int, piecewise_graphs: bool = False) -> int:
    device = model.device
    activations = forward_peak_bytes(model, launch, tokens, sampled_rows)
    free, total = torch.cuda.mem_get_info(device)
    graphs = activations if piecewise_graphs else 0
    budget = free - int(total * (1.0 - utilization)) - activations - graphs - GRAPHS_AND_WORKSPACES
    per_block = KVCache.bytes_per_block(model.config, block_size, model.dtype)
    blocks = budget // per_block
    log.info("GPU memory: %.1f of %.1f GiB free after the weights and adapter slots; an eager step of "
             "%d tokens peaks at %.2f GiB; with --gpu-memory-utilization %.2f the KV cache gets %.1f GiB",
             free / (1 << 30), total / (1 << 30), tokens, activations / (1 << 30), utilization,
             max(blocks, 0) * per_block / (1 << 30))
    if blocks < 1:
        raise RuntimeError(f"no GPU memory is left for the KV cache ({free / (1 << 30):.1f} GiB free of "
                           f"{total / (1 << 30):.1f}): raise --gpu-memory-utilization or lower "
                           "--max-num-batched-tokens, --max-loras or --max-lora-rank")
    return int(blocks)
