"""The projections' matmuls: the Triton decode GEMM at decode batch sizes (its LoRA folded into
the same launch where the step plan asks), cuBLAS elsewhere."""
from .dispatch import DecodeGemm, cublas, decode_gemm_lora
from .fold import GemmLora, gemm_lora_fits, reference_gemm_lora
from .shapes import MAX_ROWS, tiling, tma_fits

__all__ = ["DecodeGemm", "GemmLora", "MAX_ROWS", "cublas", "decode_gemm_lora", "gemm_lora_fits",
           "reference_gemm_lora", "tiling", "tma_fits"]
