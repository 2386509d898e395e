"""Compiles the kernels of eager steps before the node serves.

Decode steps replay CUDA graphs captured at start; every other step (prompts, mixed batches,
decode batches past the graph size) runs eagerly, and each Triton kernel there compiles a
variant on the first launch of each constexpr tiling: 0.3-2 s each, while every request in
flight waits. The tilings follow from a step's shape, not its data (kernels/lora/triton_kernel.py
choose_tiling, kernels/attention/triton_kernel.py), so a handful of synthetic forwards reach
them all: decode-shaped and prefill-shaped LoRA tilings (16-, 32- and 64-row tiles where the
adapter slots allow them), one- and many-token attention tiles, with and without LoRA, and
attention's split-key variants for contexts long enough to split.

The forwards read and write only the KV cache's scratch block (the one padded graph rows
use), so no request's state is touched; they sample nothing (the greedy argmax runs on their
logits only to compile its kernels).
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch

from kernels.sampling import first_argmax

from ..engine.config import EngineConfig
from ..engine.kv_cache import KVCache
from ..model.forward import Decoder, ForwardBatch
from .launches import StepLaunches
from .lora.plan import LoraStepPlan

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WarmupStep:
    """One synthetic eager forward: per sequence its new tokens and context (new included);
    per token its adapter slot, or None for a step without LoRA."""

    q_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    token_slots: tuple[int, ...] | None


def plan(max_num_seqs: int, max_tokens: int, max_model_len: int, max_loras: int) -> list[WarmupStep]:
    """The steps that reach every eager tiling these limits allow (each once with LoRA when
    max_loras > 0, and once without)."""
    # The shape thresholds of the kernels' tiling choices (imported here: the kernels load
    # Triton, which only a warm-up, not the engine's import, needs).
    from kernels.lora.triton_kernel import DECODE_SHAPED_TOKENS
    from kernels.attention.triton_kernel import SPLIT_KEYS_PAST

    prefill_lora_tokens = DECODE_SHAPED_TOKENS + 16  # past it: prefill-shaped LoRA tilings
    shapes: list[tuple[list[int], list[int], list[int]]] = []  # q_lens, seq_lens, slot per sequence

    def fresh(q_lens: list[int], slots: list[int]) -> None:
        shapes.append((q_lens, list(q_lens), slots))

    longest = max(1, min(max_tokens, max_model_len - 1))
    batch = max(1, min(max_num_seqs, max_tokens))
    loras = max(1, max_loras)
    context = min(max_model_len, 64)
    shapes.append(([1] * batch, [context] * batch, [i % loras for i in range(batch)]))  # eager decode
    fresh([min(longest, 16)], [0])                       # a short prompt: decode-shaped LoRA
    fresh([min(longest, 200)], [0])                      # a prompt of one adapter, under 256 tokens
    fresh([min(longest, 512)], [0])                      # past 256 tokens: 64-row LoRA tiles
    for rows in (16, 32):                                # 16- and 32-row tiles: many short prompts
        count = math.ceil(prefill_lora_tokens / rows)
        if max_tokens >= prefill_lora_tokens and count <= min(max_num_seqs, max_loras) and rows < max_model_len:
            fresh([rows] * count, list(range(count)))
    if max_model_len > SPLIT_KEYS_PAST:                  # decode over long contexts: split keys
        shapes.append(([1], [min(max_model_len, 4 * SPLIT_KEYS_PAST)], [0]))

    steps: list[WarmupStep] = []
    for q_lens, seq_lens, slots in shapes:
        per_token = tuple(s for q, s in zip(q_lens, slots) for _ in range(q))
        if max_loras > 0:
            steps.append(WarmupStep(tuple(q_lens), tuple(seq_lens), per_token))
        steps.append(WarmupStep(tuple(q_lens), tuple(seq_lens), None))
    return list(dict.fromkeys(steps))  # in order, without repeats


def scratch_batch(step: WarmupStep, block_size: int, scratch_block: int,
                  device: torch.device) -> ForwardBatch:
    """The step's forward batch with every block-table entry the scratch block."""
    positions: list[int] = []
    query_start = [0]
    for q, s in zip(step.q_lens, step.seq_lens):
        positions += range(s - q, s)
        query_start.append(query_start[-1] + q)
    width = max(math.ceil(s / block_size) for s in step.seq_lens)
    tokens = len(positions)

    def tensor(values: list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    return ForwardBatch(
        input_ids=tensor([1] * tokens, torch.long),
        positions=tensor(positions, torch.long),
        slot_mapping=tensor([scratch_block * block_size + p % block_size for p in positions], torch.long),
        block_tables=torch.full((len(step.q_lens), width), scratch_block, dtype=torch.int32, device=device),
        query_start_loc=tensor(query_start, torch.int32),
        seq_lens=tensor(list(step.seq_lens), torch.int32),
        logits_indices=tensor([end - 1 for end in query_start[1:]], torch.long),
        max_query_len=max(step.q_lens),
        max_seq_len=max(step.seq_lens),
    )


def warm_up(model: Decoder, launches: StepLaunches, kv: KVCache, lora: LoraStepPlan | None,
            config: EngineConfig) -> int:
    """Runs the plan's forwards for an engine of `config` on the model and the KV cache's
    scratch block (block config.num_kv_blocks); returns how many."""
    max_loras = lora.max_loras if lora is not None else 0
    steps = plan(config.max_num_seqs, config.max_num_batched_tokens, config.max_model_len, max_loras)
    started = time.monotonic()
    for step in steps:  # model.forward runs in inference mode, as in serving
        batch = scratch_batch(step, config.block_size, config.num_kv_blocks, model.device)
        applier = (lora.warmup_applier(list(step.token_slots))
                   if step.token_slots is not None and lora is not None else None)
        adapters = len({s for s in step.token_slots if s >= 0}) if applier is not None else 0
        launch = launches.for_step(len(batch.input_ids), adapters)  # the kernels its bucket launches
        logits = model.forward(batch, kv.k, kv.v, launch, applier)
        first_argmax(logits)  # the sampler's greedy pick: its kernels compile here too
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    log.info("warm-up: %d eager forwards in %.1f s", len(steps), time.monotonic() - started)
    return len(steps)
