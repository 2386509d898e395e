"""The benchmarks' model shapes as Hugging Face config dicts (no torch: client processes
import them too)."""
from __future__ import annotations

# Llama-3.2-1B's shapes (weights random: nothing is downloaded).
LLAMA_3_2_1B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
    "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False,
    "hidden_act": "silu", "bos_token_id": 128000, "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
}

# Llama-3.1-8B's shapes with SmolLM2's vocabulary (49,152), weights made on the device
# (`load_format="dummy"`): 16 GB need not be written and read back.
LLAMA_3_1_8B = {
    **LLAMA_3_2_1B, "vocab_size": 49152, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
}

# Llama-3.1-70B's shapes, as the 8B's (vocabulary 49,152, weights made on the devices); one
# GPU cannot hold it: a node splits it (--tensor-parallel-size), a sweep tunes one shard.
LLAMA_3_1_70B = {
    **LLAMA_3_1_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
}

# A small model of the same family, for CPU runs of a real node (with a real tokenizer).
TINY_LLAMA = {**LLAMA_3_2_1B, "vocab_size": 49152, "hidden_size": 64, "intermediate_size": 160,
              "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "max_position_embeddings": 1024, "rope_scaling": None,
              "rope_theta": 10000.0, "tie_word_embeddings": False, "bos_token_id": 1,
              "eos_token_id": 2, "torch_dtype": "float32"}
