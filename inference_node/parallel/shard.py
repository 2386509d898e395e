"""Which part of every weight one tensor-parallel rank holds (the Megatron layout).

Column-parallel projections (q/k/v, gate/up) keep a contiguous block of output features:
whole attention heads, whole KV heads, a slice of the MLP's intermediate size. Row-parallel
ones (o, down) keep the matching block of input features; their partial outputs are summed
by one all-reduce. The embedding and the LM head keep a block of the vocabulary.

LoRA follows the same split, so the kernels see nothing but smaller matrices: on a
column-parallel projection A (rank x in) is whole and B keeps its output rows; on a
row-parallel one A keeps its input columns and B is whole. A row-parallel rank's delta
(x_r A_r^T) B^T is then a partial sum, like its base output, and the one all-reduce the base
projection needs adds both: no collective of its own for the rank-sized intermediate.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kernels.tuning import Tuning

from ..model.config import ModelConfig

COLUMN_PARALLEL = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"})
ROW_PARALLEL = frozenset({"o_proj", "down_proj"})


class ShardingError(ValueError):
    """The model cannot be split over this many ranks (a clear message for the operator)."""


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `size`; size 1 holds everything."""

    rank: int = 0
    size: int = 1

    def block(self, total: int) -> tuple[int, int]:
        """[start, stop) of this rank's even share of `total` (which size divides)."""
        per = total // self.size
        return self.rank * per, (self.rank + 1) * per

    def vocab_block(self, vocab: int) -> tuple[int, int, int]:
        """(start, stop, rows held): the vocabulary is cut in blocks of ceil(vocab / size)
        rows, the last rank's block zero-padded, so every rank's logits have one width."""
        per = -(-vocab // self.size)
        start = min(self.rank * per, vocab)
        return start, min(start + per, vocab), per

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The shapes this rank computes with: its heads, KV heads and intermediate columns
        (hidden size and vocabulary stay whole: the residual stream is replicated)."""
        if self.size == 1:
            return config
        check_divisible(config, self.size)
        return dataclasses.replace(
            config, num_heads=config.num_heads // self.size, num_kv_heads=config.num_kv_heads // self.size,
            intermediate_size=config.intermediate_size // self.size,
            moe_intermediate_size=config.moe_intermediate_size // self.size)

    def weight(self, module: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of a projection's [out, in] weight (or [out] bias)."""
        if self.size == 1:
            return full
        if module in COLUMN_PARALLEL:
            start, stop = self.block(full.shape[0])
            return full[start:stop]
        start, stop = self.block(full.shape[1])
        return full[:, start:stop]

    def lora_pair(self, module: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (A [r, in], B [out, r]) of one module of an adapter (the embedding's
        and the LM head's: whole on every rank)."""
        if self.size == 1 or module not in COLUMN_PARALLEL | ROW_PARALLEL:
            return a, b
        if module in COLUMN_PARALLEL:
            start, stop = self.block(b.shape[0])
            return a, b[start:stop]
        start, stop = self.block(a.shape[1])
        return a[:, start:stop], b


def check_divisible(config: ModelConfig, size: int) -> None:
    """Raises ShardingError naming what does not split over `size` ranks."""
    problems = []
    if config.num_heads % size:
        problems.append(f"{config.num_heads} attention heads")
    if config.num_kv_heads % size:
        problems.append(f"{config.num_kv_heads} key/value heads (GQA: each rank keeps whole KV heads; "
                        "replicating them is not supported)")
    if config.intermediate_size % size:
        problems.append(f"an intermediate size of {config.intermediate_size}")
    if config.moe_intermediate_size % size:
        problems.append(f"an expert intermediate size of {config.moe_intermediate_size}")
    if problems:
        raise ShardingError(f"--tensor-parallel-size {size} does not divide the model's "
                            f"{' and '.join(problems)}: pick a size that divides each")


# A bound no step's distinct adapters reach: "always" for side_expand_group_segments.
_ALWAYS = 1 << 30


def tensor_parallel_tuning(tuning: Tuning) -> Tuning:
    """The decode graphs' LoRA choices under tensor parallelism. A row-parallel projection's
    delta must be in its partial output before the all-reduce sums it, so o and down never
    leave their delta unexpanded for the add + norm after them (a shrink-only fold): their
    LoRA folds whole into the matmul or expands on the side stream."""
    return tuning.replace(
        shrink_fold_groups=tuning.shrink_fold_groups - {"o", "down"},
        fp8_shrink_fold_groups=tuning.fp8_shrink_fold_groups - {"o", "down"},
        side_expand_group_segments={**tuning.side_expand_group_segments, "o": _ALWAYS, "down": _ALWAYS})
