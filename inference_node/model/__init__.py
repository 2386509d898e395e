"""The model: an own Llama-family forward over HF safetensors checkpoints with paged KV."""
