"""Each served family on the GPU in bfloat16 (the Triton kernels with the families' options,
the decode and piecewise graphs, the loader at real widths): a checkpoint of the family's real
widths (bench.shapes FAMILY_SHAPES) in 2 layers, its window shortened so the prompts cross it,
PEFT adapters on the family's module names (one on the layers only, one with the embedding and
the LM head), all with the base model in one mixed batch through gRPC.

The oracle is transformers + PEFT in bfloat16 on the same GPU, teacher-forced over the node's
answer: each token the node chose must be transformers' greedy choice, or a near-tie with it
within bfloat16's rounding (two implementations of bfloat16 arithmetic round differently, and
random weights make near-ties common); most must be its exact choice. A wrong window, a
missing soft-cap or norm, or a LoRA on the wrong rows moves logits far past that.

One module, parametrized by family, run on one H200: `pytest -m gpu tests/families/test_family_gpu.py`.
"""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from bench.shapes import FAMILY_SHAPES, MOE_SHAPES
from family_checkpoints import family_spec, make_family_adapter, make_family_widths
from harness import InProcessNode, generate_all
from inference_node.model.config import ModelConfig
from inference_node.config import NodeConfig
from inference_node.runner.piecewise_graphs import EXPERTS as PIECES_EXPERTS

pytestmark = pytest.mark.gpu

WINDOW = 48           # every windowed layer's, so the prompts below cross it
PROMPT_LENGTHS = (12, 70, 121)
MAX_NEW = 16
# A token the node chose is a near-tie with transformers' choice when its logit is within this
# share of the largest logit's magnitude (at least 1) below it: a few bfloat16 steps.
NEAR_TIE = 0.03
EXACT_SHARE = 0.75    # the share of tokens that must be transformers' exact choice
# A mixture of experts' routing is discrete: where a position's k-th and (k+1)-th router
# logits are this close in some layer, the two implementations' roundings may pick different
# experts there, and that token's logits then differ by more than NEAR_TIE. Such a token is
# excused, reported, and counted as not exact (EXACT_SHARE bounds them). The bound is bf16's
# noise on a router margin: Mixtral at these widths, transformers alone in bfloat16 against
# float32 (3 prompts of 106 tokens, the adapter on or off), moved layer 0's margins by a
# standard deviation of 0.013-0.017 (at most 0.056) and flipped picks at margins up to 0.026;
# two bf16 implementations differ by about 1.4x that, so 0.06 is some 3 of their deviations.
ROUTER_TIE = 0.06
# Past the first routed layer a pick can flip with no near-tie at the token itself: attention
# carries an earlier position's flipped pick into its input. Transformers alone, as above,
# flipped a pick at 16-19 of 318 positions, 13 of them in layer 1 alone, at margins up to 0.26.
# So this share of a mixture of experts' tokens may be far from transformers' choice with no
# near-tie (each reported); a wrong expert, weight or adapter puts most tokens there.
ROUTING_CASCADE_SHARE = 0.1


SHAPES = {**FAMILY_SHAPES, **MOE_SHAPES}


def family_of(shape_name: str) -> str:
    return ModelConfig.from_dict(SHAPES[shape_name]).family


def teacher_forced_logits(model, prompt: list[int], answer: list[int], device: str,
                          top_k: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[len(answer), vocab] float32: the model's logits at each position that predicts a token
    of the answer, given the prompt and the answer's tokens before it; with top_k (a mixture
    of experts), also [len(answer)]: each such position's smallest margin over the layers
    between its k-th and (k+1)-th router logits."""
    ids = torch.tensor([prompt + answer], device=device)
    at = slice(len(prompt) - 1, len(prompt) - 1 + len(answer))
    with torch.no_grad():
        out = model(ids, attention_mask=torch.ones_like(ids), **({"output_router_logits": True} if top_k else {}))
    margins = None
    if top_k and out.router_logits is not None:
        ranked = [layer.float().reshape(-1, layer.shape[-1]).sort(dim=-1, descending=True).values
                  for layer in out.router_logits]
        margins = torch.stack([r[:, top_k - 1] - r[:, top_k] for r in ranked]).min(dim=0).values[at]
    return out.logits[0][at].float(), margins


def check_answers(base: Path, adapter_root: Path, jobs, answers, device: str, dtype: torch.dtype,
                  top_k: int = 0) -> None:
    """Each answer against transformers + PEFT (its adapter alone) teacher-forced over it;
    top_k: a mixture of experts' picks per token (ROUTER_TIE, ROUTING_CASCADE_SHARE)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    exact = total = 0
    cascaded: list[str] = []
    for name in dict.fromkeys(job[0] for job in jobs):
        model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype).to(device).eval()
        if name:
            model = PeftModel.from_pretrained(model, adapter_root / name).to(device).eval()
        for (adapter, prompt, max_new), answer in zip(jobs, answers):
            if adapter != name:
                continue
            assert len(answer) == max_new
            logits, margins = teacher_forced_logits(model, list(prompt), answer, device, top_k)
            best = logits.max(dim=-1)
            chosen = logits.gather(1, torch.tensor(answer, device=device)[:, None])[:, 0]
            gap = best.values - chosen
            allowed = NEAR_TIE * best.values.abs().clamp(min=1.0)
            far = (gap > allowed).nonzero().flatten().tolist()
            if margins is not None:  # a mixture of experts: near-ties excused, the others counted
                for i in far:
                    line = (f"adapter {name or 'base'}, prompt of {len(prompt)}, token {i}: gap {gap[i]:.3f}, "
                            f"allowed {allowed[i]:.3f}, router margin {margins[i]:.4f}")
                    if margins[i] < ROUTER_TIE:
                        print(f"{line}: excused, a routing near-tie")
                    else:
                        cascaded.append(line)
                        print(f"{line}: not transformers' choice, no routing near-tie at the token")
                far = []
            assert not far, (f"adapter {name or 'base'}, prompt of {len(prompt)}: tokens {far} are not "
                             f"transformers' choice (gaps {gap[far].tolist()}, allowed {allowed[far].tolist()})")
            exact += int((best.indices == torch.tensor(answer, device=device)).sum())
            total += len(answer)
        del model
        torch.cuda.empty_cache() if device == "cuda" else None
    assert exact >= EXACT_SHARE * total, f"{exact} of {total} tokens are transformers' exact choice"
    assert len(cascaded) <= ROUTING_CASCADE_SHARE * total, (
        f"{len(cascaded)} of {total} tokens are far from transformers' choice with no routing near-tie: {cascaded}")


def run_family(base: Path, family: str, root: Path, device: str, dtype_name: str) -> None:
    spec = family_spec(family)
    adapters = {
        "r16-layers": (16, 32.0, [*spec.attention, *spec.mlp]),
        "r8-edges": (8, 16.0, [*spec.attention, "embed_tokens", "lm_head"]),
    }
    for seed, (name, (rank, alpha, targets)) in enumerate(adapters.items(), start=1):
        make_family_adapter(base, root / name, rank, alpha, targets, seed=seed)
    rng = random.Random(7)
    prompts = [tuple(rng.randrange(100, 40000) for _ in range(n)) for n in PROMPT_LENGTHS]
    # The embedding's and LM head's LoRA runs in eager steps: its answers end first, so the
    # others' last steps replay the decode graphs (every job is admitted at once for that:
    # max_num_seqs holds them all, or the last such job would start late and run to the end).
    # Expert LoRA (a mixture of experts' "r16-layers") replays the graphs' experts variant.
    moe = ModelConfig.from_checkpoint(base).num_experts > 0
    eager = {"r8-edges"}
    jobs = [(name, list(p), MAX_NEW // 2 if name in eager else MAX_NEW)
            for name in ("", *adapters) for p in prompts]
    node = InProcessNode(NodeConfig.of(checkpoint=str(base), device=device, dtype=dtype_name, num_kv_blocks=256,
                                      block_size=16, max_model_len=512, max_num_seqs=16, max_graph_batch=16,
                                      max_num_batched_tokens=256, warmup="off", max_loras=2, max_lora_rank=16,
                                      adapter_dir=str(root), debug_checks=True))
    try:
        answers = generate_all(node, jobs)
        stats = node.check_idle()
        assert stats["graph_steps"] > 0 or device != "cuda", stats  # the decode graphs ran
        if moe:
            decode = node.engine.runner.decode_graphs
            experts = len(decode.group_variants) - 1
            assert any(variant == experts for (_, _, variant) in decode.replays), decode.replays
            # The mixed batch's prompt steps hold the edges' adapter and run eagerly: a prompt
            # of the expert adapter's alone replays the piecewise graphs' experts variant.
            fresh = [(name, [rng.randrange(100, 40000) for _ in range(90)], MAX_NEW) for name in ("r16-layers",)]
            answers += generate_all(node, fresh)
            jobs += fresh
            node.check_idle()
            pieces = node.engine.runner.piecewise_graphs
            assert any(variant == PIECES_EXPERTS for (_, variant, _) in pieces.replays), pieces.replays
    finally:
        node.stop()
    by_job = {(name, tuple(p)): a for (name, p, _), a in zip(jobs, answers)}
    for name in adapters:  # each adapter changes the answers: the test would be weak otherwise
        assert any(by_job[(name, p)] != by_job[("", p)] for p in prompts), name
    check_answers(base, root, jobs, answers, device, torch.bfloat16 if dtype_name == "bfloat16" else torch.float32,
                  ModelConfig.from_checkpoint(base).num_experts_per_tok if moe else 0)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_family_at_real_widths_matches_peft_in_bfloat16(shape: str, tmp_path: Path, tokenizer_dir: Path) -> None:
    """Mixture-of-experts shapes too: their "r16-layers" adapter's MLP LoRA is on every expert
    (PEFT's target_parameters), run by the node's expert path beside the grouped GEMMs."""
    family = family_of(shape)
    overrides = {"num_hidden_layers": 2}
    if SHAPES[shape].get("sliding_window") and family != "qwen2":
        overrides["sliding_window"] = WINDOW
    if family.startswith("gemma"):
        # Random weights with Gemma's embedding tied to the LM head and scaled by sqrt(hidden):
        # the last token's own logit (~25 against ~5) wins every step, so every answer, the
        # adapters' and transformers' too, repeats the prompt's last token. An untied head (the
        # node serves both) keeps answers that an adapter can change.
        overrides["tie_word_embeddings"] = False
    base = make_family_widths(family, SHAPES[shape], tmp_path / "model", tokenizer_dir, **overrides)
    config = ModelConfig.from_checkpoint(base)
    assert config.family == family and config.num_layers == 2
    run_family(base, family, tmp_path / "adapters", "cuda", "bfloat16")
