"""The projections' matmuls: the Triton decode GEMM at decode batch sizes (its LoRA folded into
the same launch where the step plan asks), cuBLAS elsewhere."""
from .dispatch import DecodeGemm, cublas, decode_gemm_lora
from .fold import GemmLora, counters_for, fold_counters, gemm_lora_fits, reference_gemm_lora
from .rope_out import RopeOut
from .shapes import MAX_ROWS, tiling, tma_fits

__all__ = ["DecodeGemm", "GemmLora", "MAX_ROWS", "RopeOut", "counters_for", "cublas",
           "decode_gemm_lora", "fold_counters", "gemm_lora_fits", "reference_gemm_lora", "tiling",
           "tma_fits"]
