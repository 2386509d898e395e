"""Adapters on the node: weights in host memory, GPU slots, tiers, reference counts."""
