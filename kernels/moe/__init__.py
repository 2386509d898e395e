"""Mixture-of-experts routing and routed experts (reference.py; the fused grouped GEMMs of
triton_kernel.py)."""
from .dispatch import routed_experts
from .reference import ExpertDelta, experts_reference, route

__all__ = ["ExpertDelta", "experts_reference", "route", "routed_experts"]
