"""Families with a q/k/v bias (Qwen2) or a per-head q/k norm (Qwen3; Gemma 3's (1 + w)) through
the node, with q/k/v's decode GEMM doing the bias, the norm, RoPE and the KV-cache write in
one launch (Tuning.qkv_rope, kernels/gemm/rope_epilogue.py) in steps without LoRA on q/k/v,
and the GEMM then the RoPE kernel in steps with it: the same tokens as transformers + PEFT.

Heads of 32 (16 columns of each half a program; a norm's launch holds a whole head). On a CPU
the decode GEMM serves q/k/v only where Triton's interpreter runs (test_triton_interpreter.py
runs this so): there the test makes it serve and the fused launch must run; in plain CPU
runs the references run, as on a CPU node."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from family_checkpoints import family_spec, make_family_adapter, make_tiny_family
from harness import InProcessNode, generate_all, peft_greedy
from inference_node.config import NodeConfig
from test_family_parity import assert_float_tie

# Each family's widths for heads of 32 (4 query heads, 2 KV heads).
WIDTHS = {"qwen2": dict(hidden_size=128), "qwen3": dict(head_dim=32), "gemma3": dict(head_dim=32)}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("family", list(WIDTHS))
def test_fused_qkv_launch_matches_peft(family: str, device: str, tokenizer_dir: Path, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from kernels.gemm import dispatch as gemm_dispatch
    from kernels.gemm.shapes import tiling
    from kernels.host import interpreting

    base = make_tiny_family(family, tmp_path / "model", tokenizer_dir, **WIDTHS[family])
    launches = []
    real = gemm_dispatch.DecodeGemm.qkv_rope

    def spy(self, x, w, rope):
        q = real(self, x, w, rope)
        if q is not None:
            launches.append((rope.bias is not None, rope.qk_norm is not None))
        return q

    monkeypatch.setattr(gemm_dispatch.DecodeGemm, "qkv_rope", spy)
    fuse = device == "cuda" or interpreting()
    if device == "cpu" and fuse:  # the decode GEMM serves q/k/v in the interpreter
        monkeypatch.setattr(gemm_dispatch.DecodeGemm, "serves", lambda self, group: group == "qkv")
        monkeypatch.setattr(gemm_dispatch.DecodeGemm, "applies", lambda self, x, w, group=None: (
            0 < x.shape[0] <= 64 and tiling(w, group, self.tuning.gemm_tilings) is not None))
    root = tmp_path / "adapters"
    attn, mlp = family_spec(family).attention, family_spec(family).mlp
    adapters = {"qv-r4": (4, [attn[0], attn[2]]), "mlp-r8": (8, list(mlp))}
    for seed, (name, (rank, targets)) in enumerate(adapters.items()):
        make_family_adapter(base, root / name, rank, 2.0 * rank, targets, seed=seed, scale=3.0)
    rng = random.Random(5)
    # Phase 1 has no q/k/v adapter: every decode step takes the fused launch. Phase 2 mixes the
    # q/v adapter in: its steps run the GEMM, then the RoPE kernel (the delta before the norm).
    phases = [[(name, [rng.randrange(100, 40000) for _ in range(rng.randrange(3, 20))], rng.randrange(3, 9))
               for name in names] for names in (["", "mlp-r8", ""], ["qv-r4", "", "mlp-r8"])]
    folders = {"": None, **{n: root / n for n in adapters}}
    node = InProcessNode(NodeConfig.of(checkpoint=str(base), device=device, dtype="float32", num_kv_blocks=64,
                                       max_num_seqs=8, max_loras=2, max_lora_rank=16, adapter_dir=str(root),
                                       decode_graphs="on", max_graph_batch=8, debug_checks=True))
    try:
        for phase in phases:
            for (name, prompt, max_new), got in zip(phase, generate_all(node, phase)):
                want = peft_greedy(base, folders[name], [prompt], max_new)[0]
                if got != want:  # the Triton kernels sum in another order than transformers
                    assert_float_tie(base, folders[name], prompt, got)
            if phase is phases[0]:
                assert bool(launches) == fuse
        node.check_idle()
    finally:
        node.stop()
    family_options = {"qwen2": (True, False), "qwen3": (False, True), "gemma3": (False, True)}[family]
    assert all(options == family_options for options in launches)
