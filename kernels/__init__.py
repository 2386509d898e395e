"""Kernels of the inference node's forward pass, one package per operation:

    lora/        batched multi-LoRA shrink and expand, per-step metadata, unexpanded deltas
    gemm/        the projections' matmuls: the Triton decode GEMM (LoRA folded in), cuBLAS
    attention/   paged attention over the KV cache
    rope/        RoPE with the KV-cache write (and the q/k/v LoRA delta)
    norm/        the residual add + RMSNorm (and the o/down LoRA delta)
    allreduce/   a decode-sized tensor-parallel sum with the add + norm after it (CUDA only:
                 no dispatch, its peers are other GPUs)
    activation/  SiLU(gate) * up (and the gate/up LoRA delta)
    embedding/   the token embedding lookup
    sampling/    greedy argmax

Each package holds its dispatch (dispatch.py, what the package exports), its PyTorch
reference (reference.py: the CPU path and the test oracle, same interface) and its Triton
kernel (triton_kernel.py: CUDA, and Triton's interpreter in tests) side by side. dispatch.py
here picks between the two; tuning.py holds every launch choice (Tuning), passed in by the
caller; host.py sizes launches on the host.
"""
