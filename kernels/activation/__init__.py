"""SwiGLU's SiLU(gate) * up, with the gate/up LoRA delta expanded in."""
from .dispatch import silu_mul_lora
from .reference import silu_mul

__all__ = ["silu_mul", "silu_mul_lora"]
