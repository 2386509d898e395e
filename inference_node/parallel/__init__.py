"""Tensor parallelism: one node over several devices (Megatron layout, LoRA sharded to match)."""
