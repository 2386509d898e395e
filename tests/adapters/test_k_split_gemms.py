"""o's and down's 16-bit decode GEMM split over K (Tuning.gemm_split_k) hands its float32
partials to the add + norm after it, in base steps and in steps with LoRA on o and down, and
the tokens are the unsplit launches'. On the CPU the decode GEMM does not serve (cuBLAS's
place), so a stand-in computes each split's partial product as the kernel does; the GPU tier
checks the kernel itself (tests/kernels/test_kernels_gpu.py) and the tuner's parity test every
split it may pick (tests/tuner/test_tuner_gpu.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from family_checkpoints import make_family_adapter
from inference_node.llm import LLM
from kernels.gemm import DecodeGemm
from kernels.gemm.fp8 import SplitSums
from kernels.tuning import Tuning

ADAPTER = "r8-all"


def split_product(x: torch.Tensor, w: torch.Tensor, split_k: int) -> SplitSums:
    """What the K-split launch leaves: each K range's product in float32, split order."""
    step = x.shape[1] // split_k
    parts = torch.stack([x[:, s * step:(s + 1) * step].float() @ w[s * step:(s + 1) * step].float()
                         for s in range(split_k)])
    return SplitSums(parts, x.dtype)


def test_split_o_and_down_hand_their_partials_to_the_add_norm(tiny_llama_path: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import inference_node.model.launch as launch

    make_family_adapter(tiny_llama_path, tmp_path / "adapters" / ADAPTER, 8, 16.0,
                        ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], scale=3.0)
    seen: set[tuple[str, bool, bool]] = set()  # (group, partials handed on, step with LoRA)
    launched: list[int] = []

    def serves(self, group: str) -> bool:
        return group in ("o", "down")

    def applies(self, x, w, group=None) -> bool:
        return x.shape[0] <= 64 and group in ("o", "down")

    def fake_launch(self, x, w, group, gated=False, rope=None, split_k=1):
        launched.append(split_k)
        return split_product(x, w, split_k) if split_k > 1 else x @ w

    monkeypatch.setattr(DecodeGemm, "serves", serves)
    monkeypatch.setattr(DecodeGemm, "applies", applies)
    monkeypatch.setattr(DecodeGemm, "_launch", fake_launch)
    real_add_norm = launch.ElementwiseOps.add_rms_norm

    def spy(self, hidden, out, weight, eps, delta=None, **kwargs):
        seen.add((isinstance(out, SplitSums), delta is not None))
        return real_add_norm(self, hidden, out, weight, eps, delta, **kwargs)

    monkeypatch.setattr(launch.ElementwiseOps, "add_rms_norm", spy)
    prompts = [[500 + 7 * i, 600 + i, 700 + 3 * i] for i in range(12)]

    def answers(split: int) -> tuple[list[list[int]], list[list[int]]]:
        seen.clear()
        launched.clear()
        tuning = {"gemm_split_k": {"o": split, "down": split}}
        with LLM(checkpoint=str(tiny_llama_path), device="cpu", dtype="float32", num_kv_blocks=64, max_num_seqs=16,
                 max_loras=2, max_lora_rank=8, adapter_dir=str(tmp_path / "adapters"), debug_checks=True,
                 decode_graphs="on", mixed_graphs="off", tuning=Tuning(**tuning),
                 tuning_fixed=frozenset(tuning)) as llm:
            base = [a.token_ids for a in llm.generate(prompts, 5, ignore_eos=True)]
            lora = [a.token_ids for a in llm.generate(prompts, 5, adapter=ADAPTER, ignore_eos=True)]
        return base, lora

    whole = answers(1)
    assert (True, False) not in seen and (True, True) not in seen and set(launched) == {1}
    assert answers(2) == whole
    assert 2 in launched
    assert (True, False) in seen  # a base step's add + norm summed partials
    assert (True, True) in seen   # and a LoRA step's, with the delta
