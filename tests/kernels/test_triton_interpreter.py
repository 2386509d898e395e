"""The Triton kernels, and the node paths that launch them, in Triton's interpreter on the CPU:
the slow tier (`make test-kernels`, marked `interpreter`; `make test` leaves it out).

TRITON_INTERPRET must be set before Triton is imported (and kernels are decorated), which a
shared pytest process cannot guarantee without changing how every other test sees Triton.
Each test here runs a child pytest with the variable set, so the switch stays local.

- test_triton_kernels.py, in three parts: every kernel against its PyTorch reference.
- test_allreduce_triton.py: the fused all-reduce's copy, sum, add and norm in one process
  (its flags between GPUs left out: the math only).
- The engine's decode-graph path, one case a child: the node's CPU graph steps with the
  Triton kernels (interpreted) instead of the references, so the seam between the engine
  (rows ordered by adapter, the segment table it fills) and the kernels that read it is
  checked against PEFT without a GPU. The same for the piecewise graphs of prompt steps
  (the LoRA segments of a bucket's size they fill, attention over their static buffers).
- Four families' mixed batches through the graphs (Gemma 3, Qwen3, Phi-3, Qwen3-MoE): the
  kernels with the families' options where the engine launches them, against PEFT.
- The node's start-up warm-up, then a mixed workload: the workload launches no kernel
  variant the warm-up did not (so on a GPU nothing compiles under requests); with prompt
  steps eager, and replayed piece by piece.

Timeouts: about three times what each took on a shared two-core machine.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
GRAPHS = "tests/adapters/test_decode_graphs.py"
MIXED = f"{GRAPHS}::test_graph_decode_matches_peft_for_mixed_adapters"
PIECES = "tests/adapters/test_piecewise_graphs.py"
FAMILIES = "tests/families/test_family_parity.py"
FP8_ROWS = "tests/quant/test_fp8_rows.py"

pytestmark = [pytest.mark.interpreter,
              pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                 reason="Triton not installed")]

# Parts of test_triton_kernels.py (-k expressions; the last one is what the others leave).
_LORA = "lora or segment_table or shrink or test_dispatcher_picks_triton_where_it_runs"
KERNEL_PARTS = {"lora": _LORA, "attention": "attention",
                "ops": f"not ({_LORA} or attention)"}
GRAPH_CASES = {
    **{case: f"{MIXED}[{case}]" for case in ("cpu", "cpu-split", "cpu-down", "cpu-fold", "cpu-sfold")},
    "variants": f"{GRAPHS}::test_steps_replay_the_smallest_group_variant_that_covers_their_adapters[cpu]",
    "single": f"{GRAPHS}::test_single_adapter_steps_expand_beside_the_matmul_and_match_peft[cpu]",
    "qkv-rope": f"{GRAPHS}::test_rope_in_the_qkv_gemm_matches_peft[cpu]",
    "pieces": f"{PIECES}::test_prompt_chunks_beside_decodes_match_peft[cpu]",
    "pieces-preempt": f"{PIECES}::test_preempted_requests_recompute_through_the_pieces[cpu]",
    # The families' kernel options (windows, q/k norms, Gemma's norms and GeLU) in the graphs,
    # and a mixture of experts' grouped GEMMs with its expert LoRA launches.
    **{f"family-{f}": f"{FAMILIES}::test_family_with_the_triton_kernels_matches_peft[{f}]"
       for f in ("gemma3", "qwen3", "phi3", "qwen3_moe")},
    # FP8 o and down in LoRA steps: their K splits summed by the add + norm with the delta.
    **{f"fp8-lora-splits-{q}": f"{FP8_ROWS}::test_lora_steps_hand_fp8_k_splits_to_the_add_norm[{q}]"
       for q in ("fp8", "fp8-w8a8")},
}
KERNELS_TIMEOUT = 450  # a part took 55-95 s
GRAPH_TIMEOUT = 750    # a case took 30-250 s, the child's start included
WARMUP_TIMEOUT = 600   # took 70-120 s a case, two cases


def run_interpreted(*args: str, timeout: float) -> str:
    """A child pytest with Triton's interpreter on; asserts it passed and returns its output."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    report = proc.stdout[-8000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, report
    return proc.stdout


@pytest.mark.timeout(KERNELS_TIMEOUT + 30)
@pytest.mark.parametrize("part", list(KERNEL_PARTS))
def test_triton_kernels_match_reference_in_interpreter(part: str) -> None:
    out = run_interpreted(f"--confcutdir={HERE}", "-k", KERNEL_PARTS[part],
                          str(HERE / "test_triton_kernels.py"), timeout=KERNELS_TIMEOUT)
    assert " passed" in out and "skipped" not in out, out[-8000:]


@pytest.mark.timeout(KERNELS_TIMEOUT + 30)
def test_fused_all_reduce_matches_reference_in_interpreter() -> None:
    out = run_interpreted(f"--confcutdir={HERE}", str(HERE / "test_allreduce_triton.py"), timeout=KERNELS_TIMEOUT)
    assert " passed" in out and "skipped" not in out and "failed" not in out, out[-8000:]


@pytest.mark.timeout(GRAPH_TIMEOUT + 30)
@pytest.mark.parametrize("case", list(GRAPH_CASES))
def test_decode_graph_steps_with_triton_kernels_match_peft_in_interpreter(case: str) -> None:
    out = run_interpreted(GRAPH_CASES[case], timeout=GRAPH_TIMEOUT)
    assert "1 passed" in out, out[-8000:]


@pytest.mark.timeout(WARMUP_TIMEOUT + 30)
def test_after_the_start_up_warm_up_serving_compiles_nothing_new_in_interpreter() -> None:
    """The node's warm-up (runner/warmup.py) launches every kernel variant that a mixed
    workload then launches: on a GPU, nothing compiles under the first requests."""
    out = run_interpreted("-k", "interpreted", "tests/node/test_warmup.py", timeout=WARMUP_TIMEOUT)
    assert "2 passed" in out, out[-8000:]
