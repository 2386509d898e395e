"""Kernel benchmark: LoRA shrink/expand and paged attention, Triton next to the PyTorch reference.

For every shape it prints the kernel's time, the bytes it must move at least, the achieved
bandwidth and that bandwidth as a share of the device's copy bandwidth, measured in the same
run with a large device-to-device copy (the practical ceiling for these memory-bound kernels).

    python -m bench.kernels_bench            # CUDA: Llama-3.2-1B-like shapes
    python -m bench.kernels_bench --quick    # fewer shapes (and on CPU: tiny ones, reference only)

On a machine without CUDA it runs tiny shapes with the reference only (add TRITON_INTERPRET=1
to also run the kernels in Triton's interpreter: slow, times meaningless).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from bench.common import copy_bandwidth
from bench.common import time_call as bench
from kernels.attention.reference import paged_attention_ref
from kernels.host import interpreting
from kernels.lora.meta import LoraBatchMeta
from kernels.lora.reference import lora_expand_ref, lora_shrink_ref
from kernels.lora.rows import SlotRows


@dataclass
class Model:
    hidden: int = 2048
    q: int = 2048
    kv: int = 512
    inter: int = 8192
    rank: int = 16
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 64
    page: int = 16
    max_loras: int = 32


TINY = Model(hidden=128, q=128, kv=32, inter=256, rank=8, num_heads=4, num_kv_heads=2,
             head_dim=32, page=16, max_loras=8)


class Table:
    """Triton time, its bandwidth and share of the copy bandwidth, then the same for the
    reference, and how many times faster the kernel is."""

    HEAD = (f"{'kernel':<12} {'shape':<26} {'MB':>9} {'triton us':>10} {'GB/s':>8} {'%copy':>7}"
            f" {'ref us':>10} {'GB/s':>8} {'%copy':>7} {'speedup':>8}")

    def __init__(self, copy_bw: float) -> None:
        self.copy_bw = copy_bw
        print(self.HEAD)
        print("-" * len(self.HEAD))

    def _cells(self, t: float | None, nbytes: int) -> str:
        if t is None:
            return f"{'-':>10} {'-':>8} {'-':>7}"
        bw = nbytes / t
        return f"{t * 1e6:10.1f} {bw / 1e9:8.1f} {100 * bw / self.copy_bw:6.1f}%"

    def row(self, kernel: str, shape: str, t: float | None, nbytes: int,
            t_ref: float | None) -> None:
        speedup = f"{t_ref / t:7.2f}x" if (t and t_ref) else f"{'-':>8}"
        print(f"{kernel:<12} {shape:<26} {nbytes / 1e6:9.2f} {self._cells(t, nbytes)} "
              f"{self._cells(t_ref, nbytes)} {speedup}", flush=True)


def lora_rows(table: Table, m: Model, device: torch.device, dtype: torch.dtype,
              use_triton: bool, quick: bool) -> None:
    if use_triton:
        from kernels.lora.triton_kernel import lora_expand_triton, lora_shrink_triton
    es = torch.finfo(dtype).bits // 8
    groups = {"qkv": (m.hidden, [m.q, m.kv, m.kv]), "gate_up": (m.hidden, [m.inter, m.inter])}
    decode_T = [1, 8, 64, 256] if quick else [1, 8, 32, 64, 128, 256]
    shapes = [(T, n) for T in decode_T for n in (1, 8, 32) if n <= T and n <= m.max_loras]
    shapes += [(2048, 4)] if quick else [(2048, 4), (2048, 16)]
    if device.type != "cuda":
        shapes = [(T, n) for T, n in shapes if T <= 64][:4] + [(256, 2)]
    S, R = m.max_loras, m.rank
    for group, (h_in, outs) in groups.items():
        # Arenas of rank rows (kernels/lora/rows.py), each slot's run of R rows after the last.
        a = [torch.randn(S * R, h_in, device=device, dtype=dtype) * 0.02 for _ in outs]
        b_all = torch.randn(S * R, sum(outs), device=device, dtype=dtype) * 0.02
        b = [b_all[:, sum(outs[:i]):sum(outs[:i + 1])] for i in range(len(outs))]
        slot_rows = SlotRows.shared(torch.full((S,), R, dtype=torch.int32, device=device),
                                    torch.arange(0, S * R, R, dtype=torch.int32, device=device),
                                    len(outs), R)
        scaling = torch.full((S,), 2.0, device=device)
        offsets = [sum(outs[:i]) for i in range(len(outs))]
        width = sum(outs)
        for T, n_adapters in shapes:
            slots = [(t * n_adapters) // T for t in range(T)]  # contiguous runs, like requests
            meta = LoraBatchMeta.build(slots, device)
            x = torch.randn(T, h_in, device=device, dtype=dtype)
            y = torch.randn(T, width, device=device, dtype=dtype)
            shape = f"{group} T={T} a={n_adapters}"
            shrink_bytes = (T * h_in + n_adapters * len(outs) * R * h_in) * es + len(outs) * T * R * 4
            expand_bytes = len(outs) * T * R * 4 + n_adapters * width * R * es + 2 * T * width * es
            h = lora_shrink_ref(x, a, meta, scaling, slot_rows)
            t_ref = bench(lambda: lora_shrink_ref(x, a, meta, scaling, slot_rows), device)
            t = (bench(lambda: lora_shrink_triton(x, a, meta, scaling, slot_rows), device)
                 if use_triton else None)
            table.row("lora_shrink", shape, t, shrink_bytes, t_ref)
            t_ref = bench(lambda: lora_expand_ref(h, b, meta, y, offsets, slot_rows), device)
            t = (bench(lambda: lora_expand_triton(h, b, meta, y, offsets, slot_rows), device)
                 if use_triton else None)
            table.row("lora_expand", shape, t, expand_bytes, t_ref)


def attention_rows(table: Table, m: Model, device: torch.device, dtype: torch.dtype,
                   use_triton: bool, quick: bool) -> None:
    if use_triton:
        from kernels.attention.triton_kernel import paged_attention_triton
    es = torch.finfo(dtype).bits // 8
    batches = [1, 8, 64, 256] if quick else [1, 8, 32, 64, 128, 256]
    contexts = [512, 4096] if quick else [512, 1024, 2048, 4096]
    if device.type != "cuda":
        batches, contexts = [1, 4], [64, 256]
    max_blocks = max(contexts) // m.page
    num_blocks = max(batches) * max_blocks
    k_cache = torch.randn(num_blocks, m.page, m.num_kv_heads, m.head_dim, device=device,
                          dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    block_tables = torch.randperm(num_blocks, device=device).reshape(max(batches), max_blocks)
    block_tables = block_tables.to(torch.int32)
    scale = m.head_dim ** -0.5
    for B in batches:
        for ctx in contexts:
            q = torch.randn(B, m.num_heads, m.head_dim, device=device, dtype=dtype)
            args = (q, k_cache, v_cache, block_tables[:B].contiguous(),
                    torch.arange(B + 1, device=device, dtype=torch.int32),
                    torch.full((B,), ctx, device=device, dtype=torch.int32), scale, 1, ctx)
            nbytes = (2 * B * ctx * m.num_kv_heads * m.head_dim + 2 * B * m.num_heads
                      * m.head_dim) * es + B * (ctx // m.page) * 4
            # The reference materialises fp32 copies of every head's keys: skip the huge ones.
            ref_bytes = 2 * B * ctx * m.num_heads * m.head_dim * 4
            t_ref = bench(lambda: paged_attention_ref(*args), device) if ref_bytes < 8e9 else None
            t = bench(lambda: paged_attention_triton(*args), device) if use_triton else None
            table.row("paged_attn", f"decode B={B} ctx={ctx}", t, nbytes, t_ref)
    # One mixed prefill + decode step.
    if device.type == "cuda":
        q_lens = [2048] + [1] * 63
        ctx = [2048] + [1024] * 63
        T = sum(q_lens)
        q = torch.randn(T, m.num_heads, m.head_dim, device=device, dtype=dtype)
        qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32,
                           device=device)
        args = (q, k_cache, v_cache, block_tables[:64].contiguous(), qsl,
                torch.tensor(ctx, dtype=torch.int32, device=device), scale, 2048, 2048)
        nbytes = (2 * sum(ctx) * m.num_kv_heads * m.head_dim + 2 * T * m.num_heads
                  * m.head_dim) * es
        t_ref = bench(lambda: paged_attention_ref(*args), device)
        t = bench(lambda: paged_attention_triton(*args), device) if use_triton else None
        table.row("paged_attn", "prefill 2048 + 63 decode", t, nbytes, t_ref)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument("--only", choices=["lora", "attention"], help="one kernel family")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    use_triton = cuda or interpreting()
    model = Model() if cuda else TINY
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)

    name = torch.cuda.get_device_name(device) if cuda else "CPU"
    bw = copy_bandwidth(device, (1 << 30) if cuda else (64 << 20))
    print(f"device: {name}  torch {torch.__version__}  dtype {dtype}  "
          f"copy bandwidth (D2D, read+write): {bw / 1e9:.1f} GB/s")
    if not cuda:
        print("no CUDA: tiny shapes" + (", Triton in the interpreter (times meaningless)"
                                         if use_triton else ", reference only"))
    print(f"model: {model}")
    table = Table(bw)
    with torch.inference_mode():
        if args.only in (None, "lora"):
            lora_rows(table, model, device, dtype, use_triton, args.quick)
        if args.only in (None, "attention"):
            attention_rows(table, model, device, dtype, use_triton, args.quick)


if __name__ == "__main__":
    main()
