"""The model runner: everything between a scheduled step and its sampled tokens (input
staging, decode and piecewise graphs, eager steps, warm-up, tensor-parallel mirroring, the
LoRA step plan)."""
