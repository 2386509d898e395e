"""Greedy sampling's argmax over a batch of logits rows."""
from .dispatch import first_argmax
from .reference import first_argmax_ref

__all__ = ["first_argmax", "first_argmax_ref"]
