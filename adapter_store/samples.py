"""Synthetic PEFT LoRA adapters (numpy only) for tests, benchmarks and demos.

The files match what PEFT's save_pretrained(safe_serialization=True) writes for a
Llama-family model: adapter_config.json and adapter_model.safetensors with tensors named
base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import numpy as np
from safetensors.numpy import save_file

from lora_common.validation import MODULE_PARENT


def module_dims(module: str, hidden: int, intermediate: int, kv_dim: int) -> tuple[int, int]:
    """(in_features, out_features) of a Llama projection."""
    return {"q_proj": (hidden, hidden), "k_proj": (hidden, kv_dim), "v_proj": (hidden, kv_dim),
            "o_proj": (hidden, hidden), "gate_proj": (hidden, intermediate), "up_proj": (hidden, intermediate),
            "down_proj": (intermediate, hidden)}[module]


def lora_tensors(rank: int, layers: int, targets: Sequence[str], hidden: int, intermediate: int, kv_dim: int,
                 dtype: str = "float32", seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(layers):
        for module in targets:
            fan_in, fan_out = module_dims(module, hidden, intermediate, kv_dim)
            base = f"base_model.model.model.layers.{layer}.{MODULE_PARENT[module]}.{module}"
            tensors[f"{base}.lora_A.weight"] = (rng.standard_normal((rank, fan_in)) * 0.02).astype(dtype)
            tensors[f"{base}.lora_B.weight"] = (rng.standard_normal((fan_out, rank)) * 0.02).astype(dtype)
    return tensors


def adapter_config(rank: int, targets: Sequence[str] | str, alpha: float | None = None, use_rslora: bool = False,
                   base_model: str = "HuggingFaceTB/SmolLM2-135M", **extra: object) -> dict:
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank,
              "lora_alpha": alpha if alpha is not None else 2 * rank, "lora_dropout": 0.0,
              "use_rslora": use_rslora,
              "target_modules": targets if isinstance(targets, str) else list(targets),
              "base_model_name_or_path": base_model,
              "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "use_dora": False,
              "rank_pattern": {}, "alpha_pattern": {}, "modules_to_save": None}
    config.update(extra)
    return config


def write_adapter(folder: str | Path, rank: int = 8, layers: int = 2,
                  targets: Sequence[str] = ("q_proj", "v_proj"), hidden: int = 64, intermediate: int = 160,
                  kv_dim: int = 32, dtype: str = "float32", seed: int = 0,
                  config_overrides: dict | None = None) -> Path:
    """Writes a random adapter folder and returns it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = adapter_config(rank, targets, **(config_overrides or {}))
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
    save_file(lora_tensors(rank, layers, targets, hidden, intermediate, kv_dim, dtype, seed),
              str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    return folder


def sized_adapter(folder: str | Path, megabytes: float, rank: int = 64, seed: int = 0) -> Path:
    """An adapter of about `megabytes` MB (float32, all seven projections, hidden 2048)."""
    hidden, intermediate, kv_dim = 2048, 8192, 512
    targets = tuple(MODULE_PARENT)
    per_layer = sum(rank * sum(module_dims(m, hidden, intermediate, kv_dim)) * 4 for m in targets)
    layers = max(1, round(megabytes * 1e6 / per_layer))
    return write_adapter(folder, rank, layers, targets, hidden, intermediate, kv_dim, seed=seed)
