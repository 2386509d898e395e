"""bench/common.py's CompileWatch counts what JIT-compiles inside a region: a new torch.compile graph,
and each Triton compile its post-compile hook reports."""
from __future__ import annotations

import torch

from bench.common import CompileWatch


def test_a_new_torch_compile_graph_is_counted_once() -> None:
    watch = CompileWatch().install()
    fn = torch.compile(lambda x: x * 2 + 1, backend="eager")
    mark = watch.mark()
    fn(torch.ones(3))
    assert watch.since(mark) == ["torch.compile graph"]
    again = watch.mark()
    fn(torch.ones(3))  # same shapes: the graph is reused
    assert watch.since(again) == []


def test_triton_compiles_reported_by_its_hook_are_listed_by_name() -> None:
    from triton import knobs

    previous = knobs.runtime.jit_post_compile_hook
    seen: list[str] = []
    knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append(kw["repr"])
    try:
        watch = CompileWatch().install()
        mark = watch.mark()
        knobs.runtime.jit_post_compile_hook(repr="_lora_shrink_kernel[num_warps=2](ROWS: i32)")
        assert watch.since(mark) == ["_lora_shrink_kernel[num_warps=2](ROWS: i32)"]
        assert seen == ["_lora_shrink_kernel[num_warps=2](ROWS: i32)"]  # the earlier hook still runs
        assert watch.install() is watch and watch.since(watch.mark()) == []
    finally:
        knobs.runtime.jit_post_compile_hook = previous
