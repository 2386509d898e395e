"""The model: an own forward of the served families (families.py: Llama, Mistral, Qwen2/2.5,
Qwen3, Phi-3, Gemma 2 and 3) over HF safetensors checkpoints with paged KV."""
