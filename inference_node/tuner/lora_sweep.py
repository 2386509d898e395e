"""The LoRA shrink and expand launches' tilings (kernels/lora/triton_kernel.py LoraTiling) on
decode-shaped steps, for a model's shapes: the fastest per case against the serving default
(`choose_tiling`) and the bytes' floor. These tilings are not Tuning choices yet (the node
takes choose_tiling's), so this prints and writes no table: it is where choose_tiling's
defaults come from, and the measure of a LoRA step against its adapters' read.

The decode step of a CUDA graph hands the kernels segments sized for the whole batch, one per
distinct adapter; how rows, H_in and the outputs are tiled decides whether a launch is bound
by bytes or by latency. Each (group, distinct adapters) case times the shrink and the expand
(replayed from a CUDA graph, GPU time per launch) for every tiling of the grid.

    python -m inference_node.tuner.lora_sweep --model DIR                 # batch 64, rank 16
    python -m inference_node.tuner.lora_sweep --model DIR --adapters 1,32 --groups gate_up
"""
from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch

from kernels.tuning import GROUPS
from kernels.tuning_table import ModelShape

from .sweep import slice_widths
from .trial import copy_bandwidth


def graph_meta(batch: int, distinct: int, bucket: int, device: torch.device, rank: int,
               table: bool = True):
    """As DecodeGraphs._fill_lora builds it: request i on adapter i mod distinct, padded
    buckets; with `table`, rows grouped by slot and the segment table the graphs fill (a rank
    and a first arena row per slice: slot s holds rows s*rank ..), else the gather layout
    (rows interleaved, sorted ids)."""
    from kernels.lora.meta import LoraBatchMeta

    slots = [i % distinct for i in range(batch)]
    if not table:
        return LoraBatchMeta.build(slots, device).padded_for_graph(bucket, batch)
    meta = LoraBatchMeta.build(sorted(slots), device)
    return meta.with_segment_table([[rank, s * rank] * 3 for s in range(distinct)]
                                   ).padded_for_graph(bucket, batch)


def main(argv: list[str] | None = None) -> None:
    import triton.testing

    from inference_node.model.config import ModelConfig
    from kernels.lora.rows import SlotRows
    from kernels.lora.triton_kernel import LoraTiling, choose_tiling, lora_expand_triton, lora_shrink_partials

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, type=Path, help="a checkpoint folder: only its config.json is read")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--adapters", default="1,8,32,64")
    p.add_argument("--groups", default=",".join(GROUPS))
    p.add_argument("--top", type=int, default=3)
    p.add_argument("--kinds", default="shrink,expand")
    p.add_argument("--no-sweep", action="store_true", help="only the default tiling, both layouts")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the LoRA tiling sweep times CUDA graphs: it needs a CUDA device")

    device, dtype = torch.device("cuda"), torch.bfloat16
    shape = ModelShape.of(ModelConfig.from_checkpoint(args.model))
    bw = copy_bandwidth(device)
    print(f"{torch.cuda.get_device_name(device)}; {shape.key}; copy bandwidth {bw / 1e9:.0f} GB/s; batch "
          f"{args.batch}, rank {args.rank}")

    def time_us(fn) -> float:
        """GPU time per launch, replayed from a CUDA graph as in serving (no host overhead)."""
        return triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median") * 1e3

    shrink_grid = [LoraTiling(16, seg, block_k=k, block_n=128, programs_per_sm=ps, shrink_warps=w)
                   for seg, k, ps, w in itertools.product((True, False), (64, 128, 256), (2, 4, 8), (2, 4))]
    expand_grid = [LoraTiling(16, seg, block_k=128, block_n=n, expand_warps=w, n_span=span)
                   for seg, n, w, span in itertools.product((True, False), (64, 128, 256, 512), (4, 8),
                                                            (0, 256, 1024, 2048, 4096))
                   if span == 0 or span >= n]
    kinds = set(args.kinds.split(","))
    R = args.rank
    for group in args.groups.split(","):
        h_in, outs = shape.gemms()[group][1], slice_widths(shape, group)
        for distinct in (int(a) for a in args.adapters.split(",")):
            bucket = 1 << (distinct - 1).bit_length()
            meta = graph_meta(args.batch, distinct, bucket, device, args.rank)
            gather_meta = graph_meta(args.batch, distinct, bucket, device, args.rank, table=False)
            col = 3  # kernels.lora.meta.SEGMENT_TABLE_RANKS: the first slice's rank
            x = torch.randn(args.batch, h_in, device=device, dtype=dtype)
            # Arenas of rank rows (kernels/lora/rows.py): slot s holds rows s*R .. s*R + R - 1.
            a = [torch.randn(distinct * R, h_in, device=device, dtype=dtype) * 0.02 for _ in outs]
            offsets = [sum(outs[:i]) for i in range(len(outs))]
            b_all = torch.randn(distinct * R, sum(outs), device=device, dtype=dtype) * 0.02
            b = [b_all[:, off:off + o] for off, o in zip(offsets, outs)]
            y = torch.zeros(args.batch, sum(outs), device=device, dtype=dtype)
            scaling = torch.ones(distinct, device=device)
            ranks = SlotRows.shared(torch.full((distinct,), R, dtype=torch.int32, device=device),
                                    torch.arange(0, distinct * R, R, dtype=torch.int32, device=device),
                                    len(outs), R)
            a_bytes = distinct * len(outs) * R * h_in * 2
            b_bytes = distinct * sum(outs) * R * 2
            default = choose_tiling(meta, R, max(outs), len(outs), device)

            def shrink(t, m=meta):
                c = col if m is meta else None
                return lambda: lora_shrink_partials(x, a, m, scaling, ranks, zero=False, tiling=t,
                                                    rank_col=c)

            h = shrink(default)()

            def expand(t, h=h, m=meta):
                c = col if m is meta else None
                return lambda: lora_expand_triton(h, b, m, y, offsets, ranks, tiling=t, rank_col=c)

            for kind, grid, make, nbytes in (("shrink", shrink_grid, shrink, a_bytes),
                                             ("expand", expand_grid, expand, b_bytes)):
                if kind not in kinds:
                    continue
                base_us = time_us(make(default))
                gather_us = time_us(make(default, m=gather_meta))
                floor_us = nbytes / bw * 1e6
                print(f"{group:8s} {distinct:3d} adapters {kind}: default {base_us:6.1f} us "
                      f"(gather layout {gather_us:6.1f} us), floor {floor_us:5.1f} us; {default}")
                if args.no_sweep:
                    continue
                timed = sorted(((time_us(make(t)), t) for t in grid), key=lambda pair: pair[0])
                print(f"      best {timed[0][0]:6.1f} us")
                for us, t in timed[:args.top]:
                    print(f"      {us:6.1f} us  per_segment={t.per_segment} block_k={t.block_k} "
                          f"block_n={t.block_n} n_span={t.n_span} per_sm={t.programs_per_sm} "
                          f"warps={t.shrink_warps if kind == 'shrink' else t.expand_warps}")


if __name__ == "__main__":
    main()
