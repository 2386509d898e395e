"""The engine core: the process that owns the GPU state (engine loop, scheduler, KV cache,
adapter tiers) and talks to the front ends only through inference_node.core.protocol."""
