"""Per-step LoRA: which kernels add each scheduled token's adapter delta (plan.py)."""
