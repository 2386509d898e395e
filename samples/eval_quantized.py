"""What `--quantization fp8` costs in answers: the embedded model and the sample adapters served
by the node twice, its projections in 16 bits and in FP8 (one scale per output channel), on the
same prompts, greedy.

    python -m samples.eval_quantized                    # bfloat16 against FP8, on the CPU
    python -m samples.eval_quantized --per-adapter 8 --show 2
    python -m samples.eval_quantized --quantization fp8-w8a8   # activations in e4m3 too

For the base model and each sample adapter: how many answers are the same token for token,
how far into an answer the two agree on average, and (adapters) the share of answers that
show the trained behaviour (samples/behaviours.py) under each. Prompts: DEMO_PROMPTS and the
first --per-adapter held-out prompts of each adapter (samples/sample_data.py), through the
chat template; 40 new tokens.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `samples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from samples.behaviours import ADAPTER_NAMES, DEMO_PROMPTS, shows_behaviour  # noqa: E402
from samples.sample_data import held_out_prompts  # noqa: E402

ADAPTERS_DIR = Path(__file__).resolve().parent / "adapters"


def agreed_prefix(a: list[int], b: list[int]) -> float:
    """The share of the longer answer's tokens before the two first differ."""
    same = 0
    for x, y in zip(a, b):
        if x != y:
            break
        same += 1
    return same / max(len(a), len(b), 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                        help="the unquantized node's (and the activations') type")
    parser.add_argument("--per-adapter", type=int, default=6, help="held-out prompts per adapter")
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--show", type=int, default=0, help="answer pairs to print per adapter")
    parser.add_argument("--quantization", default="fp8", choices=("fp8", "fp8-w8a8"),
                        help="the FP8 node's (fp8-w8a8: its activations rounded to e4m3 per token too)")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from inference_node.config import NodeConfig
    from inference_node.llm import LLM
    from inference_node.model.embedded import default_checkpoint

    checkpoint = default_checkpoint()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    prompts = {"": sorted({p for ps in DEMO_PROMPTS.values() for p in ps})}
    for name in ADAPTER_NAMES:
        prompts[name] = list(DEMO_PROMPTS[name]) + [p for p, _ in held_out_prompts(name)[:args.per_adapter]]

    def encode(text: str) -> list[int]:
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False)

    def answers(quantization: str) -> dict[str, list[list[int]]]:
        config = NodeConfig.of(device="cpu", dtype=args.dtype, quantization=quantization, checkpoint=str(checkpoint),
                               adapter_dir=str(ADAPTERS_DIR), max_loras=len(ADAPTER_NAMES), max_lora_rank=64,
                               log_level="WARNING")
        with LLM(config) as llm:
            out = {}
            for name, texts in prompts.items():
                done = llm.generate([encode(t) for t in texts], args.max_tokens, adapter=name)
                out[name] = [[t for t in c.token_ids if t != end] for c in done]
            return out

    plain, fp8 = answers("none"), answers(args.quantization)
    print(f"\nembedded SmolLM2-135M, {args.dtype} against FP8 projections ({args.quantization}), greedy, "
          f"{args.max_tokens} new tokens")
    print(f"{'adapter':13} {'prompts':>7} {'same answer':>11} {'agreed prefix':>13} "
          f"{'behaviour ' + args.dtype:>18} {'behaviour fp8':>13}")
    for name, texts in prompts.items():
        a, b = plain[name], fp8[name]
        same = sum(x == y for x, y in zip(a, b))
        prefix = sum(agreed_prefix(x, y) for x, y in zip(a, b)) / len(texts)
        row = f"{name or 'base':13} {len(texts):7d} {same:7d}/{len(texts):<3d} {prefix:13.0%}"
        if name:
            shown = [sum(shows_behaviour(name, t, tokenizer.decode(ans, skip_special_tokens=True).strip())
                         for t, ans in zip(texts, side)) for side in (a, b)]
            row += f" {shown[0]:14d}/{len(texts):<3d} {shown[1]:9d}/{len(texts):<3d}"
        print(row)
        for t, x, y in list(zip(texts, a, b))[:args.show]:
            print(f"    {t!r}\n      {args.dtype}: {tokenizer.decode(x, skip_special_tokens=True).strip()!r}"
                  f"\n      fp8: {tokenizer.decode(y, skip_special_tokens=True).strip()!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
