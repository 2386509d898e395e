"""FP8 checkpoints as Hugging Face's fine-grained FP8 and compressed-tensors write them, made
from a plain tiny checkpoint, and the oracle's twin of each: the same FP8 values dequantized
to float32 in a plain checkpoint that transformers + PEFT load as any other.

The quantizing and dequantizing here are written out tile by tile, apart from the node's own
(kernels/gemm/fp8_weight.py), so a node that scaled, fused or sharded wrongly answers
differently from the oracle."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# The decoder projections' weights as checkpoints name them (Phi-3's fused ones included).
PROJECTION = re.compile(r".*\.(q|k|v|o|gate|up|down|qkv|gate_up)_proj\.weight$")


def quantize_tiles(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 [N, K], float32 scales [ceil(N/bn), ceil(K/bk)]): each tile over its own amax."""
    w = w.float()
    n, k = w.shape
    bn, bk = block
    rows, cols = -(-n // bn), -(-k // bk)
    q = torch.empty(n, k, dtype=FP8)
    scale = torch.empty(rows, cols)
    for i in range(rows):
        for j in range(cols):
            tile = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
            scale[i, j] = tile.abs().max().clamp(min=1e-12) / FP8_MAX
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (tile / scale[i, j]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 [N, K], float32 scales [N]): each output channel over its own amax."""
    w = w.float()
    scale = torch.stack([row.abs().max().clamp(min=1e-12) / FP8_MAX for row in w])
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 [N, K], float32 scale [1]): one scale for the whole matrix."""
    w = w.float()
    scale = (w.abs().max().clamp(min=1e-12) / FP8_MAX).reshape(1)
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """float32 [N, K]: every fp8 value times the scale of its tile, row or tensor."""
    w = q.float()
    if block is None:
        return w * (scale.reshape(-1, 1) if scale.numel() > 1 else scale.reshape(()))
    bn, bk = block
    out = torch.empty_like(w)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] * scale[i, j]
    return out


def write_fp8_checkpoint(plain: Path, out: Path, scheme: str, block: tuple[int, int] | None = None) -> Path:
    """plain's checkpoint with every decoder projection in FP8. scheme "fp8": Hugging Face's
    fine-grained format (weight_scale_inv per `block` tile); "channel" / "tensor":
    compressed-tensors' float-quantized format (weight_scale [N, 1] / [1])."""
    tensors = load_file(str(plain / "model.safetensors"))
    written: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if not PROJECTION.match(name):
            written[name] = t
        elif scheme == "fp8":
            written[name], written[name + "_scale_inv"] = quantize_tiles(t, block)
        elif scheme == "channel":
            q, scale = quantize_rows(t)
            written[name], written[name.removesuffix("weight") + "weight_scale"] = q, scale[:, None].contiguous()
        else:
            written[name], written[name.removesuffix("weight") + "weight_scale"] = quantize_tensor(t)
    out.mkdir(parents=True)
    save_file(written, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((plain / "config.json").read_text())
    config["quantization_config"] = (
        {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(block),
         "modules_to_not_convert": ["lm_head"]} if scheme == "fp8" else
        {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
         "ignore": ["lm_head"], "kv_cache_scheme": None,
         "config_groups": {"group_0": {
             "targets": ["Linear"], "format": "float-quantized",
             "weights": {"num_bits": 8, "type": "float", "strategy": scheme, "symmetric": True, "dynamic": False},
             "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                                   "dynamic": True}}}})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _copy_rest(plain, out)
    return out


def write_dequantized_twin(fp8_checkpoint: Path, out: Path) -> Path:
    """The FP8 checkpoint's weights dequantized to float32, as a plain checkpoint."""
    config = json.loads((fp8_checkpoint / "config.json").read_text())
    qc = config.pop("quantization_config")
    block = tuple(qc["weight_block_size"]) if qc["quant_method"] == "fp8" else None
    suffix = "_scale_inv" if qc["quant_method"] == "fp8" else "_scale"
    tensors = load_file(str(fp8_checkpoint / "model.safetensors"))
    plain = {name: (dequantize(t, tensors[name + suffix], block) if t.dtype == FP8 else t)
             for name, t in tensors.items() if not name.endswith(suffix)}
    out.mkdir(parents=True)
    save_file(plain, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _copy_rest(fp8_checkpoint, out)
    return out


def write_quantized_twin(plain: Path, out: Path) -> Path:
    """What `--quantization fp8` serves of `plain` (each projection per output channel),
    dequantized to float32 as a plain checkpoint."""
    tensors = load_file(str(plain / "model.safetensors"))
    twin = {name: dequantize(*quantize_rows(t), None) if PROJECTION.match(name) else t for name, t in tensors.items()}
    out.mkdir(parents=True)
    save_file(twin, str(out / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(plain / "config.json", out / "config.json")
    _copy_rest(plain, out)
    return out


def _copy_rest(src: Path, out: Path) -> None:
    for f in src.iterdir():
        if f.is_file() and not (out / f.name).exists() and f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
