"""Rotary position embedding of queries and keys, with the keys and values written into the
paged KV cache (and the q/k/v LoRA delta expanded in), in one op."""
from .dispatch import rope_and_cache
from .reference import QKNorm, rope_and_cache_ref, rotate_half_rope

__all__ = ["QKNorm", "rope_and_cache", "rope_and_cache_ref", "rotate_half_rope"]
