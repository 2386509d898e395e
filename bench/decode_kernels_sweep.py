"""The base model's decode-step kernels one at a time, each against its bytes' floor, with the
alternatives that could replace it.

serving_bench.py says how far row a's step is from its floor and decode_profile.py which
kernel families fill it; this script times each kind of launch on its own, replayed from a
CUDA graph over as many copies of its weights (or KV cache) as it takes to overflow L2, as in
a real step where every layer reads its own:

- the projections' GEMMs at decode batch: cuBLAS as the model calls it (F.linear on [N, K]
  weights), cuBLAS on pre-transposed [K, N] weights, and a plain Triton GEMM over a few
  tilings (best shown);
- paged attention at batch 64 over the serving benchmark's contexts, across tilings;
- RoPE + KV-cache write: the fused kernel against the compiled RoPE plus two index_copy_;
- the ops that expand a LoRA delta (RoPE + KV write, residual add + norm, SiLU * up) with
  rows spread over N adapters, across their tilings, against their B bytes' floor (the add +
  norm also with each row spread over programs of 128-1024 columns: `split=`).

    python -m bench.decode_kernels_sweep.py                 # CUDA, Llama-3.2-1B shapes, batch 64
    python -m bench.decode_kernels_sweep.py --parts gemm    # one part
    python -m bench.decode_kernels_sweep.py --parts pdl     # the decode GEMM after its norm, PDL on/off
    python -m bench.decode_kernels_sweep.py --parts warps   # its tilings with 8 warps, deeper pipelines
    python -m bench.decode_kernels_sweep.py --parts argmax  # greedy sampling's argmax, its tilings
    python -m bench.decode_kernels_sweep.py --parts attention --attention-heads 32,8,128   # 8B's heads
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
from typing import Callable

import torch
import triton
import triton.language as tl

from bench.common import copy_bandwidth

GEMMS = {  # name: (N, K), Llama-3.2-1B
    "qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192),
    "lm_head": (128256, 2048)}
L2_OVERFLOW = 256 << 20  # bytes of distinct copies a timed graph walks through


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y = x @ w.T for a few rows: one program per BLOCK_N columns walks all of K."""
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, K, BLOCK_K):
        x = tl.load(x_ptrs, mask=offs_m[:, None] < M, other=0.0)
        w = tl.load(w_ptrs, mask=offs_n[:, None] < N, other=0.0)
        acc += tl.dot(x, tl.trans(w))
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def _kv_read_kernel(k_ptr, v_ptr, bt_ptr, seq_lens_ptr, out_ptr, stride_kb, stride_kp, stride_kh,
                    stride_btb, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    """Attention's reads alone: a program per (sequence, KV head), the same grid as the
    decode attention, streaming the sequence's keys and values through its block table; with
    a third grid axis of P programs, program p reads the p-th of P ranges of those keys."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    parts = tl.num_programs(2)
    length = tl.load(seq_lens_ptr + seq)
    share = tl.cdiv(tl.cdiv(length, parts), BLOCK_N) * BLOCK_N
    lo = tl.program_id(2) * share
    hi = tl.minimum(length, lo + share)
    offs_d = tl.arange(0, D)
    acc = tl.zeros((BLOCK_N, D), dtype=tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        live = offs < hi
        blk = tl.load(bt_ptr + seq * stride_btb + offs // PAGE, mask=live, other=0).to(tl.int64)
        off = blk * stride_kb + (offs % PAGE) * stride_kp + head * stride_kh
        k = tl.load(k_ptr + off[:, None] + offs_d[None, :], mask=live[:, None], other=0.0)
        v = tl.load(v_ptr + off[:, None] + offs_d[None, :], mask=live[:, None], other=0.0)
        acc += k.to(tl.float32) + v.to(tl.float32)
    tl.atomic_add(out_ptr + (seq * tl.num_programs(1) + head) * D + offs_d, tl.sum(acc, 0))


def triton_gemm(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, block_n: int, block_k: int,
                stages: int, warps: int) -> None:
    M, K = x.shape
    N = w.shape[0]
    _gemm_kernel[(triton.cdiv(N, block_n),)](
        x, w, y, M, N, K, x.stride(0), w.stride(0), y.stride(0),
        BLOCK_M=max(16, triton.next_power_of_2(M)), BLOCK_N=block_n, BLOCK_K=block_k,
        num_stages=stages, num_warps=warps)


def graph_us(calls: list[Callable[[], object]], rounds: int = 20) -> float:
    """GPU microseconds per call: the calls captured back to back in one CUDA graph, replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:  # warm-up: compiles outside the capture
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    times.sort()
    return times[len(times) // 2]


def copies_for(nbytes: int) -> int:
    return max(2, math.ceil(L2_OVERFLOW / max(nbytes, 1)))


def gemm_part(batch: int, bw: float, device: torch.device) -> None:
    print(f"\n== GEMMs at batch {batch} (bf16), us per launch; floor = weight bytes / copy bandwidth")
    print(f"{'proj':8} {'N':>7} {'K':>5} {'MB':>7} {'floor':>7} {'cuBLAS':>8} {'cuBLAS Wt':>10} "
          f"{'Triton best':>12}  tiling (block_n, block_k, stages, warps)")
    tilings = list(itertools.product((16, 32, 64, 128), ((128, 4), (256, 3), (64, 8)), (4,)))
    for name, (N, K) in GEMMS.items():
        nbytes = N * K * 2
        n = copies_for(nbytes)
        ws = [torch.randn(N, K, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(n)]
        x = torch.randn(batch, K, device=device, dtype=torch.bfloat16)
        y = torch.empty(batch, N, device=device, dtype=torch.bfloat16)
        ref = torch.nn.functional.linear(x, ws[0])
        cublas = graph_us([lambda w=w: torch.nn.functional.linear(x, w) for w in ws])
        wts = [w.t().contiguous() for w in ws]
        cublas_t = graph_us([lambda w=w: torch.mm(x, w, out=y) for w in wts])
        del wts
        best = (float("inf"), None)
        for block_n, (block_k, stages), warps in tilings:
            if K % block_k:
                continue
            try:
                us = graph_us([lambda w=w, t=(block_n, block_k, stages, warps): triton_gemm(x, w, y, *t)
                               for w in ws], rounds=10)
            except Exception as exc:  # a tiling the compiler refuses (shared memory)
                print(f"   {(block_n, block_k, stages, warps)}: {type(exc).__name__}")
                continue
            if us < best[0]:
                best = (us, (block_n, block_k, stages, warps))
        triton_gemm(x, ws[0], y, *best[1])
        err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
        floor = nbytes / bw * 1e6
        print(f"{name:8} {N:7d} {K:5d} {nbytes / 1e6:7.1f} {floor:7.2f} {cublas:8.2f} {cublas_t:10.2f} "
              f"{best[0]:12.2f}  {best[1]}  (rel err {err:.1e})")
        del ws
        torch.cuda.empty_cache()


def attention_part(batch: int, bw: float, device: torch.device,
                   heads: tuple[int, int, int] = (32, 8, 64)) -> None:
    """Both KV layouts (token-major [blocks, page, Hkv, D]; head-major, stored [blocks, Hkv,
    page, D] and seen through transposed views as KVCache keeps it), default and a few tilings;
    heads: (query heads, KV heads, head dim)."""
    from kernels.attention.triton_kernel import paged_attention_triton_impl

    (Hq, Hkv, D), page = heads, 16
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(32 + 64, 256 + 64, (batch,), generator=gen)  # prompt + half the output
    max_blocks = math.ceil(int(lens.max()) / page)
    kv_bytes = int(lens.sum()) * Hkv * D * 2 * 2
    n = copies_for(batch * max_blocks * page * Hkv * D * 2 * 2)
    tables = torch.randperm(batch * max_blocks, generator=gen).view(batch, max_blocks).to(device, torch.int32)
    q = torch.randn(batch, Hq, D, device=device, dtype=torch.bfloat16)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
    seq_lens = lens.to(device, torch.int32)
    max_seq = 4096  # the decode graphs size the kernel for the longest context allowed
    floor = kv_bytes / bw * 1e6
    print(f"\n== paged attention, {Hq} query heads, {Hkv} KV heads of {D}, batch {batch}, contexts {int(lens.min())}-{int(lens.max())} "
          f"(mean {lens.float().mean():.0f}), {kv_bytes / 1e6:.1f} MB of KV: floor {floor:.2f} us")

    def run(k, v, **knobs):
        return paged_attention_triton_impl(q, k, v, tables, qsl, seq_lens, D ** -0.5, 1, max_seq, **knobs)

    outputs = {}
    for layout in ("token-major", "head-major"):
        caches = []
        for _ in range(n):
            if layout == "token-major":
                k = torch.randn(batch * max_blocks, page, Hkv, D, device=device, dtype=torch.bfloat16)
                v = torch.randn_like(k)
            else:
                k = torch.randn(batch * max_blocks, Hkv, page, D, device=device, dtype=torch.bfloat16).transpose(1, 2)
                v = torch.randn_like(k.transpose(1, 2)).transpose(1, 2)
            caches.append((k, v))
        gen_k = torch.Generator(device=device).manual_seed(1)
        for k, v in caches[:1]:  # same values in both layouts for the output check
            k.copy_(torch.randn(k.shape, generator=gen_k, device=device, dtype=torch.bfloat16))
            v.copy_(torch.randn(v.shape, generator=gen_k, device=device, dtype=torch.bfloat16))
        outputs[layout] = run(*caches[0])
        default = graph_us([lambda c=c: run(*c) for c in caches])
        results = []
        for block_n, warps, stages in itertools.product((32, 64, 128, 256), (2, 4, 8), (1, 2, 3)):
            knobs = dict(block_n=block_n, num_warps=warps, num_stages=stages)
            try:
                us = graph_us([lambda c=c, k=knobs: run(*c, **k) for c in caches], rounds=10)
            except Exception as exc:  # a tiling the compiler refuses (shared memory)
                print(f"   {knobs}: {type(exc).__name__}")
                continue
            results.append((us, knobs))
        results.sort(key=lambda r: r[0])
        print(f"  {layout}: default {default:.2f} us; best " +
              "; ".join(f"{us:.2f} us {knobs}" for us, knobs in results[:3]))
        for us, knobs in results:
            print(f"     {us:6.2f} us  {knobs}")
        # Contexts differ up to 3x within the batch: split into more programs (each writing
        # partials, then one merge launch), the longest sequences no longer end the launch alone.
        splits = [(graph_us([lambda c=c, s=s: run(*c, num_splits=s) for c in caches], rounds=10), s)
                  for s in (1, 2, 3, 4, 6)]
        print("  key splits (default tiling, merge launch included): " +
              "; ".join(f"{s}: {us:.2f} us" for us, s in splits))
        # The same keys in all, every sequence at the mean length: what the spread of
        # lengths costs (programs of one launch finishing at different times).
        even = torch.full_like(seq_lens, int(lens.float().mean().round()))
        even_us = graph_us([lambda c=c: paged_attention_triton_impl(
            q, *c, tables, qsl, even, D ** -0.5, 1, max_seq) for c in caches], rounds=10)
        print(f"  every context at the mean length: {even_us:.2f} us")
        if layout == "head-major":  # how far attention is from only reading its KV
            sink = torch.empty(batch * Hkv * D, device=device)
            reads = []
            for block_n, warps in itertools.product((64, 128, 256), (4, 8)):
                reads.append((graph_us([lambda c=c: _kv_read_kernel[(batch, Hkv)](
                    c[0], c[1], tables, seq_lens, sink, c[0].stride(0), c[0].stride(1),
                    c[0].stride(2), tables.stride(0), PAGE=page, BLOCK_N=block_n, D=D,
                    num_warps=warps) for c in caches], rounds=10), block_n, warps))
            us, block_n, warps = min(reads)
            print(f"  only reading the same KV with the same grid: {us:.2f} us "
                  f"({block_n} keys a tile, {warps} warps; best of {len(reads)})")
            # The same reads spread over 2-4x the programs, each a range of a sequence's keys:
            # whether more programs in flight (flash-decoding's splits, without their merge)
            # would read faster.
            for parts in (2, 4):
                finer = graph_us([lambda c=c: _kv_read_kernel[(batch, Hkv, parts)](
                    c[0], c[1], tables, seq_lens, sink, c[0].stride(0), c[0].stride(1),
                    c[0].stride(2), tables.stride(0), PAGE=page, BLOCK_N=block_n, D=D,
                    num_warps=warps) for c in caches], rounds=10)
                print(f"  only reading it with {parts} programs a sequence's KV head: {finer:.2f} us")
        del caches
    same = torch.equal(outputs["token-major"], outputs["head-major"])
    print(f"  outputs of the two layouts on the same values: {'identical' if same else 'DIFFER'}")


def rope_part(batch: int, device: torch.device) -> None:
    from kernels.rope.reference import rotate_half_rope
    from kernels.rope.triton_kernel import rope_and_cache_triton

    Hq, Hkv, D, page = 32, 8, 64, 16
    width = (Hq + 2 * Hkv) * D
    n = 16  # one per layer
    qkvs = [torch.randn(batch, width, device=device, dtype=torch.bfloat16) for _ in range(n)]
    caches = [(torch.zeros(batch * 20, page, Hkv, D, device=device, dtype=torch.bfloat16),
               torch.zeros(batch * 20, page, Hkv, D, device=device, dtype=torch.bfloat16)) for _ in range(n)]
    emb = torch.randn(4096, D, device=device)
    cos, sin = emb.cos(), emb.sin()
    pos = torch.randint(0, 300, (batch,), device=device)
    slots = torch.randperm(batch * 20 * page, device=device)[:batch]

    def rope_qk(q, k, positions):
        c, s = cos[positions][:, None, :], sin[positions][:, None, :]
        return rotate_half_rope(q, c, s), rotate_half_rope(k, c, s)

    compiled = torch.compile(rope_qk, dynamic=True, fullgraph=True)

    def old(qkv, kc, vc):
        q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
        q, k = compiled(q.view(-1, Hq, D), k.view(-1, Hkv, D), pos)
        kc.view(-1, Hkv, D).index_copy_(0, slots, k)
        vc.view(-1, Hkv, D).index_copy_(0, slots, v.view(-1, Hkv, D))
        return q

    t_old = graph_us([lambda i=i: old(qkvs[i], *caches[i]) for i in range(n)])
    t_new = graph_us([lambda i=i: rope_and_cache_triton(qkvs[i], None, cos, sin, pos, slots, *caches[i], Hq, Hkv, D)
                      for i in range(n)])
    print(f"\n== RoPE + KV write, batch {batch}, us per layer: compiled RoPE + 2 index_copy_ {t_old:.2f}; "
          f"fused kernel {t_new:.2f} (with a LoRA delta: --parts fused)")


SPLIT_COLUMNS = (128, 256, 512, 1024)  # columns a program of the add + norm split over columns


def fused_part(batch: int, bw: float, device: torch.device, adapters: list[int]) -> None:
    """The ops that expand a LoRA delta (kernels/lora/delta.py) at rank 16 with batch rows
    spread over N adapters, against the same op without LoRA and against the floor of the B
    bytes they read, over the tilings each one takes."""
    from kernels.lora.delta import ColumnSplit, LoraDelta
    from kernels.norm.triton_kernel import add_rms_norm_triton
    from kernels.rope.triton_kernel import rope_and_cache_triton
    from kernels.activation.triton_kernel import silu_mul_triton

    H, I, Hq, Hkv, D, R, page, splits = 2048, 8192, 32, 8, 64, 16, 16, 4
    bf16 = dict(device=device, dtype=torch.bfloat16)
    for n in adapters:
        b_bytes = {"norm": n * H * R * 2, "silu": n * 2 * I * R * 2, "rope": n * (Hq + 2 * Hkv) * D * R * 2}
        copies = copies_for(b_bytes["silu"])
        S = n * copies
        # Arenas of rank rows (kernels/lora/rows.py): slot s holds rows s*R .. s*R + R - 1.
        b = {"o": torch.randn(S * R, H, **bf16) * 0.02, "g": torch.randn(S * R, I, **bf16) * 0.02,
             "u": torch.randn(S * R, I, **bf16) * 0.02, "q": torch.randn(S * R, Hq * D, **bf16) * 0.02,
             "k": torch.randn(S * R, Hkv * D, **bf16) * 0.02, "v": torch.randn(S * R, Hkv * D, **bf16) * 0.02}
        partials = torch.randn(splits, 3, batch, R, device=device) * 0.1
        # Each row's (rank, first row) on each of three slices, rows grouped by adapter.
        slot_rows = [torch.tensor([[R, (c * n + i % n) * R] * 3 for i in sorted(range(batch), key=lambda i: i % n)],
                                  dtype=torch.int32, device=device) for c in range(copies)]
        hidden = torch.randn(batch, H, **bf16)
        out = torch.randn(batch, H, **bf16)
        w = torch.ones(H, **bf16)
        gate_up = torch.randn(batch, 2 * I, **bf16)
        qkv = torch.randn(batch, (Hq + 2 * Hkv) * D, **bf16)
        kc, vc = (torch.zeros(batch * 20, page, Hkv, D, **bf16) for _ in range(2))
        emb = torch.randn(4096, D, device=device)
        cos, sin = emb.cos(), emb.sin()
        pos = torch.randint(0, 300, (batch,), device=device)
        kv_slots = torch.randperm(batch * 20 * page, device=device)[:batch]
        # The add + norm over programs of `split` columns a row (kernels/norm_triton.py).
        column_splits = {c: ColumnSplit.allocate(c, batch, H, device) for c in SPLIT_COLUMNS}

        def norm(d, split: int = 0, **k):
            if split and d is not None:
                d = dataclasses.replace(d, column_split=column_splits[split])
            return add_rms_norm_triton(hidden, out, w, 1e-5, d, **k)

        runs = {
            "norm": (norm, lambda sl: LoraDelta(partials[:, :1], (b["o"],), sl[:, :2]),
                     [dict(block_h=bh, num_warps=nw) for bh in (256, 512, 1024, 2048) for nw in (4, 8)]
                     + [dict(split=c, num_warps=nw) for c in SPLIT_COLUMNS for nw in (2, 4, 8)]),
            "silu": (lambda d, **k: silu_mul_triton(gate_up, d, **k),
                     lambda sl: LoraDelta(partials[:, :2], (b["g"], b["u"]), sl[:, :4]),
                     [dict(block_i=bi, num_warps=nw) for bi in (64, 128, 256, 512, 1024) for nw in (2, 4, 8)]),
            "rope": (lambda d, **k: rope_and_cache_triton(qkv, d, cos, sin, pos, kv_slots, kc, vc, Hq, Hkv, D, **k),
                     lambda sl: LoraDelta(partials, (b["q"], b["k"], b["v"]), sl),
                     [dict(num_warps=nw) for nw in (1, 2, 4, 8)])}
        print(f"\n== LoRA-expanding ops, batch {batch}, {n} adapters of rank {R} ({copies} copies of "
              f"their B walked through), us per call")
        for name, (op, make, knobs) in runs.items():
            base = graph_us([lambda: op(None)] * copies)
            deltas = [make(sl) for sl in slot_rows]
            timed = sorted(((graph_us([lambda d=d, k=k: op(d, **k) for d in deltas], rounds=10), k)
                            for k in knobs), key=lambda timing: timing[0])  # ties: knob order
            floor = b_bytes[name] / bw * 1e6
            best = ", ".join(f"{us:.2f} {k}" for us, k in timed[:3])
            default = graph_us([lambda d=d: op(d) for d in deltas])
            print(f"   {name:5s} without LoRA {base:6.2f}; with: default {default:6.2f}, best {best}; "
                  f"B bytes' floor {floor:.2f}")


def pdl_part(batch: int, bw: float, device: torch.device) -> None:
    """The decode GEMM (kernels/decode_gemm_triton.py) after the kernel before it in a layer,
    as the step runs them: pairs (add + norm, projection) back to back in one graph, each
    pair on its own weights. Plain launches (cuBLAS on [K, N]; the Triton GEMM over tilings)
    against the Triton GEMM launched with programmatic dependent launch, asking L2 for its
    first PREFETCH_K columns before it waits for the norm."""
    from kernels.gemm.triton_kernel import decode_gemm_triton
    from kernels.norm.triton_kernel import add_rms_norm_triton

    print(f"\n== decode GEMM after an add + norm at batch {batch}: us per (norm, GEMM) pair; "
          "floor = weight bytes / copy bandwidth")
    tilings = list(itertools.product((16, 32), (128, 256), (3, 4, 6)))
    for name in ("qkv", "o", "down", "gate_up"):
        N, K = GEMMS[name]
        nbytes = N * K * 2
        n = copies_for(nbytes)
        w_out_in = [torch.randn(N, K, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(n)]
        w_views = [w.t() for w in w_out_in]            # [K, N] views of [N, K]: the GEMM's layout
        hidden = torch.randn(batch, K, device=device, dtype=torch.bfloat16)
        out = torch.randn(batch, K, device=device, dtype=torch.bfloat16)
        norm_w = torch.ones(K, device=device, dtype=torch.bfloat16)

        def pairs(gemm):
            def pair(w):
                _, x = add_rms_norm_triton(hidden, out, norm_w, 1e-5)
                gemm(x, w)
            return pair

        norm_alone = graph_us([lambda: add_rms_norm_triton(hidden, out, norm_w, 1e-5)] * n)
        results = []
        w_kn = [w.t().contiguous() for w in w_out_in[: max(2, n // 2)]]
        results.append(("cuBLAS [K,N]", graph_us([lambda w=w: pairs(torch.mm)(w) for w in w_kn])))
        del w_kn
        best = (float("inf"), None)
        for block_n, block_k, stages in tilings:
            if K % block_k or N % block_n:
                continue
            cfg = dict(block_n=block_n, block_k=block_k, num_stages=stages)
            try:
                us = graph_us([lambda w=w, c=cfg: pairs(lambda x, ww: decode_gemm_triton(x, ww, **c))(w)
                               for w in w_views], rounds=10)
            except Exception as exc:  # a tiling the compiler refuses (shared memory)
                print(f"   {cfg}: {type(exc).__name__}")
                continue
            best = min(best, (us, tuple(cfg.items())), key=lambda b: b[0])
        cfg = dict(best[1])
        results.append((f"Triton {cfg['block_n']}x{cfg['block_k']}/{cfg['num_stages']}", best[0]))
        for prefetch in (0, 512, 1024, 2048, K):
            if prefetch > K or (prefetch == K and K <= 2048):
                continue
            c = dict(cfg, pdl=True, prefetch_k=prefetch)
            results.append((f"PDL pf{prefetch}", graph_us(
                [lambda w=w: pairs(lambda x, ww: decode_gemm_triton(x, ww, **c))(w) for w in w_views])))
        x = torch.randn(batch, K, device=device, dtype=torch.bfloat16)
        ref = torch.mm(x, w_views[0])
        y = decode_gemm_triton(x, w_views[0], **c)
        err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
        floor = nbytes / bw * 1e6
        print(f"{name:8} N {N} K {K}: floor {floor:.2f}, norm alone {norm_alone:.2f}; "
              + ", ".join(f"{label} {us:.2f}" for label, us in results) + f" (rel err {err:.1e})")
        del w_out_in, w_views
        torch.cuda.empty_cache()


PDL_TILINGS = {  # (block_n, block_k, stages, warps) per projection; the first is the default
    "qkv": [(32, 256, 4, 4), (32, 256, 4, 8), (32, 128, 6, 8), (64, 128, 4, 8), (32, 512, 2, 8),
            (16, 256, 4, 8), (16, 512, 3, 4)],
    "o": [(16, 256, 4, 4), (16, 256, 4, 8), (16, 128, 6, 8), (16, 512, 3, 8), (32, 256, 4, 8),
          (16, 512, 2, 4)],
    "down": [(16, 256, 4, 4), (16, 256, 4, 8), (16, 128, 6, 8), (16, 512, 3, 8), (32, 256, 4, 8),
             (16, 512, 2, 4), (32, 128, 6, 8)],
    "gate_up": [(32, 128, 4, 4), (32, 128, 4, 8), (32, 256, 3, 8), (64, 128, 4, 8), (32, 128, 6, 8),
                (64, 64, 6, 4), (128, 64, 4, 8)],
}


class NormGemmPairs:
    """One projection's inputs for timing (add + norm, decode GEMM) pairs as the step runs
    them: enough weight copies that the graph streams them from memory, not L2."""

    def __init__(self, name: str, batch: int, device: torch.device) -> None:
        self.N, self.K = GEMMS[name]
        self.nbytes = self.N * self.K * 2
        self.w_views = [(torch.randn(self.N, self.K, device=device, dtype=torch.bfloat16) * 0.02).t()
                        for _ in range(copies_for(self.nbytes))]
        self.hidden = torch.randn(batch, self.K, device=device, dtype=torch.bfloat16)
        self.out = torch.randn(batch, self.K, device=device, dtype=torch.bfloat16)
        self.norm_w = torch.ones(self.K, device=device, dtype=torch.bfloat16)

    def time(self, gemm: Callable[..., object], cfg: dict) -> float:
        """GPU us per pair, gemm(x, w, **cfg) after the norm that writes x."""
        from kernels.norm.triton_kernel import add_rms_norm_triton

        def pair(w):
            _, x = add_rms_norm_triton(self.hidden, self.out, self.norm_w, 1e-5)
            gemm(x, w, **cfg)
        return graph_us([lambda w=w: pair(w) for w in self.w_views])


def warps_part(batch: int, bw: float, device: torch.device, prefetch_k: int = 512) -> None:
    """The PDL-launched decode GEMM after its add + norm (as in the step) over tilings that
    include 8 warps and deeper pipelines: more loads in flight per SM for the weight stream."""
    from kernels.gemm.triton_kernel import decode_gemm_triton

    print(f"\n== decode GEMM tilings after an add + norm at batch {batch}, PDL, {prefetch_k} columns "
          "prefetched: us per (norm, GEMM) pair (block_n x block_k / stages, warps)")
    for name in ("qkv", "o", "down", "gate_up"):
        pairs = NormGemmPairs(name, batch, device)
        results = []
        for block_n, block_k, stages, warps in PDL_TILINGS[name]:
            cfg = dict(block_n=block_n, block_k=block_k, num_stages=stages, num_warps=warps,
                       pdl=True, prefetch_k=prefetch_k)
            try:
                results.append((f"{block_n}x{block_k}/{stages} w{warps}",
                                pairs.time(decode_gemm_triton, cfg)))
            except Exception as exc:  # a tiling the compiler refuses (shared memory)
                print(f"   {block_n}x{block_k}/{stages} w{warps}: {type(exc).__name__}")
        print(f"{name:8} N {pairs.N} K {pairs.K}: floor {pairs.nbytes / bw * 1e6:.2f}; "
              + ", ".join(f"{label} {us:.2f}" for label, us in sorted(results, key=lambda r: r[1])))
        del pairs
        torch.cuda.empty_cache()


TMA_TILINGS = {  # (block_n, block_k, stages, warps)
    "qkv": [(32, 256, 4, 4), (32, 128, 4, 4), (32, 128, 6, 4), (64, 128, 4, 4), (32, 64, 8, 4)],
    "o": [(16, 256, 4, 4), (16, 128, 6, 4), (16, 128, 8, 4), (32, 128, 4, 4), (16, 64, 8, 4)],
    "down": [(16, 256, 4, 4), (16, 128, 6, 4), (16, 128, 8, 4), (32, 128, 4, 4), (16, 64, 8, 4),
             (32, 256, 3, 4)],
    "gate_up": [(32, 128, 4, 4), (32, 128, 6, 4), (64, 128, 4, 4), (64, 64, 6, 4), (128, 64, 4, 4)],
}


def tma_part(batch: int, bw: float, device: torch.device, prefetch_k: int = 512) -> None:
    """The decode GEMM with TMA tile loads against the pointer-load one (its default tiling),
    both PDL-launched after an add + norm (pairs back to back in a graph, own weights)."""
    from kernels.tuning import DEFAULT_TUNING
    from kernels.gemm.triton_kernel import decode_gemm_tma, decode_gemm_triton

    print(f"\n== decode GEMM, TMA tile loads, after an add + norm at batch {batch}, PDL: us per pair")
    for name in ("qkv", "o", "down", "gate_up"):
        pairs = NormGemmPairs(name, batch, device)
        x = torch.randn(batch, pairs.K, device=device, dtype=torch.bfloat16)
        ref = x.float() @ pairs.w_views[0].float()
        bn, bk, st = DEFAULT_TUNING.gemm_tilings[name]
        variants = [("pointer loads", decode_gemm_triton, dict(block_n=bn, block_k=bk, num_stages=st))]
        variants += [(f"TMA {b}x{k}/{s} w{wp}", decode_gemm_tma,
                      dict(block_n=b, block_k=k, num_stages=s, num_warps=wp))
                     for b, k, s, wp in TMA_TILINGS[name]]
        results = []
        for label, gemm, cfg in variants:
            cfg = dict(cfg, pdl=True, prefetch_k=prefetch_k)
            try:
                us = pairs.time(gemm, cfg)
                err = ((gemm(x, pairs.w_views[0], **cfg).float() - ref).norm() / ref.norm()).item()
                results.append((label, us, err))
            except Exception as exc:  # a tiling the compiler refuses (shared memory)
                print(f"   {label}: {type(exc).__name__}: {str(exc)[:200]}")
        print(f"{name:8} N {pairs.N} K {pairs.K}: floor {pairs.nbytes / bw * 1e6:.2f}; "
              + ", ".join(f"{lb} {us:.2f} (err {e:.0e})" for lb, us, e in sorted(results, key=lambda r: r[1])))
        del pairs
        torch.cuda.empty_cache()


def argmax_part(batch: int, bw: float, device: torch.device) -> None:
    """Greedy sampling's argmax over the LM head's logits (Llama-3.2-1B's vocabulary), the
    chunk pass across its tilings, against torch.argmax and the logits' bytes' floor. Timed on
    one logits tensor (the LM head has just written it: mostly in L2) and walked over four."""
    from kernels.sampling.triton_kernel import CHUNK_BLOCK, CHUNK_WARPS, chunks_for, first_argmax_triton

    vocab = GEMMS["lm_head"][0]
    logits = [torch.randn(batch, vocab, device=device, dtype=torch.bfloat16) for _ in range(4)]
    want = logits[0].argmax(-1)
    default = chunks_for(batch, vocab, device)
    floor = logits[0].numel() * logits[0].element_size() / bw * 1e6
    knobs = [dict(chunks=c, block=b, num_warps=w) for c in sorted({default, 9, 16, 24, 32, 48, 64})
             for b in (1024, 2048, 4096) for w in (4, 8)]
    for copies in (1, 4):
        torch_us = graph_us([lambda i=i: logits[i % copies].argmax(-1) for i in range(4)])
        results = []
        for k in knobs:
            assert torch.equal(first_argmax_triton(logits[0], **k), want), k
            results.append((graph_us([lambda i=i, k=k: first_argmax_triton(logits[i % copies], **k)
                                      for i in range(4)]), k))
        results.sort(key=lambda r: r[0])
        now = next(us for us, k in results if k == dict(chunks=default, block=CHUNK_BLOCK, num_warps=CHUNK_WARPS))
        print(f"argmax [{batch}, {vocab}] over {copies} logits tensor(s), us: floor {floor:.2f}, "
              f"torch {torch_us:.2f}, default ({default} chunks, {CHUNK_BLOCK}, {CHUNK_WARPS} warps) {now:.2f}; best "
              + ", ".join(f"{us:.2f} {k}" for us, k in results[:4]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--parts", default="rope,attention,gemm,fused")
    p.add_argument("--adapters", default="1,32", help="distinct adapters for --parts fused")
    p.add_argument("--attention-heads", default="32,8,64",
                   help="--parts attention: query heads, KV heads, head dim (Llama-3.2-1B; "
                        "Llama-3.1-8B 32,8,128; one Llama-3.1-70B rank at TP 4 16,2,128)")
    args = p.parse_args()
    heads = tuple(int(v) for v in args.attention_heads.split(","))
    if len(heads) != 3 or heads[0] % heads[1]:
        p.error(f"--attention-heads {args.attention_heads}: query heads, KV heads (dividing them), head dim")
    device = torch.device("cuda")
    bw = copy_bandwidth(device, 1 << 30)
    print(f"{torch.cuda.get_device_name(device)}; torch {torch.__version__}, triton {triton.__version__}; "
          f"copy bandwidth (read+write) {bw / 1e9:.0f} GB/s")
    parts = args.parts.split(",")
    if "rope" in parts:
        rope_part(args.batch, device)
    if "attention" in parts:
        attention_part(args.batch, bw, device, heads)
    if "gemm" in parts:
        gemm_part(args.batch, bw, device)
    if "pdl" in parts:
        pdl_part(args.batch, bw, device)
    if "warps" in parts:
        warps_part(args.batch, bw, device)
    if "tma" in parts:
        tma_part(args.batch, bw, device)
    if "argmax" in parts:
        argmax_part(args.batch, bw, device)
    if "fused" in parts:
        fused_part(args.batch, bw, device, [int(a) for a in args.adapters.split(",")])


if __name__ == "__main__":
    main()
