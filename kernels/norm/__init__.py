"""RMSNorm, and the residual add before it with a projection's LoRA delta expanded in."""
from .dispatch import add_rms_norm_lora
from .reference import add_rms_norm, rms_norm

__all__ = ["add_rms_norm", "add_rms_norm_lora", "rms_norm"]
