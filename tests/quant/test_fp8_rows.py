"""W8A8's activations quantized by the kernel that writes them (#57): under
`--quantization fp8-w8a8` the residual add + RMSNorm before q/k/v and gate/up hands the next
GEMM its rows in e4m3 too (Fp8Rows), so that GEMM launches no quantizer.
The copy is quantize_rows's bit for bit (tests/kernels/test_triton_kernels.py), so a node
answers the same tokens with the copies handed on as without: checked on the GPU with the
Triton kernels, and on the CPU with the PyTorch ops standing in for them (the model's seams:
the copies reach the FP8 GEMMs, the LoRA shrinks read the 16-bit rows). Likewise, on the GPU,
gate/up's FP8 GEMM writing SiLU(gate) * up itself (no SiLU launch) and the add + norm summing
o's and down's K splits (no sum launch), weight-only and W8A8."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from family_checkpoints import make_family_adapter
from inference_node.llm import LLM
from inference_node.model.launch import ElementwiseOps
from kernels.gemm.fp8 import Fp8Rows, quantize_rows
from kernels.tuning import Tuning

PROMPTS = [[500, 600, 700, 800], [1200, 1300, 1400, 1500, 1600, 1700, 1800], [42, 43]]
ADAPTER = "r8-all"


def rows_by_reference(monkeypatch: pytest.MonkeyPatch, scale_by: float = 1.0) -> None:
    """The CPU ops hand on Fp8Rows where asked, quantized by quantize_rows (as the Triton
    kernel does on a GPU); scale_by != 1 hands on wrong scales, which must show in the tokens."""
    norm = ElementwiseOps.add_rms_norm

    def with_rows(x: torch.Tensor) -> Fp8Rows:
        quantized, scale = quantize_rows(x)
        return Fp8Rows(x, quantized, scale.reshape(-1) * scale_by)

    def add_rms_norm(self, *args, quantize: bool = False, **kwargs):
        hidden, x = norm(self, *args, **kwargs)
        return hidden, with_rows(x) if quantize else x

    monkeypatch.setattr(ElementwiseOps, "add_rms_norm", add_rms_norm)


def answers(checkpoint: Path, adapters: Path, device: str, fuse: bool, quantization: str = "fp8-w8a8",
            max_lora_rank: int = 8, **tuning: object) -> list[list[int]]:
    """Greedy tokens of the base and an adapter under --quantization fp8-w8a8, graphs on;
    fuse False: the norms hand on 16-bit rows, and each FP8 GEMM quantizes its own; tuning:
    launch choices (gate_up_silu False: gate/up's GEMM then the SiLU kernel; split_sums_in_norm
    False: o's and down's K splits summed by their own launch, not the add + norm)."""
    dtype = "float32" if device == "cpu" else "bfloat16"
    with LLM(checkpoint=str(checkpoint), device=device, dtype=dtype, num_kv_blocks=128, max_loras=2,
             max_lora_rank=max_lora_rank, adapter_dir=str(adapters), quantization=quantization, debug_checks=True,
             decode_graphs="on", mixed_graphs="on", tuning=Tuning(**tuning),
             tuning_fixed=frozenset(tuning)) as llm:
        model = llm.engine.runner.model
        assert model.fp8_w8a8 == (quantization == "fp8-w8a8")
        model.norms_quantize = model.fp8_w8a8 and fuse  # the GEMMs keep W8A8's launches either way
        got = [a.token_ids for a in llm.generate(PROMPTS, 12, ignore_eos=True)]
        got += [a.token_ids for a in llm.generate(PROMPTS, 12, adapter=ADAPTER, ignore_eos=True)]
        assert llm.engine.snapshot()["graph_steps"] > 0
        return got


@pytest.fixture
def adapters(tmp_path: Path, request: pytest.FixtureRequest) -> tuple[Path, Path]:
    checkpoint = request.getfixturevalue(request.param)
    make_family_adapter(checkpoint, tmp_path / "adapters" / ADAPTER, 8, 16.0,
                        ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], scale=3.0)
    return checkpoint, tmp_path / "adapters"


@pytest.mark.parametrize("adapters", ["tiny_llama_path"], indirect=True)
def test_rows_handed_on_reach_the_fp8_gemms_on_the_cpu(adapters: tuple[Path, Path],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    checkpoint, root = adapters
    plain = answers(checkpoint, root, "cpu", fuse=False)
    rows_by_reference(monkeypatch)
    assert answers(checkpoint, root, "cpu", fuse=True) == plain
    rows_by_reference(monkeypatch, scale_by=4.0)
    assert answers(checkpoint, root, "cpu", fuse=True) != plain, "the GEMMs did not take the rows handed on"


@pytest.mark.gpu
@pytest.mark.parametrize("adapters", ["llama_8b_widths_path"], indirect=True)
def test_rows_quantized_by_the_norm_kernel_change_no_token(adapters: tuple[Path, Path]) -> None:
    """8B widths (a norm row in two chunks; with the adapter, rows split over programs): the
    Triton kernel's copies give the tokens the W8A8 GEMM's own quantizer gives."""
    checkpoint, root = adapters
    assert answers(checkpoint, root, "cuda", fuse=True) == answers(checkpoint, root, "cuda", fuse=False)


@pytest.mark.gpu
@pytest.mark.parametrize("quantization", ["fp8", "fp8-w8a8"])
@pytest.mark.parametrize("adapters", ["llama_8b_widths_path"], indirect=True)
def test_fp8_epilogues_change_no_token(adapters: tuple[Path, Path], quantization: str) -> None:
    """8B widths: gate/up's FP8 GEMM with the SiLU in its epilogue (in steps without LoRA),
    and o's and down's K splits summed by the add + norm after them (in steps with and
    without an adapter), give the tokens of the plain GEMMs, the SiLU kernel and the sum
    launches; weight-only and W8A8."""
    checkpoint, root = adapters
    assert (answers(checkpoint, root, "cuda", fuse=True, quantization=quantization)
            == answers(checkpoint, root, "cuda", fuse=True, quantization=quantization, gate_up_silu=False,
                       split_sums_in_norm=False))



@pytest.mark.gpu
@pytest.mark.parametrize("quantization", ["fp8", "fp8-w8a8"])
@pytest.mark.parametrize("adapters", ["llama_8b_widths_path"], indirect=True)
def test_lora_shrunk_in_the_fp8_gemms_launch_answers_as_the_side_stream(adapters: tuple[Path, Path],
                                                                       quantization: str) -> None:
    """8B widths: every group's LoRA shrink computed by programs of its FP8 GEMM's launch
    (Tuning.fp8_shrink_fold_groups; adapter memory of rank 16, the fold's smallest tile), the
    op after it expanding, answers as the shrinks on the side stream do; weight-only and W8A8.
    Both sum each row's x @ A.T in float32 in other orders, and a bf16 rounding apart moves a
    near-tie later on (seen: one adapter job of 6 from its 7th token): each job's first 4
    tokens equal, and 3 in 4 of all (tests/kernels/test_fp8_gemm_gpu.py checks the sums)."""
    checkpoint, root = adapters
    everywhere = dict(side_expand_segments=0, side_expand_group_segments={})
    folded = answers(checkpoint, root, "cuda", fuse=True, quantization=quantization, max_lora_rank=16,
                     fp8_shrink_fold_groups=frozenset({"qkv", "o", "gate_up", "down"}), **everywhere)
    beside = answers(checkpoint, root, "cuda", fuse=True, quantization=quantization, max_lora_rank=16,
                     fp8_shrink_fold_groups=frozenset(), **everywhere)
    assert all(a[:4] == b[:4] for a, b in zip(folded, beside)), (folded, beside)
    equal = sum(x == y for a, b in zip(folded, beside) for x, y in zip(a, b))
    assert 4 * equal >= 3 * sum(map(len, beside)), (folded, beside)
    half = len(PROMPTS)
    assert folded[half:] != folded[:half], "the adapter changes no answer"


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="Triton's FP8 GEMM and add + norm on the CPU: tests/kernels/test_triton_interpreter.py runs it")
@pytest.mark.parametrize("quantization", ["fp8", "fp8-w8a8"])
def test_lora_steps_hand_fp8_k_splits_to_the_add_norm(tiny_llama_path: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch, quantization: str) -> None:
    """In decode steps of 24 rows with an adapter on o and down, their FP8 GEMMs (two K splits
    each, more rows than the GEMM's own last program sums) hand their partials to the add +
    norm, which sums them and adds the LoRA delta: the tokens of the sum launches."""
    import kernels.norm.triton_kernel as norm_kernel
    from kernels.gemm.fp8 import SplitSums

    make_family_adapter(tiny_llama_path, tmp_path / "adapters" / ADAPTER, 8, 16.0,
                        ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], scale=3.0)
    seen: set[tuple[bool, bool]] = set()  # (partials handed on, a LoRA delta) per add + norm
    real = norm_kernel.add_rms_norm_triton

    def spy(hidden, out, weight, eps, delta=None, **kwargs):
        seen.add((isinstance(out, SplitSums), delta is not None))
        return real(hidden, out, weight, eps, delta, **kwargs)

    monkeypatch.setattr(norm_kernel, "add_rms_norm_triton", spy)
    field = "w8a8_tilings" if quantization == "fp8-w8a8" else "fp8_tilings"
    split = {field: {**getattr(Tuning(), field), "o": (64, 16, 2, 2), "down": (64, 16, 2, 2)}}
    prompts = [[500 + 7 * i, 600 + i, 700 + 3 * i] for i in range(24)]

    def adapter_answers(sums: bool) -> list[list[int]]:
        seen.clear()
        tuning = dict(split, split_sums_in_norm=sums)
        with LLM(checkpoint=str(tiny_llama_path), device="cpu", dtype="float32", num_kv_blocks=64, max_num_seqs=32,
                 max_loras=2, max_lora_rank=8, adapter_dir=str(tmp_path / "adapters"), quantization=quantization,
                 debug_checks=True, decode_graphs="on", mixed_graphs="off", tuning=Tuning(**tuning),
                 tuning_fixed=frozenset(tuning)) as llm:
            return [a.token_ids for a in llm.generate(prompts, 5, adapter=ADAPTER, ignore_eos=True)]

    summed_apart = adapter_answers(False)
    assert (True, True) not in seen
    assert adapter_answers(True) == summed_apart
    assert (True, True) in seen


@pytest.mark.parametrize("quantization", ["fp8", "fp8-w8a8"])
def test_fp8_gemms_ask_pdl_in_steps_without_lora_only(tiny_llama_path: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch, quantization: str) -> None:
    """Tuning.fp8_pdl: base steps hand every FP8 GEMM pdl=True (fp8_matmul then launches it
    with PDL at decode rows); steps with an adapter hand none, their side-stream LoRA kernels
    needing the SMs; fp8_pdl off hands none anywhere. Tuning.fp8_trigger: every step lets
    the kernel after each GEMM launch early, unless off."""
    import kernels.gemm.fp8_weight as fp8_weight

    make_family_adapter(tiny_llama_path, tmp_path / "adapters" / ADAPTER, 8, 16.0,
                        ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], scale=3.0)
    asked: list[tuple[bool, bool]] = []
    real_matmul, real_gated = fp8_weight.fp8_matmul, fp8_weight.fp8_gated_silu

    def matmul(*args, pdl=False, trigger=False, **kwargs):
        asked.append((pdl, trigger))
        return real_matmul(*args, pdl=pdl, trigger=trigger, **kwargs)

    def gated(*args, pdl=False, trigger=False, **kwargs):
        asked.append((pdl, trigger))
        return real_gated(*args, pdl=pdl, trigger=trigger, **kwargs)

    monkeypatch.setattr(fp8_weight, "fp8_matmul", matmul)
    monkeypatch.setattr(fp8_weight, "fp8_gated_silu", gated)

    def launches_asked(adapter: str | None, **tuning: bool) -> set[tuple[bool, bool]]:
        with LLM(checkpoint=str(tiny_llama_path), device="cpu", dtype="float32", num_kv_blocks=64, max_loras=2,
                 max_lora_rank=8, adapter_dir=str(tmp_path / "adapters"), quantization=quantization,
                 decode_graphs="off", tuning=Tuning(**tuning), tuning_fixed=frozenset(tuning)) as llm:
            asked.clear()
            llm.generate(PROMPTS, 3, adapter=adapter, ignore_eos=True)
            return set(asked)

    assert launches_asked(None) == {(True, True)}
    assert launches_asked(ADAPTER) == {(False, True)}
    assert launches_asked(None, fp8_pdl=False) == {(False, True)}
    assert launches_asked(ADAPTER, fp8_trigger=False) == {(False, False)}


def test_decode_launches_alone_take_pdl_and_the_early_trigger() -> None:
    """Past the decode rows a GEMM launches plainly: programs waiting early would hold SMs
    that the prefill tiling's tiles need (fp8.decode_launch)."""
    from kernels.gemm.fp8 import DECODE_ROWS, PDL_PREFETCH_K, decode_launch

    assert decode_launch(True, True, DECODE_ROWS) == {"pdl": True, "prefetch_k": PDL_PREFETCH_K, "trigger": True}
    assert decode_launch(False, True, 1) == {"trigger": True}
    assert decode_launch(True, False, 8) == {"pdl": True, "prefetch_k": PDL_PREFETCH_K}
    assert decode_launch(True, True, DECODE_ROWS + 1) == {}


def test_the_model_maps_a_tuning_to_what_its_matmuls_can_run(tiny_llama_path: Path, tiny_qwen2_path: Path) -> None:
    """LlamaModel.step_tuning, which the node and the profiler both apply: over FP8
    projections no group folds a whole LoRA and only fp8_shrink_fold_groups shrink in the
    GEMM; a biased group (Qwen2's q/k/v) folds nothing; plain bf16 Llama keeps its tuning."""
    from inference_node.model.loader import load_model

    asked = Tuning(fold_groups=frozenset({"qkv", "o", "gate_up", "down"}), shrink_fold_groups=frozenset({"down"}),
                   fold_shrink_spread=frozenset({"down"}), fp8_shrink_fold_groups=frozenset({"gate_up", "o"}))
    cpu = torch.device("cpu")
    plain = load_model(tiny_llama_path, cpu, torch.float32)
    assert plain.step_tuning(asked) == asked
    fp8 = load_model(tiny_llama_path, cpu, torch.float32, quantization="fp8")
    mapped = fp8.step_tuning(asked)
    assert (mapped.fold_groups, mapped.fold_shrink_spread) == (frozenset(), frozenset())
    assert mapped.shrink_fold_groups == {"gate_up", "o"}
    biased = load_model(tiny_qwen2_path, cpu, torch.float32).step_tuning(asked)
    assert biased.fold_groups == {"o", "gate_up", "down"} and "qkv" not in biased.shrink_fold_groups
