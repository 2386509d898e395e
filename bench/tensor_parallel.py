"""Tensor parallelism, two subcommands (`python -m bench.tensor_parallel NAME --help`):

    python -m bench.tensor_parallel allreduce --nproc 2 --json ar2.json     # NCCL vs symm and fused
    python -m bench.tensor_parallel steps --model llama-8b-random --tp 1,2 --allreduce-json ar2.json
    python -m bench.tensor_parallel steps --model llama-70b-random --tp 4 --rows base,c32
    python -m bench.tensor_parallel steps --device cpu --model tiny --tp 1,2     # CPU smoke (gloo)

`steps`: each size (and all-reduce, and --mode) builds the node as `serve --tensor-parallel-size
N` does, in a process of its own (a teardown that hangs costs a bounded wait), and drives it
closed loop at a concurrency equal to the batch: the p50 of its full-batch decode steps beside
each rank's floor (docs/PERFORMANCE.md; the collectives at an `allreduce --json` report's times).

`allreduce`: one process per GPU sums bf16 [rows, hidden] by NCCL (gloo on CPU), by the node's
symmetric-memory all-reduce (`--all-reduce symm`) and by its all-reduce + add + norm kernel
(`--all-reduce fused`, the sum read back as the new residual of a zero one), eager and from a CUDA graph, every sum
checked exactly on every rank before and after timing. NVLink multicast stays off: its variables
are set before any CUDA call (other values refused), and no multimem operation is called.
"""
from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import MutableMapping, Sequence

import torch
import torch.distributed as dist

from bench.driver import Driver
from bench.harness import (ALL_MODULES, Col, StepBytes, Table, adapter_bytes_per_rank, add_common_args, assign_adapters,
                           bench_model, build_llm, copy_bandwidth, make_specs, model_config, node_config, pct,
                           release_memory, runtime, timed_runs, write_adapters, write_json)

log = logging.getLogger("bench.tensor_parallel")


# -- the floor of a rank's decode step ------------------------------------------------------------------
@dataclass(frozen=True)
class Collectives:
    all_reduces: int   # each of [rows, hidden]
    all_gathers: int   # each of [rows, ceil(vocab / TP)] per rank: the logits
    broadcasts: int    # each of [rows] int64 from rank 0: the token ids


def collectives_per_step(cfg, tp: int) -> Collectives:
    """The embedding's all-reduce, two per layer (after o and down), the logits' all-gather and
    (a decode graph's step) the broadcast of rank 0's token ids; none on one device."""
    return Collectives(2 * cfg.num_layers + 1, 1, 1) if tp > 1 else Collectives(0, 0, 0)


def bus_bandwidth(nbytes: int, ranks: int, seconds: float) -> float:
    """NCCL's bus bandwidth of an all-reduce of `nbytes` per rank: 2 (n-1)/n bytes / time."""
    return 2 * (ranks - 1) / ranks * nbytes / seconds


def collective_times(report: dict, method: str, cfg, tp: int, rows: int,
                     itemsize: int = 2) -> tuple[float, float, float]:
    """(all-reduce, all-gather, broadcast) seconds of a decode step of `rows` from an allreduce
    report of `tp` processes: the all-reduce measured at [rows, hidden]; the logits' all-gather
    at its bus bandwidth ((n-1)/n of the gathered bytes cross the bus); the broadcast (latency
    alone) as the smallest all-reduce of that hidden size."""
    if report["world_size"] != tp:
        raise ValueError(f"the all-reduce report is of {report['world_size']} processes, not {tp}")
    times = {r["rows"]: r["seconds"] for r in report["results"]
             if r["method"] == method and r["hidden"] == cfg.hidden_size and r.get("seconds") is not None}
    if rows not in times:
        raise ValueError(f"the report has no {method!r} all-reduce of [{rows}, {cfg.hidden_size}] (it has rows "
                         f"{sorted(times)}): run `allreduce --rows {rows}`")
    busbw = bus_bandwidth(rows * cfg.hidden_size * itemsize, tp, times[rows])
    gathered = rows * tp * -(-cfg.vocab_size // tp) * itemsize
    return times[rows], (tp - 1) / tp * gathered / busbw, times[min(times)]


def decode_floor_s(cfg, itemsize: int, tp: int, rows: int, context: int, read_bandwidth: float, adapters: int = 0,
                   rank: int = 16, comm: tuple[float, float, float] = (0.0, 0.0, 0.0)) -> tuple[float, float]:
    """(memory seconds, collective seconds) of a full-batch decode step on one rank: `rows`
    sequences attending over `context` tokens each, `adapters` distinct rank-`rank` adapters on
    all seven projections; comm: collective_times' (all-reduce, all-gather, broadcast)."""
    names = {f"a{k}": adapter_bytes_per_rank(cfg, rank, ALL_MODULES, itemsize, tp) for k in range(adapters)}
    nbytes = StepBytes.of(cfg, itemsize, names, tp).step(rows, frozenset(names), rows * context)
    n = collectives_per_step(cfg, tp)
    return nbytes / read_bandwidth, n.all_reduces * comm[0] + n.all_gathers * comm[1] + n.broadcasts * comm[2]


# -- steps at each size ---------------------------------------------------------------------------------
CHILD_ROWS = "@rows "


def run_child(argv: list[str], what: str, wait_s: float = 120.0,
              command: Sequence[str] = (sys.executable, "-m", "bench.tensor_parallel", "steps")) -> list[dict]:
    """One size's rows from a process of its own. They arrive before its node stops; a teardown
    that outlasts wait_s is killed with the ranks it spawned."""
    proc = subprocess.Popen([*command, *argv, "--child", what], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    rows: list[dict] = []
    for line in proc.stdout:
        if line.startswith(CHILD_ROWS):
            rows = json.loads(line[len(CHILD_ROWS):])
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # what it prints while stopping
            break
        sys.stdout.write(line)
    try:
        proc.wait(wait_s if rows else None)
    except subprocess.TimeoutExpired:
        log.warning("%s: the node did not stop within %.0fs of its rows: killed", what, wait_s)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    if not rows:
        raise SystemExit(f"the child for (tp, all-reduce, mode) {what} gave no rows (exit {proc.returncode})")
    return rows


def run_size(args, device: torch.device, dtype: torch.dtype, tp: int, rows: list[str], mode: str,
             all_reduce: str) -> list[dict]:
    from kernels.tuning import tuning_from_text

    model = bench_model(args.model, args.work, dtype, device, args.seed)
    count = max([int(r[1:]) for r in rows if r.startswith("c")] or [0])
    names = [f"r16-{k:03d}" for k in range(count)]
    cfg = model_config(args.model)
    adapters = args.work / f"adapters-h{cfg.hidden_size}-l{cfg.num_layers}"
    write_adapters(adapters, cfg, names, [16], ALL_MODULES, device, dtype)  # once: kept in the workdir
    bandwidth = args.copy_bandwidth or copy_bandwidth(device)  # this GPU's own, before the node takes its memory
    choices = {} if mode == "default" else dict(item.split("=", 1) for item in mode.split("/"))
    llm = build_llm(node_config(
        model, device, dtype, tuning=tuning_from_text(choices), tuning_fixed=frozenset(choices),
        tuning_table=args.tuning_table, all_reduce=all_reduce if tp > 1 else "nccl", adapter_dir=str(adapters),
        max_loras=max(count, 1), max_lora_rank=16, max_cpu_loras=max(count, 1), max_num_seqs=args.batch,
        max_num_batched_tokens=args.max_batched_tokens, max_model_len=args.prompt + args.output + 16,
        num_kv_blocks=args.num_kv_blocks, mixed_graphs="off", warmup="off", tensor_parallel_size=tp,
        cpu_threads=args.threads), names)
    report = json.loads(args.allreduce_json.read_text()) if args.allreduce_json and tp > 1 else None
    out = []
    try:
        engine = llm.engine
        for row in rows:
            pool = names[:int(row[1:])] if row.startswith("c") else []
            specs = assign_adapters(make_specs(args.batch * args.rounds, (args.prompt,) * 2, (args.output,) * 2,
                                               cfg.vocab_size, None, args.seed), pool)
            driver = Driver(engine, llm.node.model.device, args.batch, poisson=False)
            driver.run(specs[:args.batch], lambda s: 8)  # warm: this row's graphs and kernels
            _, steps = driver.run(specs)
            full = [s for s in steps if s.batch == args.batch and not s.boundary]
            step = pct([s.seconds for s in full], 50)
            comm, note = (0.0, 0.0, 0.0), "" if tp == 1 else "no all-reduce report: bytes alone"
            if report is not None:
                try:
                    comm, note = collective_times(report, "nccl graph", cfg, tp, args.batch), ""
                except ValueError as exc:
                    note = str(exc)
            memory, comm_s = decode_floor_s(cfg, dtype.itemsize, tp, args.batch, args.prompt + args.output // 2,
                                            bandwidth, len(pool), 16, comm)
            label = "/".join(([] if mode == "default" else [mode]) + ([all_reduce] if all_reduce != "nccl" else []))
            out.append({"tp": tp, "row": f"{row}@{label}" if label else row, "same_choices": f"{row}@{mode}",
                        "batch": args.batch, "steps": len(full), "step_ms": step * 1e3,
                        "forward_ms": pct([s.forward for s in full], 50) * 1e3, "tok_s": args.batch / step,
                        "floor_ms": (memory + comm_s) * 1e3, "comm_ms": comm_s * 1e3, "floor_note": note,
                        "copy_bandwidth": bandwidth})
            print(f"# tp {tp} {out[-1]['row']}: step p50 {step * 1e3:.3f} ms over {len(full)} full-batch decode steps; "
                  f"floor {out[-1]['floor_ms']:.3f} ms {note}", file=sys.stderr, flush=True)
        print(CHILD_ROWS + json.dumps(out), flush=True)
    finally:
        try:  # a size's numbers are kept even if its node stops untidily
            llm.close()
        except Exception:
            log.exception("tp %d: the node did not stop cleanly", tp)
        del llm
        release_memory()
    return out


def steps(args) -> list[dict]:
    device, dtype = runtime(args)
    rows, sizes = args.rows.split(","), [int(t) for t in args.tp.split(",")]
    args.num_kv_blocks = args.num_kv_blocks or 2 * args.batch * -(-(args.prompt + args.output + 16) // 16)
    with tempfile.TemporaryDirectory(prefix="bench-tp-") as tmp:
        args.work = args.workdir or Path(tmp)
        if args.child is not None:
            tp, all_reduce, mode = args.child.split(",", 2)
            return run_size(args, device, dtype, int(tp), rows, mode, all_reduce)
        results = []
        child_argv = [*(args.argv if args.argv is not None else sys.argv[2:]), "--workdir", str(args.work)]
        for tp in sizes:
            for all_reduce in dict.fromkeys(args.all_reduce.split(",") if tp > 1 else ["nccl"]):
                for mode in args.modes or ["default"]:
                    results += run_child(child_argv, f"{tp},{all_reduce},{mode}")
    first: dict[str, float] = {}
    for r in results:  # each row's (and mode's) first size, whatever its all-reduce
        first.setdefault(r["same_choices"], r["step_ms"])
    print(f"model {args.model}, batch {args.batch}, prompts {args.prompt}, answers {args.output} tokens; floor: "
          f"bytes at the copy bandwidth of each size's GPU + collectives (NCCL graph times of --allreduce-json)")
    table = Table(Col("tp", 3, "d"), Col("row", 24), Col("step p50", 9, ".3f", "ms"), Col("fwd p50", 9, ".3f", "ms"),
                  Col("tok/s", 8, ".0f"), Col(f"x tp{sizes[0]}", 7, ".3f"), Col("floor", 8, ".3f", "ms"),
                  Col("comm", 7, ".3f", "ms"), Col("x floor", 7, ".2f"))
    table.print([(r["tp"], r["row"], r["step_ms"], r["forward_ms"], r["tok_s"], r["step_ms"] / first[r["same_choices"]],
                  r["floor_ms"], r["comm_ms"], r["step_ms"] / r["floor_ms"]) for r in results])
    for note in dict.fromkeys(f"tp {r['tp']}: {r['floor_note']}" for r in results if r["floor_note"]):
        print(f"floor without collectives, {note}")
    write_json(args.json, results)
    return results


# -- all-reduce ----------------------------------------------------------------------------------------------
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
SIZES = {"decode": ((1, 8, 32, 64, 128, 256), (4096, 8192)), "small": ((1, 8), (256,))}
METHODS, MODES, MAX_RANKS, DTYPE = ("nccl", "symm", "fused"), ("eager", "graph"), 8, torch.bfloat16


def keep_multicast_off(env: MutableMapping[str, str] = os.environ) -> None:
    """NVLink multicast can take a shared host's GPUs out of service: the variables that keep it
    off are set where missing, other values refused."""
    for name, value in MULTICAST_OFF.items():
        if env.setdefault(name, value) != value:
            raise SystemExit(f"{name}={env[name]}: this benchmark runs only with NVLink multicast off "
                             f"({name}={value}); unset it or set it to {value}")


@dataclass(frozen=True)
class Settings:
    device: str
    nproc: int
    rows: tuple[int, ...]
    hidden: tuple[int, ...]
    ops: int = 20                  # all-reduces per timed run (and per graph)
    repeats: int = 30
    warmup: int = 5


def pattern(numel: int, op: int, rank: int, device) -> torch.Tensor:
    """Rank `rank`'s input to all-reduce `op`: (1..8, shifted by op) x (rank + 1), so a rank that
    reads a peer's previous or next message, or one buffer twice, gets a wrong sum. Up to 8
    ranks every partial sum is an integer bf16 holds exactly, in any order of addition."""
    return ((((torch.arange(numel, device=device) + op) % 8) + 1) * (rank + 1)).to(DTYPE)


def expected_sum(numel: int, op: int, ranks: int, device) -> torch.Tensor:
    return ((((torch.arange(numel, device=device) + op) % 8) + 1) * (ranks * (ranks + 1) // 2)).to(DTYPE)


def check_sums(outputs: Sequence[torch.Tensor], ranks: int, what: str) -> int:
    """Raises naming the first wrong element unless outputs[k] is the sum of op k's inputs;
    returns how many outputs were checked."""
    for k, out in enumerate(outputs):
        got, want = out.reshape(-1), expected_sum(out.numel(), k, ranks, out.device)
        if not torch.equal(got, want):
            bad = int((got != want).nonzero()[0])
            raise AssertionError(f"{what}: all-reduce {k} of {len(outputs)} gave {got[bad].item()} at element {bad}, "
                                 f"expected {want[bad].item()} (the sum over {ranks} ranks)")
    return len(outputs)


def agree(reason: str | None) -> str | None:
    """Every rank's failure gathered: the first (None if all worked), the same on every rank,
    so all of them skip or run the next collective together."""
    reasons: list = [None] * dist.get_world_size()
    dist.all_gather_object(reasons, reason)
    return next((r for r in reasons if r is not None), None)


def fused_sum(fused, residual: torch.Tensor, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """--all-reduce fused's new residual stream of a zero one (the sum), its norm computed beside."""
    if not fused.fits(x):
        raise RuntimeError(f"over the fused kernel's {fused.max_rows} rows or {fused.max_bytes >> 10} KB (NCCL's)")
    return fused(x, residual, weight, 1e-5)[0]


def run_case(method: str, mode: str, x: torch.Tensor, impl, s: Settings,
             rank: int) -> tuple[float | None, str | None, int]:
    """(seconds per all-reduce on this rank, why not, outputs verified) of --ops all-reduces of
    x [ops, rows, hidden]: NCCL in place, the others (impl: a callable, or why there is none) into new tensors."""
    cuda = s.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def fill() -> None:
        for k in range(x.shape[0]):
            x[k].copy_(pattern(x[k].numel(), k, rank, x.device).view_as(x[k]))

    def step() -> list[torch.Tensor]:
        if method == "nccl":
            for k in range(x.shape[0]):
                dist.all_reduce(x[k])
            return list(x)
        return [impl(x[k]) for k in range(x.shape[0])]

    run, reason = step, None
    try:
        if isinstance(impl, str):
            raise RuntimeError(impl)
        if mode == "graph" and not cuda:
            raise RuntimeError("CUDA graphs need CUDA")
        fill()
        step()  # the first launch: host-side refusals (and NCCL's setup) before any graph
        sync()
        if mode == "graph":
            graph = torch.cuda.CUDAGraph()
            # thread_local: NCCL's and c10d's own threads may touch CUDA while this one captures.
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                outputs = step()
            sync()
            run = lambda: (graph.replay(), outputs)[1]  # noqa: E731
    except Exception as exc:  # noqa: BLE001 - reported in the table as n/a (reason)
        reason = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"[:160]
    reason = agree(reason)
    if reason is not None:
        return None, reason, 0

    def verify() -> int:
        fill()
        outputs = run()
        sync()
        try:
            what = f"{method} {mode}, {x.shape[1]} x {x.shape[2]}, rank {rank}"
            checked, failure = check_sums(outputs, s.nproc, what), None
        except AssertionError as exc:
            checked, failure = 0, str(exc)
        if (failure := agree(failure)) is not None:
            raise AssertionError(failure)
        return checked

    checked = verify()
    for _ in range(s.warmup):
        run()
    if cuda:
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(s.repeats)]
        for start, end in events:  # back to back: the ranks stay in step through the collectives
            start.record()
            run()
            end.record()
        sync()
        times = [start.elapsed_time(end) * 1e-3 for start, end in events]
    else:
        times = timed_runs(run, s.repeats)
    seconds = statistics.median(times) / x.shape[0]
    return seconds, None, checked + verify()


def worker(rank: int, s: Settings, rendezvous: str, result_path: str) -> None:
    from inference_node.parallel.group import init_tensor_parallel
    from inference_node.parallel.shard import Shard

    keep_multicast_off()  # inherited from the parent; checked again before CUDA starts here
    cuda = s.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    init_tensor_parallel(Shard(rank, s.nproc), device, rendezvous, timeout_s=300)
    impls: dict = {m: "symmetric memory needs CUDA" for m in METHODS[1:]}
    if cuda:  # the node's own (--all-reduce symm, fused), beside NCCL
        from inference_node.parallel.fused import FusedAllReduce
        from inference_node.parallel.symmetric import SymmetricAllReduce

        for method, make in (("symm", SymmetricAllReduce), ("fused", FusedAllReduce)):
            impl, reason = None, None
            try:
                impl = make(dist.group.WORLD.group_name, DTYPE, device)
            except Exception as exc:  # noqa: BLE001 - reported as n/a (reason)
                reason = f"{type(exc).__name__}: {str(exc)[:120]}"
            if impl is not None and getattr(impl.handle, "multicast_ptr", 0):
                raise SystemExit("the symmetric buffer has an NVLink multicast address although "
                                 "TORCH_SYMM_MEM_DISABLE_MULTICAST=1: stopping (multicast must stay off)")
            impls[method] = agree(reason) or impl
    try:
        cells = []
        for hidden in s.hidden:
            for rows in s.rows:
                x = torch.empty(s.ops, rows, hidden, dtype=DTYPE, device=device)
                cases = dict(impls)
                if not isinstance(impls["fused"], str):
                    cases["fused"] = functools.partial(fused_sum, impls["fused"], torch.zeros_like(x[0]),
                                                       torch.ones(hidden, dtype=DTYPE, device=device))
                for method in METHODS:
                    for mode in MODES:
                        seconds, why, verified = run_case(method, mode, x, cases.get(method), s, rank)
                        name = f"{dist.get_backend() if method == 'nccl' else method} {mode}"
                        cells.append({"method": name, "rows": rows, "hidden": hidden, "seconds": seconds,
                                      "reason": why, "verified": verified})
        everyone: list = [None] * s.nproc
        dist.all_gather_object(everyone, cells)
        if rank == 0:
            merged = []
            for per_rank in zip(*everyone):  # the slowest rank's time, the least verified
                cell, times = dict(per_rank[0]), [c["seconds"] for c in per_rank]
                cell["seconds"] = max(times) if None not in times else None
                cell["verified"] = min(c["verified"] for c in per_rank)
                cell["bytes"] = cell["rows"] * cell["hidden"] * DTYPE.itemsize
                cell["bus_bandwidth"] = (bus_bandwidth(cell["bytes"], s.nproc, cell["seconds"])
                                         if cell["seconds"] else None)
                merged.append(cell)
            versions = f"torch {torch.__version__}" + (f", NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}"
                                                       if cuda else "")
            Path(result_path).write_text(json.dumps({
                "world_size": s.nproc, "device": torch.cuda.get_device_name() if cuda else "CPU",
                "backend": dist.get_backend(), "versions": versions,
                "env": {k: os.environ.get(k) for k in MULTICAST_OFF}, "results": merged}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def format_report(report: dict, s: Settings) -> list[str]:
    """One line per size, the methods side by side, then symm's and fused's times over NCCL's per mode."""
    base = report["backend"]
    names = [f"{m} {mode}" for m in (base, *METHODS[1:]) for mode in MODES]
    reasons: dict[str, list[str]] = {}
    table = Table(Col("rows", 5, "d"), Col("hidden", 6, "d"), Col("KB", 7, ".1f", scale=1 / 1024),
                  *(Col(n, 19) for n in names),
                  *(c for m in METHODS[1:] for c in (Col(f"{m}/{base} eager", 19, ".2f"), Col("graph", 6, ".2f"))))
    cells = {(r["method"], r["rows"], r["hidden"]): r for r in report["results"]}
    lines = []
    for rows, hidden in dict.fromkeys((r["rows"], r["hidden"]) for r in report["results"]):
        row = [cells[(n, rows, hidden)] for n in names]
        for r in row:
            if r["seconds"] is None:
                reasons.setdefault(r["reason"], []).append(r["method"])
        shown = [f"{r['seconds'] * 1e6:9.1f} ({r['bus_bandwidth'] / 1e9:6.1f})" if r["seconds"] else
                 f"n/a [{list(reasons).index(r['reason']) + 1}]" for r in row]
        ratio = [row[2 * j + i]["seconds"] / row[i]["seconds"] if row[2 * j + i]["seconds"] and row[i]["seconds"]
                 else None for j in range(1, len(METHODS)) for i in range(2)]
        lines.append(table.row(rows, hidden, rows * hidden * DTYPE.itemsize, *shown, *ratio))
    head = [f"all-reduce (sum) of bf16 [rows, hidden] over {report['world_size']} processes, {base}, "
            f"{report['device']}, {report['versions']}",
            "env: " + " ".join(f"{k}={v}" for k, v in report["env"].items()),
            f"cells: us per all-reduce, median of {s.repeats} runs of {s.ops} (slowest rank), (bus bandwidth GB/s); "
            f"graph: one CUDA graph of {s.ops} all-reduces replayed; symm, fused: the node's --all-reduce symm, fused "
            "(fused: with the residual add and norm, its new residual checked)"]
    notes = [f"[{i}] n/a ({reason}): {', '.join(sorted(set(where)))}"
             for i, (reason, where) in enumerate(reasons.items(), 1)]
    return head + table.head() + lines + notes + [
        f"symm/{base}, fused/{base}: their time / {base}'s in the same mode (< 1: faster); every result checked "
        "against the exact sum before and after timing"]


def allreduce(args) -> dict:
    keep_multicast_off()  # before anything can start CUDA, here or in the processes spawned
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    nproc = args.nproc or (torch.cuda.device_count() if device == "cuda" else 2)
    if device == "cuda" and nproc > torch.cuda.device_count():
        raise SystemExit(f"--nproc {nproc}: only {torch.cuda.device_count()} GPU(s) visible")
    if not 2 <= nproc <= MAX_RANKS:
        raise SystemExit(f"--nproc {nproc}: 2 to {MAX_RANKS} processes (the exact-sum check holds up to {MAX_RANKS})")
    rows, hidden = SIZES[args.sizes]
    s = Settings(device, nproc, args.rows or rows, args.hidden or hidden, args.ops, args.repeats, args.warmup)
    with tempfile.TemporaryDirectory(prefix="bench-allreduce-") as work:
        result = os.path.join(work, "result.json")
        torch.multiprocessing.spawn(worker, args=(s, os.path.join(work, "rendezvous"), result), nprocs=nproc, join=True)
        report = json.loads(Path(result).read_text())
    for line in format_report(report, s):
        print(line)
    write_json(args.json, report)
    return report


# -- main -------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("steps", help="decode steps at several tensor-parallel sizes, beside their floors")
    t.set_defaults(run=steps)
    add_common_args(t, ("llama-8b-random", "tiny"))
    t.add_argument("--tp", default="1,2", help="comma-separated tensor-parallel sizes")
    t.add_argument("--rows", default="base,c32", help="base and/or cN (N distinct rank-16 all-linear adapters)")
    t.add_argument("--batch", type=int, default=64)
    t.add_argument("--prompt", type=int, default=32)
    t.add_argument("--output", type=int, default=256)
    t.add_argument("--rounds", type=int, default=2, help="requests = batch x rounds")
    t.add_argument("--max-batched-tokens", type=int, default=2048)
    t.add_argument("--num-kv-blocks", type=int, default=0, help="0: what the batch needs, twice over")
    t.add_argument("--copy-bandwidth", type=float, default=0.0,
                   help="bytes/s, read + write counted, for the floors (0: measured on each size's GPU)")
    t.add_argument("--allreduce-json", type=Path, default=None, help="an `allreduce --json` report: the collectives")
    t.add_argument("--tuning-table", default="auto", help="as `inference-node serve --tuning-table`")
    t.add_argument("--mode", dest="modes", action="append", default=None,
                   help="launch choices other than the defaults, NAME=VALUE joined by /; repeatable, rows ROW@MODE")
    t.add_argument("--all-reduce", default="nccl", help="nccl, symm and/or fused: the node's --all-reduce at TP > 1")
    t.add_argument("--child", default=None, help=argparse.SUPPRESS)  # TP,ALL_REDUCE,MODE of one child
    a = sub.add_parser("allreduce", help="NCCL against the node's symm and fused all-reduces, per message size")
    a.set_defaults(run=allreduce)
    a.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="cuda (NCCL) where a GPU is, else cpu (gloo)")
    a.add_argument("--nproc", type=int, default=None, help="processes (CUDA: every visible GPU; CPU: 2)")
    a.add_argument("--sizes", choices=tuple(SIZES), default="decode",
                   help="decode: rows 1..256 x hidden 4096, 8192; small: rows 1, 8 x hidden 256")
    a.add_argument("--rows", type=lambda v: tuple(int(x) for x in v.split(",")), default=None)
    a.add_argument("--hidden", type=lambda v: tuple(int(x) for x in v.split(",")), default=None)
    a.add_argument("--ops", type=int, default=20, help="all-reduces per timed run and per graph")
    a.add_argument("--repeats", type=int, default=30)
    a.add_argument("--warmup", type=int, default=5)
    a.add_argument("--json", type=Path, default=None, help="also write the report (steps --allreduce-json reads it)")
    args = p.parse_args(argv)
    args.argv = list(argv)[1:] if argv is not None else None
    return args


def main(argv: Sequence[str] | None = None):
    args = parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    main()
