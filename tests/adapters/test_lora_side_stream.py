"""The decode graphs' LoRA side stream (inference_node/runner/lora/overlap.py): a step queues
work there only with a shrink whose end() joins it. A capture with side work no end() joins
fails ("capturing stream has unjoined work"): a mixture of experts' routed layers call no
begin/end for the dense gate/up and down, so a step whose adapters are on attention only,
with q/k/v and o folded into their matmuls, shrinks nothing on the side stream."""
from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

from inference_node.adapters.slots import SlotBuffers
from inference_node.model.config import ModelConfig
from inference_node.runner.lora import overlap
from kernels.lora import LoraBatchMeta
from kernels.tuning import DEFAULT_TUNING


@pytest.mark.parametrize("shrinks", [False, True])
def test_side_work_comes_only_with_a_shrink(shrinks: bool, tiny_llama_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    config = ModelConfig.from_checkpoint(tiny_llama_path)
    buffers = SlotBuffers(config, 2, 16, torch.float32, torch.device("cpu"))
    tuning = DEFAULT_TUNING.replace(fold_groups=frozenset({"qkv", "o"}), shrink_fold_groups=frozenset())
    side = overlap.LoraOverlap(buffers, 4, tuning)
    entered: list[str] = []
    monkeypatch.setattr(overlap.OverlappedLoraApplier, "_side",
                        lambda self: entered.append("side") or nullcontext())
    meta = LoraBatchMeta.build([0, 0, 1, -1], "cpu")
    applier = side.applier(meta)
    assert entered == []  # nothing queued until a group shrinks beside its matmul
    if shrinks:
        x = torch.randn(4, config.hidden_size)
        side.workspace.fill_(7.0)
        applier.begin(0, "gate_up", x)
        assert entered == ["side"] and not (side.workspace == 7.0).any()  # zeroed before the shrink
