"""Token embedding lookup, reading the tokens a decode graph sampled on the device."""
from .dispatch import embed_tokens
from .reference import embed_tokens_ref

__all__ = ["embed_tokens", "embed_tokens_ref"]
