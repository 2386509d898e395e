"""The projections' matmuls: the Triton decode GEMM at decode batch sizes (its LoRA folded into
the same launch where the step plan asks), cuBLAS elsewhere; FP8 weights through fp8_matmul."""
from .dispatch import DecodeGemm, beside_lora, cublas, decode_gemm_lora
from .fold import GemmLora, counters_for, fold_counters, gemm_lora_fits, reference_gemm_lora
from .fp8 import fp8_matmul
from .fp8_weight import Fp8Weight, fp8_gated_silu_linear, fp8_linear, quantize_fp8
from .rope_out import RopeOut
from .shapes import MAX_ROWS, tiling, tma_fits

__all__ = ["DecodeGemm", "Fp8Weight", "beside_lora", "GemmLora", "MAX_ROWS", "RopeOut", "counters_for", "cublas",
           "decode_gemm_lora", "fold_counters", "fp8_gated_silu_linear", "fp8_linear", "fp8_matmul", "gemm_lora_fits",
           "quantize_fp8", "reference_gemm_lora", "tiling", "tma_fits"]
