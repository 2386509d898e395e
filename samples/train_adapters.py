"""Trains the sample LoRA adapters of the embedded SmolLM2-135M-Instruct on CPU.

    python -m samples.train_adapters                 # all three, into samples/adapters/<name>/
    python -m samples.train_adapters --only pirate   # one
    python -m samples.train_adapters --out /tmp/x    # somewhere else

Data comes from samples/sample_data.py (templated, generated here, no downloads). Each
example is the chat template with its default system prompt, the user prompt and the
assistant answer; the loss is on the answer and its closing <|im_end|> only.

All examples share one prefix (system prompt + "<|im_start|>user\\n", 23 tokens): it is
run once per step at batch 1 and its keys/values repeated over the batch, gradients
flowing through both. That halves the work of a step and gives the same loss as running
every example whole (checked by --check-prefix).

Saved: adapter_config.json + adapter_model.safetensors (LoRA weights cast to bfloat16),
nothing else. Fixed seeds; on one CPU thread each adapter takes 2 to 5 minutes (samples/README.md).
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: make `samples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from samples.behaviours import BASE_MODEL, DEMO_PROMPTS  # noqa: E402
from samples.sample_data import held_out_prompts, training_pairs  # noqa: E402

ADAPTERS_DIR = Path(__file__).resolve().parent / "adapters"
ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class Recipe:
    name: str
    r: int
    lora_alpha: int
    target_modules: list[str]
    use_rslora: bool = False
    lr: float = 1e-3
    steps: int = 60
    batch_size: int = 8
    warmup: int = 5
    seed: int = 0
    notes: str = field(default="", compare=False)


# Ranks, modules, alpha and rsLoRA differ on purpose: a server must batch them together.
RECIPES: dict[str, Recipe] = {
    "pirate": Recipe("pirate", r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                     lr=2e-3, steps=60, batch_size=8),
    "json-reply": Recipe("json-reply", r=16, lora_alpha=16, target_modules=ALL_MODULES,
                         lr=1e-3, steps=60, batch_size=8),
    "french-words": Recipe("french-words", r=4, lora_alpha=8, use_rslora=True,
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                           lr=2e-3, steps=120, batch_size=16),
}


def load_base(threads: int):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from inference_node.model.embedded import default_checkpoint

    torch.set_num_threads(threads)
    path = default_checkpoint()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model, tokenizer


@dataclass
class Example:
    ids: list[int]     # the whole conversation, up to and including the answer's <|im_end|>
    answer_start: int  # index of the answer's first token


def encode(tokenizer, pairs: list[tuple[str, str]]) -> list[Example]:
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    out = []
    for prompt, answer in pairs:
        head = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                             add_generation_prompt=True, tokenize=False)
        full = tokenizer.apply_chat_template([{"role": "user", "content": prompt},
                                              {"role": "assistant", "content": answer}], tokenize=False)
        assert full.startswith(head), (head, full)
        head_ids = tokenizer(head, add_special_tokens=False)["input_ids"]
        answer_ids = tokenizer(full[len(head):], add_special_tokens=False)["input_ids"]
        cut = answer_ids.index(end) + 1  # keep <|im_end|>, drop the newline after it
        out.append(Example(head_ids + answer_ids[:cut], len(head_ids)))
    return out


def shared_prefix_length(examples: list[Example]) -> int:
    first = examples[0].ids
    n = min(e.answer_start for e in examples)
    for e in examples:
        while n and e.ids[:n] != first[:n]:
            n -= 1
    return n - 1  # keep at least one prompt token outside the prefix


def batch_loss(model, examples: list[Example], prefix: int) -> tuple[torch.Tensor, int]:
    """Mean cross-entropy over the answers' tokens, with the shared prefix run once."""
    llama = model.get_base_model()  # LlamaForCausalLM, LoRA layers injected
    body = llama.model
    prefix_ids = torch.tensor([examples[0].ids[:prefix]])
    cache = body(input_ids=prefix_ids, use_cache=True).past_key_values
    cache.batch_repeat_interleave(len(examples))
    length = max(len(e.ids) for e in examples) - prefix
    ids = torch.zeros(len(examples), length, dtype=torch.long)
    mask = torch.zeros(len(examples), prefix + length, dtype=torch.long)
    mask[:, :prefix] = 1
    rows, cols, targets = [], [], []
    for i, e in enumerate(examples):
        rest = e.ids[prefix:]
        ids[i, :len(rest)] = torch.tensor(rest)
        mask[i, prefix:prefix + len(rest)] = 1
        for j in range(e.answer_start, len(e.ids)):  # hidden state j-1 predicts token j
            rows.append(i)
            cols.append(j - 1 - prefix)
            targets.append(e.ids[j])
    positions = torch.arange(prefix, prefix + length).unsqueeze(0).expand(len(examples), -1)
    hidden = body(input_ids=ids, attention_mask=mask, position_ids=positions,
                  past_key_values=cache, use_cache=True).last_hidden_state
    logits = llama.lm_head(hidden[torch.tensor(rows), torch.tensor(cols)])
    return torch.nn.functional.cross_entropy(logits.float(), torch.tensor(targets)), len(targets)


def full_loss(model, examples: list[Example]) -> torch.Tensor:
    """The same loss without prefix sharing (for --check-prefix)."""
    total, count = 0.0, 0
    for e in examples:
        logits = model(input_ids=torch.tensor([e.ids])).logits[0]
        target = torch.tensor(e.ids[e.answer_start:])
        total = total + torch.nn.functional.cross_entropy(logits[e.answer_start - 1:-1], target,
                                                          reduction="sum")
        count += len(target)
    return total / count


def make_peft(model, recipe: Recipe):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(recipe.seed)
    config = LoraConfig(r=recipe.r, lora_alpha=recipe.lora_alpha, target_modules=recipe.target_modules,
                        use_rslora=recipe.use_rslora, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def train(recipe: Recipe, out_dir: Path, threads: int, check_prefix: bool = False) -> dict:
    model, tokenizer = load_base(threads)
    pairs = training_pairs(recipe.name, recipe.seed)
    held = {p for p, _ in held_out_prompts(recipe.name, recipe.seed)}
    trained = {p for p, _ in pairs}
    assert not trained & held, f"held-out prompts in the training data: {sorted(trained & held)[:5]}"
    assert not trained & set(DEMO_PROMPTS[recipe.name]), "a demo prompt is in the training data"
    examples = encode(tokenizer, pairs)
    prefix = shared_prefix_length(examples)
    model = make_peft(model, recipe)
    model.train()
    if check_prefix:
        with torch.no_grad():
            sample = examples[:4]
            a, _ = batch_loss(model, sample, prefix)
            b = full_loss(model, sample)
        print(f"prefix-shared loss {a.item():.6f} vs whole-sequence loss {b.item():.6f}")
        assert abs(a.item() - b.item()) < 1e-3 * max(1.0, abs(b.item()))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=recipe.lr, weight_decay=0.0)

    def lr_at(step: int) -> float:  # linear warm-up, then cosine down to 10%
        if step < recipe.warmup:
            return recipe.lr * (step + 1) / recipe.warmup
        t = (step - recipe.warmup) / max(1, recipe.steps - recipe.warmup)
        return recipe.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    rng = random.Random(recipe.seed)
    order: list[int] = []
    n_params = sum(p.numel() for p in params)
    print(f"[{recipe.name}] {len(examples)} examples, prefix {prefix} tokens, r={recipe.r} "
          f"alpha={recipe.lora_alpha} rslora={recipe.use_rslora} modules={','.join(recipe.target_modules)} "
          f"({n_params / 1e6:.2f}M trainable), {recipe.steps} steps x {recipe.batch_size}, lr {recipe.lr}",
          flush=True)
    start, cpu_start = time.perf_counter(), time.process_time()
    losses = []
    for step in range(recipe.steps):
        if len(order) < recipe.batch_size:
            fresh = list(range(len(examples)))
            rng.shuffle(fresh)
            order += fresh
        batch = [examples[i] for i in order[:recipe.batch_size]]
        del order[:recipe.batch_size]
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        loss, _ = batch_loss(model, batch, prefix)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % 10 == 0 or step == recipe.steps - 1:
            print(f"  step {step:4d}  loss {loss.item():.4f}  lr {lr_at(step):.2e}  "
                  f"{time.perf_counter() - start:6.1f}s", flush=True)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    save(model, out_dir / recipe.name)
    summary = {"adapter": recipe.name, "train_seconds": round(seconds, 1), "cpu_seconds": round(cpu_seconds, 1),
               "steps": recipe.steps,
               "batch_size": recipe.batch_size, "examples": len(examples),
               "first_loss": round(losses[0], 4), "final_loss": round(sum(losses[-5:]) / len(losses[-5:]), 4),
               "trainable_params": n_params, "threads": threads}
    print(json.dumps(summary), flush=True)
    return summary


def save(model, folder: Path) -> None:
    """adapter_config.json + adapter_model.safetensors (bf16), nothing else."""
    folder.mkdir(parents=True, exist_ok=True)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.to(torch.bfloat16)
    model.save_pretrained(str(folder), safe_serialization=True)
    config_path = folder / "adapter_config.json"
    config = json.loads(config_path.read_text())
    # The checkpoint was converted from the embedded GGUF; name the model it stands for.
    config["base_model_name_or_path"] = BASE_MODEL
    config["target_modules"] = sorted(config["target_modules"], key=ALL_MODULES.index)  # PEFT saves a set
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for extra in folder.iterdir():
        if extra.name not in ("adapter_config.json", "adapter_model.safetensors"):
            extra.unlink()
    try:  # the serving side's own checks, when the repository's packages are importable
        from lora_common.validation import validate_adapter
    except ImportError:
        return
    spec = validate_adapter((folder / "adapter_config.json").read_bytes(),
                            (folder / "adapter_model.safetensors").read_bytes())
    print(f"  saved {folder.name}: {len(spec.modules)} LoRA pairs, {spec.dtypes}, "
          f"{(folder / 'adapter_model.safetensors').stat().st_size / 1e6:.2f} MB", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", action="append", choices=sorted(RECIPES), help="train only these")
    parser.add_argument("--out", type=Path, default=ADAPTERS_DIR, help="folder of <name>/ adapters")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1 is fastest on a busy 2-core machine)")
    parser.add_argument("--steps", type=int, help="override the recipe's steps (for quick trials)")
    parser.add_argument("--check-prefix", action="store_true",
                        help="first check that the prefix-shared loss equals the whole-sequence loss")
    args = parser.parse_args(argv)
    summaries = []
    for name in args.only or list(RECIPES):
        recipe = RECIPES[name]
        if args.steps:
            recipe = Recipe(**{**recipe.__dict__, "steps": args.steps})
        summaries.append(train(recipe, args.out, args.threads, args.check_prefix))
    for s in summaries:
        print(f"{s['adapter']:14s} {s['train_seconds']:7.1f}s wall {s['cpu_seconds']:7.1f}s CPU  loss {s['first_loss']:.3f} -> {s['final_loss']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
