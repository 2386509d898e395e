"""The decode GEMM with LoRA folded in (kernels/gemm/fold.py), alone on the GPU, against the
plain decode GEMM and against its own parts, per fused projection of a Llama-3.2-1B-shaped
layer at decode batch 64.

    python -m bench.lora_gemm_sweep                         # every group, 32 adapters
    python -m bench.lora_gemm_sweep --groups o --adapters 1,32,64 --tilings 16,128,4 16,64,8

Rows per (group, tiling): the plain GEMM (kernels/gemm/triton_kernel.py, TMA on Hopper), the
fold with no adapter in the step (the same launch with its shrink programs idle: the cost of
the role tickets and counters), and the fold with N adapters of rank 16, two rows each up to
64. Each is timed over a burst of launches in one CUDA graph that cycle through 16 copies of the weights (as
the layers of a step do, so L2 holds none of them), by CUDA events; the floor is the bytes
read (W, plus each adapter's A and B) at the device's copy bandwidth (bench/common.py).
"""
from __future__ import annotations

import argparse

import torch

from bench.common import copy_bandwidth
from kernels.gemm import GemmLora, fold_counters
from kernels.gemm.fold_triton_kernel import decode_gemm_lora_triton
from kernels.gemm.triton_kernel import decode_gemm_tma, decode_gemm_triton
from kernels.lora.meta import SEGMENT_TABLE_RANKS, LoraBatchMeta
from kernels.tuning import DEFAULT_TUNING

HIDDEN, Q, KV, INTER = 2048, 2048, 512, 8192
GROUPS = {"qkv": (HIDDEN, [Q, KV, KV]), "o": (Q, [HIDDEN]), "gate_up": (HIDDEN, [INTER, INTER]),
          "down": (INTER, [HIDDEN])}
COPIES = 16


def time_us(fn, reps: int) -> float:
    """GPU time per launch: `reps` launches captured in one CUDA graph (so the host's launch
    cost is out), replayed three times, the best replay."""
    for i in range(COPIES):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            fn(i % COPIES)
    best = float("inf")
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / reps)
    return best


def folds(k: int, outs: list[int], adapters: int, device: torch.device) -> list[GemmLora]:
    """One GemmLora per weight copy: `adapters` adapters of rank 16 (0: an empty segment),
    64 rows grouped by adapter."""
    r, slices, n = 16, len(outs), sum(outs)
    slots = sorted(i % adapters for i in range(64)) if adapters else [-1] * 64
    meta = LoraBatchMeta.build(slots, device)
    # Slot s's rank rows: s*r .. s*r + r - 1 of every slice's arena (kernels/lora/rows.py).
    table_meta = meta.with_segment_table([[v for _ in range(slices) for v in (r, s * r)]
                                          for s in range(64)], max(1, adapters))
    out = []
    for _ in range(COPIES):
        out.append(GemmLora(
            a_all=torch.randn(slices, 64 * r, k, device=device, dtype=torch.bfloat16) / 32,
            b_all=torch.randn(64 * r, n, device=device, dtype=torch.bfloat16) / 32,
            scaling=torch.ones(64, device=device), slice_offsets=tuple(
                sum(outs[:i]) for i in range(slices)),
            segment_table=table_meta.segment_table, segments=max(1, adapters),
            rank_col=SEGMENT_TABLE_RANKS, max_rank=r, token_slots=meta.token_slots,
            token_rows=table_meta.token_table,
            xa=torch.zeros(64, slices * r, device=device), sync=fold_counters(device=device)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups", default=",".join(GROUPS))
    p.add_argument("--adapters", default="32", help="comma-separated adapter counts")
    p.add_argument("--tilings", nargs="*", default=["16,128,4", "32,128,4", "16,64,8"],
                   help="block_n,block_k,stages of the fold")
    p.add_argument("--reps", type=int, default=100)
    args = p.parse_args()
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device, 1 << 30)
    x = torch.randn(64, max(k for k, _ in GROUPS.values()), device=device, dtype=torch.bfloat16)
    pdl, tma = DEFAULT_TUNING.pdl_on(x), DEFAULT_TUNING.gemm_tma_on(x)
    print(f"{torch.cuda.get_device_name(device)}, copy bandwidth {bandwidth / 1e12:.2f} TB/s, "
          f"TMA {tma}, PDL {pdl}")
    print(f"{'group':8} {'tiling':>11} {'what':>14} {'us':>8} {'floor us':>9}")
    for group in args.groups.split(","):
        k, outs = GROUPS[group]
        n = sum(outs)
        xs = x[:, :k].contiguous()
        ws = [(torch.randn(n, k, device=device, dtype=torch.bfloat16) / 32).t() for _ in range(COPIES)]
        w_bytes = n * k * 2
        for tiling in args.tilings:
            block_n, block_k, stages = (int(v) for v in tiling.split(","))
            gemm = decode_gemm_tma if tma else decode_gemm_triton
            plain = time_us(lambda i: gemm(xs, ws[i], pdl=False, block_n=block_n, block_k=block_k,
                                           num_stages=stages), args.reps)
            print(f"{group:8} {tiling:>11} {'plain':>14} {plain:8.2f} {w_bytes / bandwidth * 1e6:9.2f}")
            for adapters in [0, *map(int, args.adapters.split(","))]:
                fs = folds(k, outs, adapters, device)
                us = time_us(lambda i: decode_gemm_lora_triton(
                    xs, ws[i], fs[i], tma=tma, pdl=False, block_n=block_n, block_k=block_k,
                    num_stages=stages), args.reps)
                lora_bytes = adapters * 16 * (len(outs) * k + n) * 2
                print(f"{group:8} {tiling:>11} {f'fold {adapters}':>14} {us:8.2f} "
                      f"{(w_bytes + lora_bytes) / bandwidth * 1e6:9.2f}")


if __name__ == "__main__":
    main()
