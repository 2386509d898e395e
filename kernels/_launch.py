"""Launching our Triton kernels without the JIT's per-call dispatch, once compiled.

Steps that do not replay a CUDA graph (prefill and mixed prefill + decode steps) launch a
few hundred Triton kernels, and there the host sets the pace: on an H100 host `fn[grid](...)`
costs 12 us with one argument and 36 us with 24 (bench/prefill_profile.py and
docs/PERFORMANCE.md), most of it binding and specialising each argument. Once a kernel is
compiled for a specialization, its compiled binary can be launched directly.

The cache key here is a superset of what Triton specialises on (each tensor's dtype and
16-byte alignment; each integer's 16-divisibility, equality to 1 and width; bools by value;
the constexprs and launch options as given; the current device), so a launch whose arguments
Triton would compile differently misses and goes through the JIT, which compiles it. Under
Triton's interpreter, or when the JIT returns no compiled kernel, every call takes the JIT.
LORA_FAST_LAUNCH=0 turns the fast path off.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch

_INT32 = 1 << 31


def _arg_key(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.data_ptr() % 16 == 0)
    if isinstance(value, bool):
        return ("b", value)
    if isinstance(value, int):
        return ("i", value % 16 == 0, value == 1, -_INT32 <= value < _INT32)
    if isinstance(value, float):
        return ("f",)
    if value is None:
        return ("n",)
    raise TypeError  # anything else: the JIT path


def _enabled() -> bool:
    if os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes"):
        return False
    return os.environ.get("LORA_FAST_LAUNCH", "1") != "0"


class FastLaunch:
    """kernel[grid](*args, **kwargs) as for the JIT function it wraps: the JIT compiles and
    launches a specialization the first time; later launches with the same key call the
    compiled kernel directly. Non-constexpr parameters go positionally, constexprs and launch
    options (num_warps, num_stages) by keyword, as our wrappers call them."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        # (Under Triton's interpreter the decorated function has no params: never fast.)
        self._names = [p.name for p in getattr(fn, "params", ())]
        self._cache: dict[tuple, Any] = {}

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def _launch(self, grid: tuple[int, ...], args: tuple, kwargs: dict[str, Any]) -> None:
        if not self._names or not _enabled():
            self.fn[grid](*args, **kwargs)
            return
        try:
            if any(isinstance(v, torch.Tensor) for v in kwargs.values()):
                raise TypeError
            key = (torch.cuda.current_device(), tuple(sorted(kwargs.items())),
                   tuple(_arg_key(a) for a in args))
        except TypeError:  # an argument (or keyword) the key cannot hold
            self.fn[grid](*args, **kwargs)
            return
        compiled = self._cache.get(key)
        if compiled is None:
            compiled = self.fn[grid](*args, **kwargs)
            if compiled is not None and hasattr(compiled, "__getitem__"):
                self._cache[key] = compiled
            return
        try:
            full = [*args, *(kwargs[name] for name in self._names[len(args):])]
        except KeyError:  # a parameter left to its default: the JIT fills it in
            self.fn[grid](*args, **kwargs)
            return
        compiled[_grid3(grid)](*full)


def _grid3(grid: tuple[int, ...]) -> tuple[int, int, int]:
    return (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)


def fast_launch(fn: Any) -> FastLaunch:
    return FastLaunch(fn)
