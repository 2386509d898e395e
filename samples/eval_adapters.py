"""Measures the sample adapters' trained behaviour on held-out prompts, and the base model's.

    python -m samples.eval_adapters                    # all adapters in samples/adapters/
    python -m samples.eval_adapters --only pirate --show 5
    python -m samples.eval_adapters --json results.json

Greedy decoding, max_new_tokens 40, through the chat template with its default system
prompt, with transformers + PEFT on the shipped (bf16) adapter files. For each adapter the
metric is its checker in samples/behaviours.py (pirate: opens with "Arr" and uses a pirate
word; json-reply: the whole answer is a JSON object with a non-empty "answer"; french-words:
the answer starts with a right French translation), on:
  held-out   prompts never trained: held-out fillers / phrasings of the trained families
  free-form  open questions of no trained family (pirate and json-reply only)
  demo       DEMO_PROMPTS, which tests and the demo client use
and the same prompts through the base model without adapter.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: make `samples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from samples.behaviours import ADAPTER_NAMES, DEMO_PROMPTS, shows_behaviour  # noqa: E402
from samples.sample_data import held_out_prompts  # noqa: E402

ADAPTERS_DIR = Path(__file__).resolve().parent / "adapters"
METRICS = {
    "pirate": "% opening with \"Arr\" + a pirate word",
    "json-reply": "% whole answer is JSON with \"answer\"",
    "french-words": "% right French word first",
}


def generate(model, tokenizer, prompts: list[str], max_new_tokens: int, batch_size: int) -> list[str]:
    """Greedy answers (left-padded batches; special tokens dropped)."""
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    answers = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                               tokenize=False) for p in chunk]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=end,
                                 pad_token_id=end)
        for row in out[:, enc["input_ids"].shape[1]:]:
            answers.append(tokenizer.decode(row, skip_special_tokens=True).strip())
    return answers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--adapters", type=Path, default=ADAPTERS_DIR, help="folder of <name>/ adapters")
    parser.add_argument("--only", action="append", choices=ADAPTER_NAMES)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1 is fastest on a busy 2-core machine)")
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--show", type=int, default=3, help="example answers to print per adapter")
    parser.add_argument("--json", type=Path, help="also write every prompt and answer here")
    parser.add_argument("--no-base", action="store_true", help="skip the base model")
    args = parser.parse_args(argv)

    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from inference_node.model.embedded import default_checkpoint

    torch.set_num_threads(args.threads)
    path = default_checkpoint()
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    base.eval()
    names = args.only or list(ADAPTER_NAMES)
    model = None
    for name in names:
        folder = args.adapters / name
        if model is None:
            model = PeftModel.from_pretrained(base, str(folder), adapter_name=name)
        else:
            model.load_adapter(str(folder), adapter_name=name)
    model.eval()

    base_cache: dict[str, str] = {}
    rows, records = [], []
    for name in names:
        prompts = held_out_prompts(name)
        sets = {"held-out": [p for p, kind in prompts if kind == "templated" and p not in DEMO_PROMPTS[name]],
                "free-form": [p for p, kind in prompts if kind == "free-form"],
                "demo": DEMO_PROMPTS[name]}
        everything = sorted({p for ps in sets.values() for p in ps})
        model.set_adapter(name)
        t0 = time.perf_counter()
        tuned = dict(zip(everything, generate(model, tokenizer, everything, args.max_new_tokens, args.batch_size)))
        seconds = time.perf_counter() - t0
        if not args.no_base:
            todo = [p for p in everything if p not in base_cache]
            with model.disable_adapter():
                base_cache.update(zip(todo, generate(model, tokenizer, todo, args.max_new_tokens, args.batch_size)))
        row = {"adapter": name, "metric": METRICS[name], "seconds": round(seconds, 1)}
        for set_name, ps in sets.items():
            if not ps:
                continue
            ok = [shows_behaviour(name, p, tuned[p]) for p in ps]
            row[set_name] = (sum(ok), len(ps))
            if not args.no_base:
                row["base " + set_name] = (sum(shows_behaviour(name, p, base_cache[p]) for p in ps), len(ps))
        rows.append(row)
        for p in everything:
            records.append({"adapter": name, "prompt": p, "answer": tuned[p], "ok": shows_behaviour(name, p, tuned[p]),
                            "base_answer": base_cache.get(p),
                            "base_ok": shows_behaviour(name, p, base_cache[p]) if p in base_cache else None,
                            "set": [s for s, ps in sets.items() if p in ps]})
        print(f"\n== {name}: {len(everything)} prompts in {seconds:.0f}s", flush=True)
        shown = sets["demo"] + [p for p in everything if p not in sets["demo"]][:max(0, args.show - len(sets["demo"]))]
        for p in shown[:max(args.show, len(sets["demo"]))]:
            print(f"  {p!r}\n    adapter: {tuned[p]!r}")
            if p in base_cache:
                print(f"    base:    {base_cache[p]!r}")
        failures = [p for p in everything if not shows_behaviour(name, p, tuned[p])]
        for p in failures[:5]:
            print(f"  FAIL {p!r} -> {tuned[p]!r}")

    print("\n" + table(rows, with_base=not args.no_base))
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "answers": records}, indent=1, ensure_ascii=False))
    return 0


def _pct(cell) -> str:
    if not cell:
        return "-"
    ok, n = cell
    return f"{100 * ok / n:.0f}% ({ok}/{n})"


def table(rows: list[dict], with_base: bool = True) -> str:
    head = ["adapter", "metric", "held-out", "free-form", "demo"]
    if with_base:
        head += ["base: held-out", "base: free-form", "base: demo"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["adapter"], r["metric"], _pct(r.get("held-out")), _pct(r.get("free-form")), _pct(r.get("demo"))]
        if with_base:
            cells += [_pct(r.get("base held-out")), _pct(r.get("base free-form")), _pct(r.get("base demo"))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
