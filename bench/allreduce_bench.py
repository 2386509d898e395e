"""All-reduce of decode-sized bf16 messages ([rows, hidden], as a tensor-parallel decode step
sums after o and down): NCCL through torch.distributed next to PyTorch's symmetric-memory
one-shot and two-shot all-reduce, each run eagerly and replayed from a CUDA graph.

    python -m bench.allreduce_bench                      # one process per visible GPU
    python -m bench.allreduce_bench --nproc 2 --json ar.json   # (python -m bench.tp_floor reads it)
    python -m bench.allreduce_bench --device cpu --nproc 2 --sizes small   # gloo: a smoke run

Methods (every one checked against the exact sum on every rank before and after timing; a
wrong sum stops the run):
  nccl         torch.distributed.all_reduce, in place (gloo on CPU, where it is the only one)
  symm 1-shot  torch.ops.symm_mem.one_shot_all_reduce_copy_out: the input copied into a
               symmetric-memory buffer inside the kernel, every peer's buffer read and summed
               (one_shot_all_reduce_out after a copy where the fused copy is missing)
  symm 2-shot  the input copied into the buffer, then two_shot_all_reduce_out (reduce-scatter
               and all-gather through peer memory)
  eager: ops launched one by one; graph: one CUDA graph of --ops all-reduces (distinct
  tensors), replayed, its time divided by --ops.

Each cell is the median over --repeats of microseconds per all-reduce (CUDA events; the slowest
rank's median), with the bus bandwidth in brackets (NCCL's convention: 2 (n-1)/n x bytes /
time). NVLink multicast stays off: NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and
NVSHMEM_DISABLE_NVLS=1 are set before any CUDA call (a run with another value is refused),
no multimem operation is called, and a symmetric buffer that comes back with a multicast
address stops the run.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, MutableMapping, Sequence

import torch
import torch.distributed as dist

# NVLink multicast can take a shared host's GPUs out of service: these stay off in this
# process and in every process it starts.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
SIZES = {"decode": ((1, 8, 32, 64, 128, 256), (4096, 8192)), "small": ((1, 8), (256,))}
METHODS = ("nccl", "symm 1-shot", "symm 2-shot")
MODES = ("eager", "graph")
MAX_RANKS = 8
DTYPE = torch.bfloat16


def keep_multicast_off(env: MutableMapping[str, str] = os.environ) -> None:
    """Sets the variables that keep NVLink multicast off where missing; refuses other values."""
    for name, value in MULTICAST_OFF.items():
        current = env.setdefault(name, value)
        if current != value:
            raise SystemExit(f"{name}={current}: this benchmark runs only with NVLink multicast off "
                             f"({name}={value}); unset it or set it to {value}")


@dataclass(frozen=True)
class Settings:
    device: str                    # "cuda" or "cpu"
    nproc: int
    rows: tuple[int, ...]
    hidden: tuple[int, ...]
    ops: int = 20                  # all-reduces per timed run (and per graph)
    repeats: int = 30
    warmup: int = 5
    timeout_s: float = 300.0       # one collective: a rank that dies fails the others


@dataclass
class Cell:
    """One method at one size: seconds per all-reduce (the slowest rank's median), or why not."""

    method: str                    # e.g. "nccl graph"
    rows: int
    hidden: int
    seconds: float | None = None
    reason: str | None = None
    verified: int = 0              # outputs checked against the exact sum, on each rank

    @property
    def nbytes(self) -> int:
        return self.rows * self.hidden * DTYPE.itemsize


@dataclass
class Report:
    world_size: int
    device: str
    backend: str
    versions: str
    env: dict[str, str | None] = field(default_factory=dict)  # the workers' multicast switches
    notes: list[str] = field(default_factory=list)
    results: list[Cell] = field(default_factory=list)


def bus_bandwidth(nbytes: int, ranks: int, seconds: float) -> float:
    return 2 * (ranks - 1) / ranks * nbytes / seconds


# -- what every rank holds and checks ------------------------------------------------------------
def pattern(numel: int, op: int, rank: int, device: torch.device) -> torch.Tensor:
    """Rank `rank`'s input to all-reduce number `op`: (1..8, shifted by op) x (rank + 1), so a
    rank that reads a peer's previous or next message, or one rank's buffer twice, gets a wrong
    sum. Up to 8 ranks every partial sum is an integer bf16 holds exactly (below 256, or a
    multiple of 8 below 512), in any order of addition."""
    i = torch.arange(numel, device=device)
    return (((i + op) % 8 + 1) * (rank + 1)).to(DTYPE)


def expected_sum(numel: int, op: int, ranks: int, device: torch.device) -> torch.Tensor:
    i = torch.arange(numel, device=device)
    return (((i + op) % 8 + 1) * (ranks * (ranks + 1) // 2)).to(DTYPE)


def check_sums(outputs: torch.Tensor, ranks: int, what: str) -> int:
    """Raises naming the first wrong element unless outputs[k] is the sum of op k's inputs;
    returns how many outputs were checked."""
    ops, numel = outputs.shape[0], outputs[0].numel()
    for k in range(ops):
        want = expected_sum(numel, k, ranks, outputs.device)
        got = outputs[k].reshape(-1)
        if not torch.equal(got, want):
            bad = int((got != want).nonzero()[0])
            raise AssertionError(f"{what}: all-reduce {k} of {ops} gave {got[bad].item()} at element {bad}, "
                                 f"expected {want[bad].item()} (the sum over {ranks} ranks)")
    return ops


# -- methods ---------------------------------------------------------------------------------------
@dataclass
class Buffers:
    """One size's tensors on one rank: --ops inputs and outputs (views of one allocation each)
    and, where symmetric memory is open, a view of the symmetric buffer."""

    x: torch.Tensor                # [ops, rows, hidden]
    y: torch.Tensor                # [ops, rows, hidden]
    symm: torch.Tensor | None      # [rows, hidden]

    def fill(self, rank: int) -> None:
        numel = self.x[0].numel()
        for k in range(self.x.shape[0]):
            self.x[k].copy_(pattern(numel, k, rank, self.x.device).view_as(self.x[k]))
        self.y.zero_()


class MulticastOn(RuntimeError):
    """NVLink multicast is on despite the environment: the run stops (no n/a for this one)."""


class Symmetric:
    """A symmetric-memory buffer of the largest message, rendezvoused over the world group."""

    def __init__(self, numel: int, device: torch.device) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        from inference_node.parallel.symmetric import open_symmetric_buffer

        self.group_name = dist.group.WORLD.group_name
        self.buffer, handle, self.notes = open_symmetric_buffer(numel, DTYPE, device, self.group_name)
        if getattr(handle, "multicast_ptr", 0):
            raise MulticastOn("the symmetric buffer came back with an NVLink multicast address although "
                               "TORCH_SYMM_MEM_DISABLE_MULTICAST=1: stopping (multicast must stay off)")
        get_backend = getattr(symm_mem, "get_backend", None)
        self.backend = get_backend(device) if get_backend is not None else "default"
        ops = torch.ops.symm_mem
        self.fused_copy = hasattr(ops, "one_shot_all_reduce_copy_out")
        self.has_one_shot = self.fused_copy or hasattr(ops, "one_shot_all_reduce_out")
        self.two_shot_out = hasattr(ops, "two_shot_all_reduce_out")
        self.has_two_shot = self.two_shot_out or hasattr(ops, "two_shot_all_reduce_")

    def view(self, rows: int, hidden: int) -> torch.Tensor:
        return self.buffer[:rows * hidden].view(rows, hidden)

    def describe(self) -> list[str]:
        one = ("one_shot_all_reduce_copy_out (input copied in by the kernel)" if self.fused_copy
               else "copy in + one_shot_all_reduce_out")
        two = "copy in + " + ("two_shot_all_reduce_out" if self.two_shot_out else "two_shot_all_reduce_ + copy out")
        return [f"symmetric memory: backend {self.backend}; symm 1-shot = {one}; symm 2-shot = {two}", *self.notes]


def step_for(method: str, buf: Buffers, symm: Symmetric | None) -> Callable[[], None]:
    """All --ops all-reduces of `buf` by `method`, launched in order (outputs in buf.x for
    nccl, buf.y for the symmetric-memory ones)."""
    ops = buf.x.shape[0]
    if method == "nccl":
        def step() -> None:
            for k in range(ops):
                dist.all_reduce(buf.x[k])
        return step
    if symm is None:
        raise RuntimeError("symmetric memory is not open")
    view, name, sm = buf.symm, symm.group_name, torch.ops.symm_mem
    if method == "symm 1-shot":
        if not symm.has_one_shot:
            raise RuntimeError("torch.ops.symm_mem has no one_shot_all_reduce_out")
        if symm.fused_copy:
            def step() -> None:
                for k in range(ops):
                    sm.one_shot_all_reduce_copy_out(view, buf.x[k], "sum", name, buf.y[k])
        else:
            def step() -> None:
                for k in range(ops):
                    view.copy_(buf.x[k])
                    sm.one_shot_all_reduce_out(view, "sum", name, buf.y[k])
        return step
    if method == "symm 2-shot":
        if not symm.has_two_shot:
            raise RuntimeError("torch.ops.symm_mem has no two_shot_all_reduce_")
        if symm.two_shot_out:
            def step() -> None:
                for k in range(ops):
                    view.copy_(buf.x[k])
                    sm.two_shot_all_reduce_out(view, "sum", name, buf.y[k])
        else:
            def step() -> None:
                for k in range(ops):
                    view.copy_(buf.x[k])
                    sm.two_shot_all_reduce_(view, "sum", name)
                    buf.y[k].copy_(view)
        return step
    raise ValueError(f"unknown method {method!r}")


def capture(step: Callable[[], None]) -> Callable[[], None]:
    """The step recorded in one CUDA graph; returns its replay."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    # thread_local: NCCL's and c10d's own threads may touch CUDA while this one captures.
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        step()
    torch.cuda.synchronize()
    return graph.replay


def time_per_op(run: Callable[[], None], s: Settings, cuda: bool) -> float:
    """Median seconds per all-reduce over s.repeats runs of s.ops (after s.warmup runs)."""
    for _ in range(s.warmup):
        run()
    times = []
    if cuda:
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(s.repeats)]
        for start, end in events:  # back to back: the ranks stay in step through the collectives
            start.record()
            run()
            end.record()
        torch.cuda.synchronize()
        times = [start.elapsed_time(end) * 1e-3 for start, end in events]
    else:
        for _ in range(s.repeats):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
    return statistics.median(times) / s.ops


# -- one rank --------------------------------------------------------------------------------------
def agree(reason: str | None) -> str | None:
    """Every rank's failure (None: it worked), gathered: the first failure or None, the same
    answer on every rank, so all of them skip or run the next collective together."""
    reasons: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(reasons, reason)
    return next((r for r in reasons if r is not None), None)


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:160]


def run_case(method: str, mode: str, buf: Buffers, symm: Symmetric | None, s: Settings,
             rank: int, sync: Callable[[], None]) -> tuple[float | None, str | None, int]:
    """(seconds per all-reduce on this rank, why not, outputs verified)."""
    cuda = s.device == "cuda"
    run, reason = None, None
    try:
        step = step_for(method, buf, symm)
        buf.fill(rank)
        step()  # the first launch: host-side refusals (and NCCL's setup) before any graph
        sync()
        run = capture(step) if mode == "graph" else step
    except Exception as exc:  # noqa: BLE001 - reported in the table as n/a (reason)
        reason = _reason(exc)
    reason = agree(reason)
    if reason is not None:
        return None, reason, 0
    outputs = buf.x if method == "nccl" else buf.y
    label = f"{method} {mode}, {buf.x.shape[1]} x {buf.x.shape[2]}, rank {rank}"

    def verify() -> int:
        buf.fill(rank)
        run()
        sync()
        try:
            checked = check_sums(outputs, s.nproc, label)
            failure = None
        except AssertionError as exc:
            checked, failure = 0, str(exc)
        failure = agree(failure)
        if failure is not None:
            raise AssertionError(failure)
        return checked

    checked = verify()
    seconds = time_per_op(run, s, cuda)
    checked += verify()
    return seconds, None, checked


def worker(rank: int, s: Settings, rendezvous: str, result_path: str) -> None:
    keep_multicast_off()  # inherited from the parent; checked again before CUDA starts here
    cuda = s.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=rank, world_size=s.nproc,
                            timeout=datetime.timedelta(seconds=s.timeout_s),
                            device_id=device if cuda else None)
    try:
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        largest = max(s.rows) * max(s.hidden)
        symm, symm_reason = None, None
        if cuda:
            try:
                symm = Symmetric(largest, device)
            except MulticastOn:
                raise
            except Exception as exc:  # noqa: BLE001 - reported as n/a (reason)
                symm_reason = _reason(exc)
            symm_reason = agree(symm_reason)
            if symm_reason is not None:
                symm = None
        else:
            symm_reason = "symmetric memory needs CUDA"
        cells: list[Cell] = []
        for hidden in s.hidden:
            for rows in s.rows:
                buf = Buffers(torch.empty(s.ops, rows, hidden, dtype=DTYPE, device=device),
                              torch.empty(s.ops, rows, hidden, dtype=DTYPE, device=device),
                              symm.view(rows, hidden) if symm is not None else None)
                for method in METHODS:
                    eager_failed = None
                    for mode in MODES:
                        name = f"{backend if method == 'nccl' else method} {mode}"
                        cell = Cell(name, rows, hidden)
                        if method != "nccl" and symm is None:
                            cell.reason = symm_reason
                        elif mode == "graph" and not cuda:
                            cell.reason = "CUDA graphs need CUDA"
                        elif mode == "graph" and eager_failed:
                            cell.reason = f"eager failed: {eager_failed}"
                        else:
                            cell.seconds, cell.reason, cell.verified = run_case(method, mode, buf, symm, s, rank, sync)
                            if mode == "eager":
                                eager_failed = cell.reason
                        cells.append(cell)
                del buf
        everyone: list[list[Cell] | None] = [None] * s.nproc
        dist.all_gather_object(everyone, cells)
        if rank == 0:
            report = Report(s.nproc, _device_name(cuda), backend, _versions(cuda),
                            {k: os.environ.get(k) for k in MULTICAST_OFF},
                            symm.describe() if symm is not None else [])
            for per_rank in zip(*everyone):
                first = per_rank[0]
                times = [c.seconds for c in per_rank]
                merged = Cell(first.method, first.rows, first.hidden,
                              max(times) if all(t is not None for t in times) else None,
                              next((c.reason for c in per_rank if c.reason), None),
                              min(c.verified for c in per_rank))
                report.results.append(merged)
            Path(result_path).write_text(json.dumps(report_dict(report)))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _device_name(cuda: bool) -> str:
    return torch.cuda.get_device_name() if cuda else "CPU"


def _versions(cuda: bool) -> str:
    text = f"torch {torch.__version__}"
    if cuda:
        nccl = torch.cuda.nccl.version()
        text += f", NCCL {'.'.join(map(str, nccl)) if isinstance(nccl, tuple) else nccl}"
    return text


# -- the table -------------------------------------------------------------------------------------
def report_dict(report: Report) -> dict:
    out = asdict(report)
    for cell, row in zip(report.results, out["results"]):
        row["bytes"] = cell.nbytes
        row["bus_bandwidth"] = (bus_bandwidth(cell.nbytes, report.world_size, cell.seconds)
                                if cell.seconds else None)
    return out


def format_table(report: dict, s: Settings) -> list[str]:
    """One line per size, the methods side by side, then the symmetric-memory/NCCL ratios."""
    results = report["results"]
    names = list(dict.fromkeys(r["method"] for r in results))
    base = report["backend"]
    notes: dict[str, int] = {}  # reason -> footnote number
    noted: dict[str, list[str]] = {}
    width = 19
    lines = [
        f"all-reduce (sum) of bf16 [rows, hidden] over {report['world_size']} processes, {report['backend']}, "
        f"{report['device']}, {report['versions']}",
        "env: " + " ".join(f"{k}={v}" for k, v in report["env"].items()),
        *report["notes"],
        f"cells: us per all-reduce, median of {s.repeats} runs of {s.ops} (slowest rank), (bus bandwidth GB/s); "
        f"graph: one CUDA graph of {s.ops} all-reduces replayed",
    ]
    head = f"{'rows':>5} {'hidden':>6} {'KB':>7} |" + "".join(f"{n:>{width}}" for n in names)
    head += f" | {'symm/' + base + ' eager':>18} {'graph':>9}"
    lines += [head, "-" * len(head)]
    by_size: dict[tuple[int, int], dict[str, dict]] = {}
    for r in results:
        by_size.setdefault((r["rows"], r["hidden"]), {})[r["method"]] = r
    for (rows, hidden), cells in by_size.items():
        text = f"{rows:>5} {hidden:>6} {rows * hidden * DTYPE.itemsize / 1024:7.1f} |"
        for name in names:
            r = cells[name]
            if r["seconds"] is None:
                number = notes.setdefault(r["reason"], len(notes) + 1)
                noted.setdefault(r["reason"], []).append(name)
                text += f"{f'n/a [{number}]':>{width}}"
            else:
                cell = f"{r['seconds'] * 1e6:.1f} ({r['bus_bandwidth'] / 1e9:6.1f})"
                text += f"{cell:>{width}}"
        ratios = []
        for mode in MODES:
            ref = cells.get(f"{base} {mode}", {}).get("seconds")
            best = min(((cells[f"{m} {mode}"]["seconds"], m[-6:]) for m in METHODS[1:]
                        if cells.get(f"{m} {mode}", {}).get("seconds")), default=None)
            ratios.append(f"{best[0] / ref:.2f} {best[1]}" if best and ref else "n/a")
        text += f" | {ratios[0]:>18} {ratios[1]:>9}"
        lines.append(text)
    lines.append("-" * len(head))
    for reason, number in notes.items():
        where = sorted(set(noted[reason]))
        lines.append(f"[{number}] n/a ({reason}): {', '.join(where)}")
    lines.append("symm/" + base + ": the faster symmetric-memory method's time / the same mode's " + base +
                 " time (< 1: symmetric memory is faster); every result checked against the exact sum "
                 "before and after timing")
    return lines


# -- the launcher ----------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="cuda (NCCL, one process per GPU) where a GPU is present, else cpu (gloo)")
    p.add_argument("--nproc", type=int, default=None, help="processes (CUDA: default every visible GPU; CPU: 2)")
    p.add_argument("--sizes", choices=tuple(SIZES), default="decode",
                   help="decode: rows 1..256 x hidden 4096, 8192; small: rows 1, 8 x hidden 256")
    p.add_argument("--rows", type=lambda v: tuple(int(x) for x in v.split(",")), default=None)
    p.add_argument("--hidden", type=lambda v: tuple(int(x) for x in v.split(",")), default=None)
    p.add_argument("--ops", type=int, default=20, help="all-reduces per timed run and per graph")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict:
    keep_multicast_off()  # before anything can start CUDA, here or in the processes spawned
    args = parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":
        count = torch.cuda.device_count()
        nproc = args.nproc or count
        if nproc > count:
            raise SystemExit(f"--nproc {nproc}: only {count} GPU(s) visible")
    else:
        nproc = args.nproc or 2
    if not 2 <= nproc <= MAX_RANKS:
        raise SystemExit(f"--nproc {nproc}: 2 to {MAX_RANKS} processes (the exact-sum check holds up to {MAX_RANKS})")
    rows, hidden = SIZES[args.sizes]
    settings = Settings(device, nproc, args.rows or rows, args.hidden or hidden, args.ops, args.repeats, args.warmup)
    with tempfile.TemporaryDirectory(prefix="allreduce-bench-") as work:
        result_path = os.path.join(work, "result.json")
        torch.multiprocessing.spawn(worker, args=(settings, os.path.join(work, "rendezvous"), result_path),
                                    nprocs=nproc, join=True)
        report = json.loads(Path(result_path).read_text())
    for line in format_table(report, settings):
        print(line)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
