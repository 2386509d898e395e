"""Kernels of the inference node: batched multi-LoRA shrink/expand, the decode ops that
expand a LoRA delta as they go (RoPE + KV-cache write, residual add + RMSNorm, SiLU * up)
and paged attention.

Each kernel has a plain PyTorch reference with the same interface: the reference is the
CPU path and the test oracle; the Triton version runs on CUDA (and in Triton's interpreter
in tests).
"""
