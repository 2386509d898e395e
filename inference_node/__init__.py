"""Inference node: a Llama-family model with paged KV, continuous batching and multi-LoRA."""
