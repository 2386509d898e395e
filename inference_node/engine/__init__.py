"""The engine: one loop thread that owns all model state and runs continuous batching."""
