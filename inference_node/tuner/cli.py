"""`inference-node tune`: the node's first-start tuning, ahead of time and for the batches and
adapter counts asked for. The table goes where the node looks for it (its cache directory)
unless --out says where (kernels/configs/ for a seed); a table already there for the same key
keeps the buckets this run does not measure, and its node-wide choices."""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

from kernels.gemm.shapes import MAX_ROWS
from kernels.tuning import DEFAULT_TUNING, EXPERT_GROUPS, GROUPS, fp8_tilings_field
from kernels.tuning_table import CONFIG_DIR, ModelShape, TuningTable

from .store import exclusive, usable
from .sweep import print_results
from .attention_trials import GROUP as ATTENTION, AttentionMeasured, print_attention
from .trial import copy_bandwidth
from .tune import base_field, default_cache, key_for, tune_table, why_not

log = logging.getLogger(__name__)


def integers(text: str, what: str, least: int) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < least:
        raise SystemExit(f"inference-node tune: {what} {text!r}: expected integers of at least {least}, "
                         f"comma-separated")
    return values


def model_shape(model: str | None, tp: int) -> ModelShape:
    """The shapes one rank's decode GEMMs run at for the checkpoint `model` (only its
    config.json is read) split over `tp` ranks: the node's shard (parallel/shard.py), which is
    also its table's key."""
    from inference_node.model.config import ModelConfig
    from inference_node.model.embedded import default_checkpoint
    from inference_node.parallel.shard import Shard, ShardingError

    try:
        config = ModelConfig.from_checkpoint(Path(model) if model else default_checkpoint())
        return ModelShape.of(Shard(0, tp).local_config(config))
    except ShardingError as exc:
        raise SystemExit(f"inference-node tune: --tensor-parallel-size {tp}: {exc}") from None
    except (OSError, ValueError, KeyError) as exc:  # no such folder, a bad config.json
        raise SystemExit(f"inference-node tune: --model {model}: {exc}") from None


def weights_kind(model: str | None, quantization: str) -> str:
    """The projections' weights the node serving `model` with `--quantization` multiplies
    (node.fp8_kind): an FP8 checkpoint's are FP8 without the flag."""
    from inference_node.model.config import ModelConfig
    from inference_node.model.embedded import default_checkpoint

    if quantization != "none":
        return quantization
    config = ModelConfig.from_checkpoint(Path(model) if model else default_checkpoint())
    return "fp8" if config.weight_quant is not None else "none"


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    smoke = device.type == "cpu"
    if device.type == "cuda":
        reason = why_not(device) if torch.cuda.is_available() else "no CUDA device is available"
        if reason is not None:
            print(f"inference-node tune: {reason} (--device cpu runs a smoke whose numbers mean nothing)",
                  file=sys.stderr)
            return 1
    else:
        torch.set_num_threads(1)  # steadier wall times on a shared CPU
    dtype = {"auto": torch.float32 if smoke else torch.bfloat16, "bfloat16": torch.bfloat16,
             "float16": torch.float16, "float32": torch.float32}[args.dtype]
    shape = model_shape(args.model, args.tensor_parallel_size)
    batches = integers(args.batches, "--batches", 1)
    quantization = weights_kind(args.model, args.quantization)
    too_large = [b for b in batches if b > MAX_ROWS]
    if too_large:
        runs = "cuBLAS runs them" if quantization == "none" else "the FP8 GEMM's prefill tiling runs them"
        print(f"batches {too_large}: above the decode GEMM's {MAX_ROWS} rows ({runs}): not swept")
        batches = [b for b in batches if b <= MAX_ROWS]
    adapters = integers(args.adapters, "--adapters", 0)
    groups = [g for g in args.groups.split(",") if g]
    known = GROUPS + EXPERT_GROUPS + (ATTENTION,)
    if not groups or set(groups) - set(known):
        raise SystemExit(f"inference-node tune: --groups {args.groups!r}: expected some of {', '.join(known)}")
    groups = [g for g in groups if g in shape.gemms() or (shape.experts and g in EXPERT_GROUPS) or g == ATTENTION]

    if quantization != "none":  # FP8 matmuls never fold LoRA: their base launches alone
        adapters = [a for a in adapters if a == 0] or [0]
    key = key_for(device, shape, dtype, quantization)
    out = Path(args.out) if args.out else default_cache()
    path = out if out.suffix == ".json" else out / key.name
    seed = path.parent.resolve() == CONFIG_DIR.resolve()
    print(("CPU SMOKE (numbers meaningless: checks the sweep and the table's writing and reading)\n" if smoke else "")
          + f"tuning kernels for {key} (torch {key.torch}, triton {key.triton}; tensor parallel "
          f"{args.tensor_parallel_size}): batches {batches}, adapters {adapters}, groups {groups}, "
          f"budget {args.budget_s:g} s, into {path}", flush=True)
    # Held while tuning: a node starting meanwhile waits for this table rather than tune beside it.
    with exclusive(path.parent / f"{path.name}.lock", wait_s=0) as held:
        if not held:
            print(f"inference-node tune: another process is tuning into {path} (lock {path}.lock)", file=sys.stderr)
            return 1
        # A seed's buckets are version-free: kept whatever torch and Triton measured them.
        existing = usable(path, key, check_versions=not seed)
        command = "inference-node tune " + " ".join(args.argv)
        table, results = tune_table(shape, device, dtype, budget_s=args.budget_s, batches=batches,
                                    adapters=adapters, groups=groups, tp=args.tensor_parallel_size,
                                    existing=existing, min_gain=args.min_gain,
                                    max_candidates=3 if smoke else None, produced_by=command.strip(),
                                    quantization=quantization)
        bandwidth = None if smoke else copy_bandwidth(device)
        if bandwidth:
            print(f"\ncopy bandwidth {bandwidth / 1e12:.2f} TB/s (a 1 GiB device copy, read and write counted)")
        print_results([r for r in results if not isinstance(r, AttentionMeasured)], smoke, bandwidth)
        print_attention(results, bandwidth)
        table.write(path)
    again = usable(path, key, check_versions=not seed)
    if again is None:
        raise SystemExit(f"inference-node tune: {path}: the table just written does not read back")
    print(f"\nwrote {path}: {len(again.buckets)} bucket(s), tuned in {again.tuning_s:.0f} s"
          + (f"; {len(again.unmeasured)} case(s) left unmeasured by the budget" if again.unmeasured else ""))
    summarize(again, base_field(device) if quantization == "none" else fp8_tilings_field(quantization == "fp8-w8a8"),
              batches, adapters, groups)
    return 0


def summarize(table: TuningTable, field: str, batches: list[int], adapters: list[int],
              groups: list[str]) -> None:
    """The tilings a step of each batch (and adapter count) runs, read back as the node reads them."""
    steps = table.tunings(DEFAULT_TUNING)
    print("a step of each batch and adapter count runs (base GEMM; with adapters, the fold's):")
    for batch in sorted(batches):
        for count in sorted(a for a in adapters if a <= batch):
            tuning = steps.for_step(batch, count)
            chosen = {**(tuning.fold_tilings if count else getattr(tuning, field)),
                      **{f"experts.{g}": t for g, t in tuning.moe_tilings.items()}}
            print(f"  batch {batch:3d}, {count:3d} adapters: "
                  + ", ".join(f"{g}={'.'.join(map(str, chosen[g]))}" for g in groups if g in chosen))
