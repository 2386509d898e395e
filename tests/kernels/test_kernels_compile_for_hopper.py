"""The Triton kernels' family options compile for a Hopper GPU (sm_90: Triton's frontend, its
passes, ptxas and a cubin), without one: Triton's interpreter runs the kernels as Python and
so accepts what the compiler refuses (a global read inside a jit function, a type a branch
changes). One variant per option, beside the options off (the slow tier, make test-kernels: a
minute with a cold Triton cache)."""
from __future__ import annotations

import importlib.util
import os

import pytest

pytestmark = [pytest.mark.interpreter,
              pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton not installed")]


def compile_for_hopper(fn, types: dict[str, str], constexprs: dict[str, object]) -> None:
    """Compiles the jit function with these argument types (others i32) and constexprs."""
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    # constexprs left out take their defaults (a kernel's options added later, off)
    constexprs = {p.name: p.default for p in fn.params if p.is_constexpr and p.has_default} | constexprs
    signature = {p.name: "constexpr" if p.name in constexprs else types.get(p.name, "i32") for p in fn.params}
    compiled = triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32))
    assert "cubin" in compiled.asm


@pytest.mark.parametrize("window, softcap, split, head_dim", [
    (False, False, False, 128), (True, False, False, 128), (False, True, True, 128), (True, True, True, 256),
])
def test_attention_with_window_and_softcap(window: bool, softcap: bool, split: bool, head_dim: int) -> None:
    from kernels.attention.triton_kernel import _paged_attention_kernel

    types = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")}
    types |= {"bt_ptr": "*i32", "qsl_ptr": "*i32", "seq_lens_ptr": "*i32", "part_acc_ptr": "*fp32",
              "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "qk_scale": "fp32", "softcap": "fp32"}
    compile_for_hopper(_paged_attention_kernel, types, dict(
        PAGE=16, GROUP=2, GROUP_PAD=2, BLOCK_Q=8, BLOCK_M=16, BLOCK_N=32, BLOCK_D=head_dim, SPLIT=split,
        DOT_F32=False, PDL=False, EARLY_KV=False, HAS_WINDOW=window, HAS_SOFTCAP=softcap))


@pytest.mark.parametrize("lora, unit_offset, out_norm", [(False, True, True), (True, True, True), (True, False, False)])
def test_add_rms_norm_with_gemmas_norms(lora: bool, unit_offset: bool, out_norm: bool) -> None:
    from kernels.norm.triton_kernel import _add_rms_norm_kernel

    types = {n: "*bf16" for n in ("hidden_ptr", "out_ptr", "weight_ptr", "new_hidden_ptr", "x_ptr", "b_ptr",
                                  "out_norm_ptr")}
    types |= {"part_ptr": "*fp32", "rows_ptr": "*i32", "dense_ptr": "*fp32", "eps": "fp32"}
    compile_for_hopper(_add_rms_norm_kernel, types, dict(
        H=3584, SPLITS=2, HAS_LORA=lora, DENSE=False, BLOCK_H=2048, BLOCK_R=16, PDL=False,
        UNIT_OFFSET=unit_offset, OUT_NORM=out_norm))


@pytest.mark.parametrize("lora", [False, True])
def test_gelu_tanh_gating(lora: bool) -> None:
    from kernels.activation.triton_kernel import _silu_mul_kernel

    types = {n: "*bf16" for n in ("gu_ptr", "act_ptr", "bg_ptr", "bu_ptr")}
    types |= {"part_ptr": "*fp32", "rows_ptr": "*i32", "dense_ptr": "*fp32"}
    compile_for_hopper(_silu_mul_kernel, types, dict(
        SPLITS=2, HAS_LORA=lora, DENSE=False, BLOCK_I=1024, BLOCK_R=16, PDL=False, EARLY_B=False, GELU_TANH=True))


@pytest.mark.parametrize("lora", [False, True])
def test_norm_writing_its_rows_in_e4m3(lora: bool) -> None:
    """QUANT (W8A8's operand written by the kernel that makes the rows): the add + norm, one
    program a row and split over columns."""
    from kernels.norm.triton_kernel import _add_rms_norm_kernel, _add_rms_norm_split_kernel

    quant = {"q_ptr": "*fp8e4nv", "qs_ptr": "*fp32", "arrivals_ptr": "*i32"}
    types = {n: "*bf16" for n in ("hidden_ptr", "out_ptr", "weight_ptr", "new_hidden_ptr", "x_ptr", "b_ptr",
                                  "out_norm_ptr")}
    types |= {"part_ptr": "*fp32", "rows_ptr": "*i32", "dense_ptr": "*fp32", "eps": "fp32", "sums_ptr": "*fp32"}
    compile_for_hopper(_add_rms_norm_kernel, types | quant, dict(
        H=4096, SPLITS=2, HAS_LORA=lora, DENSE=False, BLOCK_H=2048, BLOCK_R=16, PDL=False, QUANT=True))
    compile_for_hopper(_add_rms_norm_split_kernel, types | quant, dict(
        H=4096, SPLITS=2, HAS_LORA=True, DENSE=not lora, CHUNKS=8, BLOCK_H=512, BLOCK_R=16, BLOCK_CHUNKS=8,
        NORM_BLOCK=2048, EARLY_SUMS=True, PDL=False, QUANT=True))


@pytest.mark.parametrize("lora, unit_offset", [(False, False), (True, True)])
def test_rope_with_qk_norm(lora: bool, unit_offset: bool) -> None:
    from kernels.rope.triton_kernel import _rope_cache_kernel

    types = {n: "*bf16" for n in ("qkv_ptr", "q_out_ptr", "k_cache_ptr", "v_cache_ptr", "bq_ptr", "bk_ptr",
                                  "bv_ptr", "qn_ptr", "kn_ptr")}
    types |= {"cos_ptr": "*fp32", "sin_ptr": "*fp32", "pos_ptr": "*i64", "slot_ptr": "*i64", "part_ptr": "*fp32",
              "lrows_ptr": "*i32", "dense_ptr": "*fp32", "norm_eps": "fp32"}
    compile_for_hopper(_rope_cache_kernel, types, dict(
        SPLITS=2, HAS_LORA=lora, DENSE=False, BLOCK_HG=8, BLOCK_HALF=64, BLOCK_R=16, PDL=False, EARLY_B=False,
        QK_NORM=True, UNIT_OFFSET=unit_offset))


@pytest.mark.parametrize("dtype, world, hidden, gemma", [("bf16", 2, 4096, False), ("bf16", 4, 5376, True),
                                                         ("fp32", 8, 4096, False)])
def test_fused_all_reduce_flags_and_peer_loads(dtype: str, world: int, hidden: int, gemma: bool) -> None:
    """The fused all-reduce (kernels/allreduce) compiles with its flags as system-scope release
    exchanges into each peer's buffer and acquire loads of its own (no multimem instruction:
    NVLink multicast stays off), and its peer rows read 16 bytes at a time, around L1."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels.allreduce.triton_kernel import _all_reduce_add_rms_norm_kernel as fn
    from kernels.allreduce.triton_kernel import num_warps

    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    pointers = {n: f"*{dtype}" for n in ("x_ptr", "residual_ptr", "weight_ptr", "bias_ptr", "out_norm_ptr",
                                         "new_residual_ptr", "normed_ptr", "rows_ptr")}
    pointers |= {"flags_ptr": "*i32", "offsets_ptr": "*i64", "epochs_ptr": "*i32"}
    constexprs = dict(RANK=1, WORLD=world, H=hidden, BLOCK_H=1 << (hidden - 1).bit_length(), HAS_BIAS=not gemma,
                      UNIT_OFFSET=gemma, OUT_NORM=gemma, SYNC=True)
    types = pointers | {"eps": "fp32"}
    # constexprs left out take their defaults (a kernel's options added later, off)
    constexprs = {p.name: p.default for p in fn.params if p.is_constexpr and p.has_default} | constexprs
    signature = {p.name: "constexpr" if p.name in constexprs else types.get(p.name, "i32") for p in fn.params}
    # What the launch's specialisation gives: pointers and the slot size divisible by 16.
    aligned = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(fn.params)
               if p.name in pointers or p.name == "slot_numel"}
    compiled = triton.compile(ASTSource(fn, signature, constexprs, aligned), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=num_warps(constexprs["BLOCK_H"])))
    ptx = compiled.asm["ptx"]
    assert ptx.count("atom.global.sys.release.exch.b32") == world - 1
    assert "multimem" not in ptx
    acquires = [line for line in ptx.splitlines() if ".global.sys.acquire" in line]
    assert len(acquires) >= world - 1
    assert ptx.count("ld.global.cg.v4.b32") >= world - 1 and "ld.global.cg.b16" not in ptx


@pytest.mark.parametrize("kernel, scale", [("_pair_lora_shrink_kernel", False), ("_pair_lora_expand_kernel", True),
                                           ("_pair_lora_fused_kernel", False), ("_pair_lora_fused_kernel", True)])
def test_expert_pair_lora_kernels(kernel: str, scale: bool) -> None:
    """Each (token, pick) pair's expert LoRA: the shrink and expand launches, and both in one
    (Tuning.moe_lora_launches), with and without down's routing weight."""
    from kernels.moe import triton_kernel

    fn = getattr(triton_kernel, kernel)
    types = {n: "*bf16" for n in ("x_ptr", "a_ptr", "b_ptr", "y_ptr")}
    types |= {"picks_ptr": "*i64", "token_slots_ptr": "*i32", "first_ptr": "*i32", "rank_ptr": "*i32",
              "scaling_ptr": "*fp32", "weight_ptr": "*fp32", "s_ptr": "*fp32"}
    constexprs = {"TOP_K": 8, "BLOCK_R": 32, "BLOCK_K": 256, "BLOCK_N": 256, "X_PER_PAIR": scale, "SCALE": scale}
    names = {p.name for p in fn.params}
    compile_for_hopper(fn, types, {k: v for k, v in constexprs.items() if k in names})


@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointers"])
@pytest.mark.parametrize("split_k", [1, 4])
def test_decode_gemm_k_splits(tma: bool, split_k: int) -> None:
    """The decode GEMM's K-split launch (Tuning.gemm_split_k), which only the GPU tier runs
    through TMA: its tile and K range from the program id, the partials' store."""
    from kernels.gemm.triton_kernel import _decode_gemm_kernel, _decode_gemm_tma_kernel

    pointers = {"w_ptr": "*bf16", "y_ptr": "*bf16", "part_ptr": "*fp32", "k_ptr": "*bf16", "v_ptr": "*bf16",
                "cos_ptr": "*fp32", "sin_ptr": "*fp32", "pos_ptr": "*i32", "slot_ptr": "*i64"}
    if tma:
        fn, types = _decode_gemm_tma_kernel, {"x_desc": "tensordesc<bf16[64, 128]>",
                                              "w_desc": "tensordesc<bf16[64, 128]>", **pointers}
    else:
        fn, types = _decode_gemm_kernel, {"x_ptr": "*bf16", **pointers}
    compile_for_hopper(fn, types, dict(K=8192, BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, PDL=True, PREFETCH_K=512,
                                       LINE=64, DOT_F32=False, EARLY_TRIGGER=True, SPLIT_K=split_k))
