"""The least time one decode step can take on one tensor-parallel rank (TP size 1: the whole
model on one device), for the benchmarks' "floor" columns.

A decode step is memory-bound: every rank must read its shard of the weights, the KV its
heads attend over and the A and B of every distinct adapter in the batch. Its floor is those
bytes over the device's read bandwidth, plus the step's collectives at their measured times
(they sit between the layers' reads, so they add rather than overlap):

    floor = bytes read per rank / read_bandwidth + all-reduces x t(all-reduce) + t(logits gather)

read_bandwidth is what `bench.common.copy_bandwidth` returns: a device-to-device copy's bytes
read plus bytes written per second (about 3.0 TB/s on the H100 here). DRAM serves reads and
writes from one budget, and a decode step writes next to nothing, so a step may read at that
rate: halving it (the copy's read stream alone) would double every floor.

The layout is the node's (inference_node/parallel/shard.py, Megatron's): q/k/v and gate/up
keep a block of output columns, o and down a block of input rows, the embedding and LM head a
block of ceil(vocab / TP) rows (the last block zero-padded); the norms are replicated. LoRA
follows: on column-parallel projections A is whole and B split, on row-parallel ones A split
and B whole. Collectives per step: one all-reduce of [rows, hidden] after the embedding
lookup, two per layer (after o and after down), one all-gather of the logits and, in a decode
graph, one broadcast of the step's token ids from rank 0 (only it holds the last samples).

    python -m bench.tp_floor --allreduce-json ar.json    # the floors of the issue's TP rows
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from inference_node.model.config import ModelConfig
from inference_node.parallel.shard import COLUMN_PARALLEL, check_divisible


@dataclass(frozen=True)
class AdapterSet:
    """`count` distinct adapters of one rank and set of target modules."""

    count: int
    rank: int
    targets: tuple[str, ...]


@dataclass(frozen=True)
class Collectives:
    """The collectives of one decode step of a tensor-parallel rank."""

    all_reduces: int   # each of [rows, hidden]
    all_gathers: int   # each of [rows, ceil(vocab / TP)] per rank: the logits
    broadcasts: int    # each of [rows] int64 from rank 0: the token ids


@dataclass(frozen=True)
class DecodeFloor:
    """One rank's decode-step floor and what it is made of (bytes and seconds)."""

    weights: int
    embed_rows: int
    kv: int
    adapters: int
    collectives: Collectives
    memory_s: float
    comm_s: float

    @property
    def bytes_read(self) -> int:
        return self.weights + self.embed_rows + self.kv + self.adapters

    @property
    def seconds(self) -> float:
        return self.memory_s + self.comm_s


def _check_tp(cfg: ModelConfig, tp: int) -> None:
    if tp < 1:
        raise ValueError(f"tensor-parallel size must be at least 1, not {tp}")
    if tp > 1:
        check_divisible(cfg, tp)


def norm_bytes(cfg: ModelConfig, itemsize: int) -> int:
    """The RMSNorm weights (two per layer and the final one): every rank holds them whole."""
    return (2 * cfg.num_layers + 1) * cfg.hidden_size * itemsize


def weight_bytes_per_rank(cfg: ModelConfig, itemsize: int, tp: int = 1) -> int:
    """The weights one rank reads in a decode step: its projection shards, the replicated
    norms and its block of the LM head (the embedding table itself is not read whole: only
    the batch's rows, `embed_row_bytes`; a tied table is counted once, as the LM head)."""
    _check_tp(cfg, tp)
    h = cfg.hidden_size
    qkv_out = (cfg.q_size + 2 * cfg.kv_size) // tp
    per_layer = (h * qkv_out                          # q, k, v: output columns split
                 + (cfg.q_size // tp) * h              # o: input rows split
                 + h * 2 * (cfg.intermediate_size // tp)  # gate, up
                 + (cfg.intermediate_size // tp) * h)  # down
    if cfg.attention_bias:
        per_layer += qkv_out
    vocab_rows = -(-cfg.vocab_size // tp)
    return (cfg.num_layers * per_layer + vocab_rows * h) * itemsize + norm_bytes(cfg, itemsize)


def embed_row_bytes(cfg: ModelConfig, itemsize: int) -> int:
    """One token's embedding lookup: a whole row on every rank (a rank outside its vocabulary
    block looks up a row and zeroes it)."""
    return cfg.hidden_size * itemsize


def kv_bytes_per_token(cfg: ModelConfig, itemsize: int, tp: int = 1) -> int:
    """One attended token's K and V over all layers, for this rank's KV heads."""
    _check_tp(cfg, tp)
    return cfg.num_layers * 2 * (cfg.kv_size // tp) * itemsize


def adapter_bytes_per_rank(cfg: ModelConfig, rank: int, targets: Sequence[str], itemsize: int,
                           tp: int = 1) -> int:
    """One adapter's A [r, in] and B [out, r] on one rank, over all layers: B split with a
    column-parallel projection's outputs, A with a row-parallel one's inputs."""
    _check_tp(cfg, tp)
    shapes = cfg.module_shapes()
    per_layer = 0
    for module in targets:
        fan_in, fan_out = shapes[module]
        if module in COLUMN_PARALLEL:
            per_layer += rank * fan_in + (fan_out // tp) * rank
        else:
            per_layer += rank * (fan_in // tp) + fan_out * rank
    return cfg.num_layers * per_layer * itemsize


def collectives_per_step(cfg: ModelConfig, tp: int) -> Collectives:
    """The embedding's all-reduce, two per layer (o and down), the logits' all-gather, the
    token ids' broadcast; none on one device."""
    if tp == 1:
        return Collectives(0, 0, 0)
    return Collectives(all_reduces=2 * cfg.num_layers + 1, all_gathers=1, broadcasts=1)


def logits_gather_bytes(cfg: ModelConfig, itemsize: int, tp: int, rows: int) -> int:
    """The gathered logits' bytes (all ranks' blocks, padding included)."""
    return rows * tp * -(-cfg.vocab_size // tp) * itemsize


def bus_bandwidth_all_reduce(nbytes: int, ranks: int, seconds: float) -> float:
    """NCCL's bus bandwidth of an all-reduce of `nbytes` per rank: 2 (n-1)/n bytes / time."""
    return 2 * (ranks - 1) / ranks * nbytes / seconds


def all_gather_seconds(total_bytes: int, ranks: int, bus_bandwidth: float) -> float:
    """An all-gather's time at a given bus bandwidth (NCCL's convention: (n-1)/n of the
    gathered bytes cross the bus)."""
    return (ranks - 1) / ranks * total_bytes / bus_bandwidth


@dataclass(frozen=True)
class StepBytes:
    """What one rank's decode step must read at least, for steps of varying batch, adapters
    and attended KV (the serving benchmark's per-step floor)."""

    weights: int
    embed_row: int
    kv_token: int
    adapter: Mapping[str, int] = field(default_factory=dict)  # adapter name -> its bytes per rank

    @classmethod
    def of(cls, cfg: ModelConfig, itemsize: int, adapter_bytes: Mapping[str, int], tp: int = 1) -> "StepBytes":
        """cfg: the whole model's shapes."""
        return cls(weight_bytes_per_rank(cfg, itemsize, tp), embed_row_bytes(cfg, itemsize),
                   kv_bytes_per_token(cfg, itemsize, tp), dict(adapter_bytes))

    def step(self, batch: int, adapters: frozenset[str], kv_tokens: int) -> int:
        return (self.weights + batch * self.embed_row + kv_tokens * self.kv_token
                + sum(self.adapter[a] for a in adapters))


def decode_floor(cfg: ModelConfig, itemsize: int, tp: int, rows: int, context_len: int,
                 read_bandwidth: float, adapters: Sequence[AdapterSet] = (),
                 all_reduce_s: float | None = None, all_gather_s: float | None = None,
                 broadcast_s: float | None = None) -> DecodeFloor:
    """The floor of a decode step of `rows` sequences, each attending over `context_len`
    tokens, with `adapters` distinct adapters in the batch. all_reduce_s: the measured time
    of one [rows, hidden] all-reduce; all_gather_s: the logits' all-gather; broadcast_s: the
    token ids' broadcast (all three needed when tp > 1: `collective_times` gives them from
    bench.allreduce_bench's report)."""
    collectives = collectives_per_step(cfg, tp)
    if tp > 1 and None in (all_reduce_s, all_gather_s, broadcast_s):
        raise ValueError("a tensor-parallel floor needs the all-reduce, all-gather and broadcast times "
                         "(python -m bench.allreduce_bench measures the all-reduce; collective_times)")
    weights = weight_bytes_per_rank(cfg, itemsize, tp)
    embed_rows = rows * embed_row_bytes(cfg, itemsize)
    kv = rows * context_len * kv_bytes_per_token(cfg, itemsize, tp)
    adapter = sum(a.count * adapter_bytes_per_rank(cfg, a.rank, a.targets, itemsize, tp) for a in adapters)
    memory_s = (weights + embed_rows + kv + adapter) / read_bandwidth
    comm_s = 0.0
    if tp > 1:
        comm_s = (collectives.all_reduces * all_reduce_s + collectives.all_gathers * all_gather_s
                  + collectives.broadcasts * broadcast_s)
    return DecodeFloor(weights, embed_rows, kv, adapter, collectives, memory_s, comm_s)


# -- from an all-reduce benchmark's report ---------------------------------------------------------
def all_reduce_times(report: dict, method: str) -> dict[tuple[int, int], float]:
    """(rows, hidden) -> seconds of one all-reduce by `method` (e.g. "nccl graph") in
    bench.allreduce_bench's --json report."""
    return {(r["rows"], r["hidden"]): r["seconds"] for r in report["results"]
            if r["method"] == method and r.get("seconds") is not None}


def collective_times(report: dict, method: str, cfg: ModelConfig, tp: int, rows: int,
                     itemsize: int = 2) -> tuple[float, float, float]:
    """(all-reduce, all-gather, broadcast) seconds for a decode step of `rows` from a report
    of `tp` processes: the all-reduce measured at [rows, hidden]; the logits' all-gather at
    that all-reduce's bus bandwidth; the token ids' broadcast (a few hundred bytes, latency
    alone) as the report's smallest all-reduce of that hidden size."""
    if report["world_size"] != tp:
        raise ValueError(f"the all-reduce report is of {report['world_size']} processes, not {tp}")
    times = {k: v for k, v in all_reduce_times(report, method).items() if k[1] == cfg.hidden_size}
    if (rows, cfg.hidden_size) not in times:
        raise ValueError(f"the report has no {method!r} all-reduce of [{rows}, {cfg.hidden_size}] "
                         f"(it has rows {sorted(r for r, _ in times)}): run bench.allreduce_bench --rows {rows}")
    all_reduce = times[(rows, cfg.hidden_size)]
    busbw = bus_bandwidth_all_reduce(rows * cfg.hidden_size * itemsize, tp, all_reduce)
    gather = all_gather_seconds(logits_gather_bytes(cfg, itemsize, tp, rows), tp, busbw)
    return all_reduce, gather, times[min(times)]


def decode_step_floor_ms(checkpoint: Path, tp: int, batch: int, context: int, adapters: int = 0,
                         rank: int = 16, copy_bandwidth: float = 3.0e12,
                         targets: Sequence[str] | None = None, itemsize: int = 2,
                         allreduce: dict | Path | None = None, method: str = "nccl graph") -> float:
    """A full-batch decode step's floor per GPU in ms (bench.tp_bench's column): `batch` rows
    attending over `context` tokens each, `adapters` distinct adapters of `rank` on `targets`
    (default all seven projections). With tp > 1 the collectives come from `allreduce`, an
    allreduce_bench --json report of tp processes; without one the floor is the bytes alone,
    and a warning says so."""
    import warnings

    from bench.common import ALL_MODULES

    cfg = ModelConfig.from_checkpoint(Path(checkpoint))
    sets = [AdapterSet(adapters, rank, tuple(targets or ALL_MODULES))] if adapters else []
    times: tuple[float | None, ...] = (None, None, None)
    if tp > 1:
        if allreduce is None:
            warnings.warn("tensor-parallel floor without collectives (no all-reduce report): bytes alone",
                          stacklevel=2)
            times = (0.0, 0.0, 0.0)
        else:
            report = allreduce if isinstance(allreduce, dict) else json.loads(Path(allreduce).read_text())
            times = collective_times(report, method, cfg, tp, batch, itemsize)
    f = decode_floor(cfg, itemsize, tp, batch, context, copy_bandwidth, sets, *times)
    return f.seconds * 1e3


def main(argv: Sequence[str] | None = None) -> list[tuple[str, DecodeFloor]]:
    from bench.common import ALL_MODULES, LLAMA_3_1_8B

    # The 70B shape with the 8B's (SmolLM2) vocabulary, as the benchmarks build it.
    llama_70b = {**LLAMA_3_1_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                 "num_attention_heads": 64}
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--allreduce-json", type=Path, required=True,
                   help="the --json of python -m bench.allreduce_bench --nproc TP, run on the same host")
    p.add_argument("--method", default="nccl graph", help="the all-reduce method whose times to use")
    p.add_argument("--read-bandwidth", type=float, default=3.0e12,
                   help="bytes/s: bench.common.copy_bandwidth on the same device (read + write counted)")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--context", type=int, default=1024, help="tokens each row attends over")
    p.add_argument("--adapters", type=int, default=32, help="distinct rank-16 all-projection adapters")
    args = p.parse_args(argv)
    report = json.loads(args.allreduce_json.read_text())
    tp = report["world_size"]
    out = []
    print(f"decode-step floor per rank, TP {tp}, {args.rows} rows x {args.context} tokens, bf16, read "
          f"bandwidth {args.read_bandwidth / 1e12:.2f} TB/s, collectives: {args.method} ({report['device']})")
    print(f"{'model':<6} {'adapters':>8} {'weights GB':>10} {'KV GB':>7} {'LoRA GB':>8} {'mem ms':>7} "
          f"{'ARs':>4} {'AR us':>6} {'gather us':>9} {'bcast us':>8} {'comm ms':>8} {'floor ms':>9}")
    for name, raw in (("8B", LLAMA_3_1_8B), ("70B", llama_70b)):
        cfg = ModelConfig.from_dict(raw)
        try:
            ar, gather, bcast = collective_times(report, args.method, cfg, tp, args.rows)
        except ValueError as exc:
            print(f"{name:<6} n/a ({exc})")
            continue
        for count in (0, args.adapters):
            sets = [AdapterSet(count, 16, ALL_MODULES)] if count else []
            f = decode_floor(cfg, 2, tp, args.rows, args.context, args.read_bandwidth, sets, ar, gather, bcast)
            out.append((f"{name}/{count}", f))
            print(f"{name:<6} {count:>8} {f.weights / 1e9:10.3f} {f.kv / 1e9:7.3f} {f.adapters / 1e9:8.3f} "
                  f"{f.memory_s * 1e3:7.3f} {f.collectives.all_reduces:>4} {ar * 1e6:6.1f} {gather * 1e6:9.1f} "
                  f"{bcast * 1e6:8.1f} {f.comm_s * 1e3:8.3f} {f.seconds * 1e3:9.3f}")
    print("gather: the logits' all-gather at the all-reduce's bus bandwidth for these rows; bcast: the token "
          "ids' broadcast taken as the smallest all-reduce measured")
    return out


if __name__ == "__main__":
    main()
