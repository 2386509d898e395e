"""Decode steps of one node at several tensor-parallel sizes, side by side in one run.

    python -m bench.tp_bench --shape 8b --tp 1,2 --rows base,c32          # 2 GPUs
    python -m bench.tp_bench --shape 70b --tp 4 --rows base,c32            # 4 GPUs
    python -m bench.tp_bench --device cpu --shape tiny --tp 1,2            # CPU smoke (gloo)
    python -m bench.tp_bench --shape 70b --tp 4 --rows base,c32 --timeline traces   # + rank 0's kernels
    python -m bench.tp_bench --shape 70b --tp 4 --rows c32 --mode default --mode side_expand_segments=0
    python -m bench.tp_bench --shape 8b --tp 1,2 --all-reduce nccl,symm      # NCCL against symmetric memory

Each size (and all-reduce, and mode) builds the node as `inference-node serve
--tensor-parallel-size N` does, in a process of its own (`LLM`: rank 0 there, ranks
1..N-1 spawned; random weights made on the devices, `--load-format dummy`), which sends its
rows back before its node stops: a node whose teardown hangs costs its size a bounded wait,
not the sizes after it) and drives its engine in-process closed loop at a concurrency
equal to the batch, with short prompts and long answers, so almost every step is a full-batch
decode step (a decode graph on every rank). Like `serve`, it takes the tuning table filed for
the GPU and shard shape (--tuning-table auto); --mode builds the node again per set of launch
choices. Columns: the full-batch decode steps' wall time
p50 (one engine call: launch step n+1, wait for step n), tokens/s over those steps, the ratio
to the first size's step of the same row, and the step's floor per GPU (weights, KV and
adapters read at the copy bandwidth measured on that GPU, plus the all-reduces) where
bench.tp_floor is present.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Sequence

from bench.engine_driver import Driver, make_specs, pct, preload_adapters
from bench.grpc_bench import SHAPES, prepare_adapters, prepare_checkpoint


def mode_choices(mode: str) -> dict[str, str]:
    """A --mode's Tuning choices: "default", or NAME=VALUE joined by "/" (inference_node.tuner.profile's
    form; VALUE as `inference-node serve --tune NAME=VALUE` takes it)."""
    if mode == "default":
        return {}
    return dict(item.split("=", 1) for item in mode.split("/"))


CHILD_ROWS = "@rows "
TEARDOWN_WAIT_S = 120.0


def run_child(argv: list[str], what: str, wait_s: float = TEARDOWN_WAIT_S,
              command: Sequence[str] = (sys.executable, "-m", "bench.tp_bench")) -> list[dict]:
    """One size's rows from a process of its own. Its rows arrive before its node stops; a
    teardown that outlasts wait_s is killed with the ranks it spawned."""
    proc = subprocess.Popen([*command, *argv, "--child", what],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    rows: list[dict] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(CHILD_ROWS):
            rows = json.loads(line[len(CHILD_ROWS):])
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # whatever it prints while stopping
            break
        sys.stdout.write(line)
    try:
        proc.wait(wait_s if rows else None)
    except subprocess.TimeoutExpired:
        logging.getLogger(__name__).warning("%s: the node did not stop within %.0fs of its rows: killed",
                                            what, wait_s)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    if not rows:
        raise SystemExit(f"tp_bench: the child for (tp, all-reduce, mode) {what} gave no rows (exit {proc.returncode})")
    return rows


def run_size(args, checkpoint: Path, adapters: Path, tp: int, rows: list[str], mode: str = "default",
             all_reduce: str = "nccl") -> list[dict]:
    import torch

    from inference_node.config import NodeConfig
    from inference_node.llm import LLM
    from kernels.tuning import tuning_from_text

    count = max([int(r[1:]) for r in rows if r.startswith("c")] or [0])
    choices = mode_choices(mode)
    if not args.copy_bandwidth:  # this GPU's own, before the node takes its memory
        from bench.common import copy_bandwidth

        device = torch.device(args.device)
        args.copy_bandwidth = copy_bandwidth(device, (1 << 30) if device.type == "cuda" else (64 << 20))
    config = NodeConfig.of(
        tuning=tuning_from_text(choices), tuning_fixed=frozenset(choices), tuning_table=args.tuning_table,
        all_reduce=all_reduce if tp > 1 else "nccl",
        checkpoint=str(checkpoint), device=args.device, load_format="dummy", adapter_dir=str(adapters),
        max_loras=max(count, 1), max_lora_rank=16, max_cpu_loras=max(count, 1), max_num_seqs=args.batch,
        max_num_batched_tokens=args.max_batched_tokens, max_model_len=args.prompt + args.output + 16,
        num_kv_blocks=args.num_kv_blocks, mixed_graphs="off", warmup="off",
        decode_graphs="auto", tensor_parallel_size=tp)
    llm = LLM(config)
    node, engine = llm.node, llm.engine
    out = []
    try:
        llm.prepare()
        names = [f"r16-{k:03d}" for k in range(count)]
        if names:
            preload_adapters(engine, node.adapters, names)
        vocab = node.model.config.vocab_size if tp == 1 else node.model.full_config.vocab_size
        for row in rows:
            pool = names[:int(row[1:])] if row.startswith("c") else []
            specs = make_specs(args.batch * args.rounds, (args.prompt, args.prompt), (args.output, args.output),
                               vocab, None, args.seed)
            trace = (Path(args.timeline) / f"tp{tp}-{row}-{len(out)}.json") if args.timeline else None
            driver = Driver(engine, node.model.device, args.batch, poisson=False, trace=trace,
                            trace_steps=(100, 100 + TIMELINE_STEPS))
            adapter_of = (lambda s: pool[s.index % len(pool)]) if pool else (lambda s: "")
            driver.run(specs[:args.batch], adapter_of, lambda s: 8)  # warm: this row's graphs and kernels
            _, steps = driver.run(specs, adapter_of)
            full = [s for s in steps if s.batch == args.batch and not s.boundary]
            step = pct([s.seconds for s in full], 50)
            label = "/".join(([] if mode == "default" else [mode]) + ([all_reduce] if all_reduce != "nccl" else []))
            out.append({"tp": tp, "row": f"{row}@{label}" if label else row,
                        "same_choices": row if mode == "default" else f"{row}@{mode}", "batch": args.batch, "steps": len(full),
                        "step_ms": step * 1e3, "forward_ms": pct([s.forward for s in full], 50) * 1e3,
                        "tok_s": args.batch / step if step else float("nan"),
                        "graph_steps": engine.stats.graph_steps})
            floor = floor_ms(args, checkpoint, tp, row)
            out[-1]["floor_ms"] = floor
            print(f"# tp {tp} {row} ({mode}): step p50 {step * 1e3:.3f} ms over {len(full)} full-batch decode "
                  f"steps; floor {'-' if floor is None else format(floor, '.3f')} ms at "
                  f"{args.copy_bandwidth / 1e12:.2f} TB/s", file=sys.stderr, flush=True)
            if trace is not None and trace.exists():
                print_rank0_timeline(f"tp {tp} {row} ({mode})", trace)
        print(CHILD_ROWS + json.dumps(out), flush=True)
    finally:
        try:  # a size's numbers are kept even if its node stops untidily
            llm.close()
        except Exception:
            logging.getLogger(__name__).exception("tp %d: the node did not stop cleanly", tp)
        del llm, node, engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


TIMELINE_STEPS = 20  # decode steps traced per row with --timeline (from the 100th)


def print_rank0_timeline(label: str, trace: Path) -> None:
    """Rank 0's kernels over the traced decode steps, by family (inference_node.tuner.profile's
    timeline): where a tensor-parallel step's time goes beyond its floor. CUPTI records the
    kernels of the replayed graphs; steps that are not full-batch decode add their own."""
    from inference_node.tuner.profile import print_timeline

    events = json.loads(trace.read_text()).get("traceEvents", [])
    kernels = sorted((dict(name=e["name"], start=float(e["ts"]), end=float(e["ts"]) + float(e["dur"]))
                      for e in events if e.get("cat") == "kernel"), key=lambda k: k["start"])
    print_timeline(label, kernels, TIMELINE_STEPS)


def floor_ms(args, checkpoint: Path, tp: int, row: str) -> float | None:
    """The step's floor per GPU (bench.tp_floor), or None where the all-reduce report lacks it."""
    from bench import tp_floor

    try:
        return tp_floor.decode_step_floor_ms(checkpoint, tp=tp, batch=args.batch,
                                             context=args.prompt + args.output // 2,
                                             adapters=int(row[1:]) if row.startswith("c") else 0, rank=16,
                                             copy_bandwidth=args.copy_bandwidth,
                                             allreduce=args.allreduce_json if tp > 1 else None)
    except ValueError as exc:  # e.g. the report lacks this batch's message size: no floor, the reason shown
        print(f"# tp {tp} {row}: no floor ({exc})", file=sys.stderr)
        return None


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--shape", choices=[*SHAPES, "tiny"], default="8b")
    p.add_argument("--tp", default="1,2", help="comma-separated tensor-parallel sizes")
    p.add_argument("--rows", default="base,c32", help="base and/or cN (N distinct rank-16 all-linear adapters)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--output", type=int, default=256)
    p.add_argument("--rounds", type=int, default=2, help="requests = batch x rounds")
    p.add_argument("--max-batched-tokens", type=int, default=2048)
    p.add_argument("--num-kv-blocks", type=int, default=0,
                   help="0: what the batch needs, twice over (each size's node then leaves the GPU to the next)")
    p.add_argument("--copy-bandwidth", type=float, default=0.0,
                   help="device copy bytes/s, read + write counted, for the floors (0: measured on "
                        "each size's GPU by bench.common.copy_bandwidth before its node starts)")
    p.add_argument("--allreduce-json", type=Path, default=None,
                   help="a bench.allreduce_bench --json report of as many GPUs: the floor's collectives")
    p.add_argument("--tokenizer", type=Path, default=None)
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--tuning-table", default="auto",
                   help="as `inference-node serve --tuning-table`: auto (the file filed for this GPU and "
                        "shard shape, if any), off, or a file")
    p.add_argument("--mode", dest="modes", action="append", default=None,
                   help="launch choices other than the defaults, NAME=VALUE joined by / (Tuning fields, "
                        "as inference_node.tuner.profile's --mode); repeat it to build the node once per mode, "
                        "rows labelled ROW@MODE")
    p.add_argument("--all-reduce", default="nccl",
                   help="nccl and/or symm, comma-separated: the node's --all-reduce at TP > 1 (each its own "
                        "node; symm rows labelled ROW@symm)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # TP,ALL_REDUCE,MODE of one child
    p.add_argument("--timeline", type=Path, default=None, metavar="DIR",
                   help=f"trace rank 0's decode steps 100-{100 + TIMELINE_STEPS} of each row into DIR and "
                        "print its kernels by family (CUDA)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    rows = args.rows.split(",")
    sizes = [int(t) for t in args.tp.split(",")]
    args.num_kv_blocks = args.num_kv_blocks or 2 * args.batch * -(-(args.prompt + args.output + 16) // 16)
    with tempfile.TemporaryDirectory(prefix="tp-bench-") as tmp:
        work = args.workdir or Path(tmp)
        checkpoint = prepare_checkpoint(work, None if args.shape == "tiny" else args.shape, args.tokenizer)
        if args.shape == "tiny":
            from bench.common import TINY_LLAMA, copy_tokenizer

            tiny = work / "llama-tiny-dummy"
            tiny.mkdir(parents=True, exist_ok=True)
            copy_tokenizer(checkpoint, tiny)
            (tiny / "config.json").write_text(json.dumps({**TINY_LLAMA, "torch_dtype": "float32"}))
            checkpoint = tiny
        if args.child is not None:  # the adapters are made (once: kept in the workdir) on its GPU
            count = max([int(r[1:]) for r in rows if r.startswith("c")] or [0])
            adapters = prepare_adapters(work, checkpoint, count, args.device == "cuda")
            tp, all_reduce, mode = args.child.split(",", 2)
            return run_size(args, checkpoint, adapters, int(tp), rows, mode, all_reduce)
        results = []
        child_argv = [*(argv if argv is not None else sys.argv[1:]), "--workdir", str(work)]
        for tp in sizes:
            for all_reduce in dict.fromkeys(args.all_reduce.split(",") if tp > 1 else ["nccl"]):
                for mode in args.modes or ["default"]:
                    results += run_child(child_argv, f"{tp},{all_reduce},{mode}")
    first = {}
    for r in results:  # each row's (and mode's) first size, whatever its all-reduce
        first.setdefault(r["same_choices"], r["step_ms"])
    print(f"shape {args.shape}, batch {args.batch}, prompts {args.prompt}, answers {args.output} tokens")
    print("| tp | row | step p50 ms | forward p50 ms | decode tok/s | × tp " + str(sizes[0])
          + " step | floor ms | × floor |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        floor = r["floor_ms"]
        floor_cells = ("| | |" if floor is None else f"| {floor:.3f} | {r['step_ms'] / floor:.2f} |")
        print(f"| {r['tp']} | {r['row']} | {r['step_ms']:.3f} | {r['forward_ms']:.3f} | {r['tok_s']:.0f} | "
              f"{r['step_ms'] / first[r['same_choices']]:.3f} " + floor_cells)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
