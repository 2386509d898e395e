"""Backend choice shared by the dispatchers: Triton on CUDA, the PyTorch reference elsewhere.

LORA_KERNELS=triton forces Triton (with TRITON_INTERPRET=1 it then runs on CPU tensors),
LORA_KERNELS=torch forces the reference, anything else (default "auto") picks by device.
"""
from __future__ import annotations

import os

import torch


def use_triton(t: torch.Tensor) -> bool:
    mode = os.environ.get("LORA_KERNELS", "auto")
    if mode == "torch":
        return False
    return mode == "triton" or t.is_cuda
