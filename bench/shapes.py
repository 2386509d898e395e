"""The benchmarks' model shapes as Hugging Face config dicts (no torch: client processes
import them too)."""
from __future__ import annotations

# Llama-3.2-1B's shapes (weights random: nothing is downloaded).
LLAMA_3_2_1B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048,
    "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 64, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
    "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16"}

# Llama-3.1-8B's shapes with SmolLM2's vocabulary (49,152), weights made on the device
# (`load_format="dummy"`): 16 GB need not be written and read back.
LLAMA_3_1_8B = {
    **LLAMA_3_2_1B, "vocab_size": 49152, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}

# Llama-3.1-70B's shapes, as the 8B's (vocabulary 49,152, weights made on the devices); one
# GPU cannot hold it: a node splits it (--tensor-parallel-size), a sweep tunes one shard.
LLAMA_3_1_70B = {
    **LLAMA_3_1_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128}

# A small model of the same family, for CPU runs of a real node (with a real tokenizer).
TINY_LLAMA = {**LLAMA_3_2_1B, "vocab_size": 49152, "hidden_size": 64, "intermediate_size": 160,
              "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "max_position_embeddings": 1024, "rope_scaling": None, "rope_theta": 10000.0,
              "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}

# The served families' shapes: each model's real widths, heads, layers and quirks, with
# SmolLM2's vocabulary (49,152) as the 8B's (so every token id detokenizes through the
# embedded tokenizer), weights made on the device (`load_format="dummy"`).
_FAMILY_COMMON = {"vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
                  "tie_word_embeddings": False}
QWEN2_5_7B = {  # q/k/v biases
    **_FAMILY_COMMON, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
    "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
    "head_dim": 128, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "use_sliding_window": False, "sliding_window": 131072, "max_window_layers": 28, "hidden_act": "silu"}
QWEN3_8B = {  # per-head q/k norms
    **_FAMILY_COMMON, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
    "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "attention_bias": False, "use_sliding_window": False, "hidden_act": "silu"}
MISTRAL_7B = {  # v0.1: a 4,096-token window on every layer
    **_FAMILY_COMMON, "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "sliding_window": 4096, "hidden_act": "silu"}
GEMMA_2_9B = {  # soft-caps, windowed and full layers alternating, head_dim 256, tied embeddings
    **_FAMILY_COMMON, "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 3584,
    "intermediate_size": 14336, "num_hidden_layers": 42, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
    "sliding_window": 4096, "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True}
PHI_3_MINI = {  # fused q/k/v and gate/up, a 2,047-token window on every layer
    **_FAMILY_COMMON, "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 3072,
    "intermediate_size": 8192, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
    "max_position_embeddings": 4096, "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "sliding_window": 2047, "hidden_act": "silu"}
QWEN3_30B_A3B = {  # 128 experts of 768, 8 routed per token, q/k norms, every layer routed
    **_FAMILY_COMMON, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "attention_bias": False, "use_sliding_window": False,
    "hidden_act": "silu", "vocab_size": 151936}
MIXTRAL_8X7B = {  # 8 experts of 14,336, 2 routed per token, every layer routed, no window
    **_FAMILY_COMMON, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
    "intermediate_size": 14336, "num_local_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "sliding_window": None, "hidden_act": "silu"}
FAMILY_SHAPES = {"qwen2.5-7b": QWEN2_5_7B, "qwen3-8b": QWEN3_8B, "mistral-7b": MISTRAL_7B,
                 "gemma2-9b": GEMMA_2_9B, "phi3-mini": PHI_3_MINI}
# Mixture-of-experts shapes (their adapters' MLP LoRA is on the experts: see bench/serving.py).
MOE_SHAPES = {"qwen3-30b-a3b": QWEN3_30B_A3B, "mixtral-8x7b": MIXTRAL_8X7B}
