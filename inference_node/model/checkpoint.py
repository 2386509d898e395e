"""Reads a Hugging Face safetensors checkpoint directory (never pickle)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open


class CheckpointError(ValueError):
    """The directory is not a usable safetensors checkpoint."""


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickles = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt")]
        hint = f" (found pickle files {pickles}, which are never loaded)" if pickles else ""
        raise CheckpointError(f"no .safetensors weights in {path}{hint}")
    return files


def iter_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, tensor) for every tensor of the checkpoint, on CPU."""
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def validate_checkpoint_dir(path: Path) -> None:
    if not path.is_dir():
        raise CheckpointError(f"model path {path} is not a directory")
    for needed in ("config.json", "tokenizer.json"):
        if not (path / needed).exists():
            raise CheckpointError(f"{path} has no {needed}")
    safetensors_files(path)
