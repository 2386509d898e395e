"""Mixture-of-experts routing and routed experts (reference.py; the fused grouped GEMMs of
triton_kernel.py)."""
from .dispatch import routed_experts
from .reference import ExpertDelta, PairLora, experts_reference, pair_lora_hook, pair_lora_reference, route

__all__ = ["ExpertDelta", "PairLora", "experts_reference", "pair_lora_hook", "pair_lora_reference", "route",
           "routed_experts"]
