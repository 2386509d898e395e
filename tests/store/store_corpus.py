"""A corpus of bad adapters, each with the fragment its refusal reason must contain.

Each builder writes an adapter folder (files as they would sit under <prefix><name>/).
"""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Callable

import numpy as np
from safetensors.numpy import save_file

from adapter_store.samples import adapter_config, lora_tensors, write_adapter

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def raw_safetensors(header: dict, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def _good(folder: Path, **kw) -> Path:
    return write_adapter(folder, rank=4, layers=2, targets=("q_proj", "v_proj"), **kw)


def truncated(folder: Path) -> None:
    _good(folder)
    data = (folder / WEIGHTS).read_bytes()
    (folder / WEIGHTS).write_bytes(data[: len(data) // 2])


def header_longer_than_file(folder: Path) -> None:
    _good(folder)
    data = (folder / WEIGHTS).read_bytes()
    (folder / WEIGHTS).write_bytes(struct.pack("<Q", len(data) + 1000) + data[8:])


def header_over_limit(folder: Path) -> None:
    _good(folder)
    data = (folder / WEIGHTS).read_bytes()
    (folder / WEIGHTS).write_bytes(struct.pack("<Q", 1 << 40) + data[8:])


def header_not_json(folder: Path) -> None:
    _good(folder)
    data = bytearray((folder / WEIGHTS).read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    data[8:8 + n] = b"{not json" + b"!" * (n - 9)
    (folder / WEIGHTS).write_bytes(bytes(data))


def shapes_contradict_config(folder: Path) -> None:
    _good(folder)  # rank 4 weights
    config = adapter_config(8, ("q_proj", "v_proj"))
    (folder / CONFIG).write_text(json.dumps(config))


def weights_for_untargeted_module(folder: Path) -> None:
    _good(folder)
    (folder / CONFIG).write_text(json.dumps(adapter_config(4, ("q_proj",))))


def rank_mismatch(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tensors = lora_tensors(4, 1, ("q_proj",), 64, 160, 32)
    tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"] = np.zeros((64, 2), np.float32)
    save_file(tensors, str(folder / WEIGHTS))
    (folder / CONFIG).write_text(json.dumps(adapter_config(4, ("q_proj",))))


def nan_weights(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tensors = lora_tensors(4, 2, ("q_proj", "v_proj"), 64, 160, 32)
    tensors["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"][3, 1] = np.nan
    save_file(tensors, str(folder / WEIGHTS))
    (folder / CONFIG).write_text(json.dumps(adapter_config(4, ("q_proj", "v_proj"))))


def huge_finite_weights(folder: Path) -> None:
    """Finite, but x1e30: served, the logits would be NaN (issue 31's broken adapter)."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v * np.float32(1e30) for k, v in lora_tensors(4, 2, ("q_proj", "v_proj"), 64, 160, 32).items()}
    save_file(tensors, str(folder / WEIGHTS))
    (folder / CONFIG).write_text(json.dumps(adapter_config(4, ("q_proj", "v_proj"))))


def pickle_only(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG).write_text(json.dumps(adapter_config(4, ("q_proj",))))
    # The bytes a torch.save pickle starts with; it must never be read, let alone loaded.
    (folder / "adapter_model.bin").write_bytes(b"\x80\x02}q\x00(X\x06\x00\x00\x00cos.system" + b"\x00" * 64)


def missing_config(folder: Path) -> None:
    _good(folder)
    (folder / CONFIG).unlink()


def unknown_peft_type(folder: Path) -> None:
    _good(folder)
    config = adapter_config(4, ("q_proj", "v_proj"))
    config["peft_type"] = "IA3"
    (folder / CONFIG).write_text(json.dumps(config))


def dora(folder: Path) -> None:
    _good(folder, config_overrides={"use_dora": True})


def config_not_json(folder: Path) -> None:
    _good(folder)
    (folder / CONFIG).write_text("{'peft_type': 'LORA'")


def missing_lora_b(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tensors = lora_tensors(4, 1, ("q_proj",), 64, 160, 32)
    del tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    save_file(tensors, str(folder / WEIGHTS))
    (folder / CONFIG).write_text(json.dumps(adapter_config(4, ("q_proj",))))


def integer_weights(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.astype(np.int32) for k, v in lora_tensors(4, 1, ("q_proj",), 64, 160, 32).items()}
    save_file(tensors, str(folder / WEIGHTS))
    (folder / CONFIG).write_text(json.dumps(adapter_config(4, ("q_proj",))))


def overlapping_offsets(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    header = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":
              {"dtype": "F32", "shape": [4, 8], "data_offsets": [0, 128]},
              "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight":
              {"dtype": "F32", "shape": [8, 4], "data_offsets": [64, 192]}}
    (folder / WEIGHTS).write_bytes(raw_safetensors(header, b"\x00" * 192))
    (folder / CONFIG).write_text(json.dumps(adapter_config(4, ("q_proj",))))


# name -> (builder, fragment of the reason)
BAD_ADAPTERS: dict[str, tuple[Callable[[Path], None], str]] = {
    "truncated": (truncated, "truncated"),
    "header-longer-than-file": (header_longer_than_file, "larger than the file"),
    "header-over-limit": (header_over_limit, "exceeds the limit"),
    "header-not-json": (header_not_json, "header is not JSON"),
    "shapes-contradict-config": (shapes_contradict_config, "config says r=8"),
    "untargeted-module": (weights_for_untargeted_module, "does not target v_proj"),
    "rank-mismatch": (rank_mismatch, "rank mismatch between lora_A"),
    "nan-weights": (nan_weights, "NaN or Inf"),
    "huge-finite-weights": (huge_finite_weights, "above 1000 make the forward overflow"),
    "pickle-only": (pickle_only, "pickle"),
    "missing-config": (missing_config, "missing adapter_config.json"),
    "unknown-peft-type": (unknown_peft_type, "peft_type 'IA3' is not supported"),
    "dora": (dora, "DoRA"),
    "config-not-json": (config_not_json, "not valid JSON"),
    "missing-lora-b": (missing_lora_b, "no lora_B"),
    "integer-weights": (integer_weights, "dtype I32"),
    "overlapping-offsets": (overlapping_offsets, "overlap or hole"),
}
