"""Causal attention of a step's new tokens over a paged KV cache (mixed prefill and decode)."""
from .dispatch import paged_attention
from .reference import paged_attention_ref

__all__ = ["paged_attention", "paged_attention_ref"]
