"""Which implementation runs an op: its Triton kernel on CUDA tensors (and on CPU tensors
under Triton's interpreter, TRITON_INTERPRET=1, as the kernel tests run them), its PyTorch
reference elsewhere or where Triton is not installed.

Every op's dispatcher (kernels/<op>/dispatch.py) asks `triton_kernel` for its Triton function
and runs the reference when it gets None. The Triton module is imported on first use, so a
CPU node without Triton never imports it.
"""
from __future__ import annotations

import importlib
import importlib.util
from functools import lru_cache
from types import ModuleType
from typing import Any, Callable

import torch

from .host import interpreting


def use_triton(t: torch.Tensor) -> bool:
    """Whether Triton runs kernels on t: CUDA, or Triton's interpreter."""
    return t.is_cuda or interpreting()


@lru_cache(maxsize=None)
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


_modules: dict[str, ModuleType] = {}


def triton_kernel(t: torch.Tensor, module: str, name: str) -> Callable[..., Any] | None:
    """Function `name` of the Triton module `module` (absolute, e.g. "kernels.norm.
    triton_kernel") where Triton runs t and is installed; None: the caller runs its
    reference."""
    if not (use_triton(t) and triton_installed()):
        return None
    mod = _modules.get(module)
    if mod is None:
        mod = _modules[module] = importlib.import_module(module)
    return getattr(mod, name)
