"""Reads a Hugging Face safetensors checkpoint directory (never pickle), or makes up its
weights (`--load-format dummy`: random weights of the shapes config.json names, generated on
the device; for benchmarks of models whose weights are not at hand, as vLLM's dummy format)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from .config import ModelConfig
from .families import UnsupportedModel

LOAD_FORMATS = ("safetensors", "dummy")


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


class SafetensorsTensors:
    """The checkpoint's tensors by name (without the "model." prefix), each read when popped,
    and only the rows or columns asked for: a tensor-parallel rank reads its own shard of a
    weight (safetensors slices), never the whole tensor."""

    def __init__(self, path: Path) -> None:
        self.files: dict[str, tuple[Path, str]] = {}
        for file in safetensors_files(path):
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    self.files[name.removeprefix("model.")] = (file, name)

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def discard(self, name: str) -> None:
        """Forget a tensor read in parts (never read whole); nothing where it was popped."""
        self.files.pop(name, None)

    def read(self, name: str) -> torch.Tensor:
        """A whole tensor, left in place (the scales of a fused tensor read in parts)."""
        file, stored = self.files[name]
        with safe_open(str(file), framework="pt", device="cpu") as f:
            return f.get_tensor(stored)

    def peek(self, name: str, rows: tuple[int, int]) -> torch.Tensor:
        """Rows [rows[0]:rows[1]] of a tensor, left in place (a fused tensor read in parts)."""
        file, stored = self.files[name]
        with safe_open(str(file), framework="pt", device="cpu") as f:
            return f.get_slice(stored)[rows[0]:rows[1]]

    def pop(self, name: str, rows: tuple[int, int] | None = None,
            cols: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor, or its [rows[0]:rows[1]] rows and/or [cols[0]:cols[1]] columns."""
        file, stored = self.files.pop(name)
        with safe_open(str(file), framework="pt", device="cpu") as f:
            if rows is None and cols is None:
                return f.get_tensor(stored)
            part = f.get_slice(stored)
            r = slice(*rows) if rows is not None else slice(None)
            if cols is None:
                return part[r]
            return part[r, slice(*cols)]


class DummyTensors:
    """The checkpoint's tensor names (loader.checkpoint_shapes), each made on first `pop`
    (random normal * std, norms `norm_value`), so no more than one tensor beyond the model's
    own is ever alive."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], device: torch.device, dtype: torch.dtype,
                 seed: int = 0, std: float = 0.02, norm_value: float = 1.0) -> None:
        self.device, self.dtype, self.std, self.norm_value = device, dtype, std, norm_value
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.shapes = dict(shapes)
        self._made: tuple[str, torch.Tensor] | None = None  # the tensor peek made last

    def __contains__(self, name: str) -> bool:
        return name in self.shapes

    def _make(self, name: str) -> torch.Tensor:
        if self._made is not None and self._made[0] == name:
            return self._made[1]
        shape = self.shapes[name]
        if name.endswith("norm.weight"):
            out = torch.full(shape, self.norm_value, dtype=self.dtype, device=self.device)
        else:
            out = torch.empty(shape, dtype=self.dtype, device=self.device)
            out.normal_(0.0, self.std, generator=self.generator)
        self._made = (name, out)
        return out

    def discard(self, name: str) -> None:
        self.shapes.pop(name, None)
        self._made = None

    def read(self, name: str) -> torch.Tensor:
        """A whole tensor left in place (as SafetensorsTensors.read)."""
        return self._make(name)

    def peek(self, name: str, rows: tuple[int, int]) -> torch.Tensor:
        """Rows of a tensor left in place (as SafetensorsTensors.peek)."""
        return self._make(name)[rows[0]:rows[1]].clone()

    def pop(self, name: str, rows: tuple[int, int] | None = None,
            cols: tuple[int, int] | None = None) -> torch.Tensor:
        """As SafetensorsTensors.pop. Every rank draws the whole tensor from the same seed and
        keeps its part, so the ranks of a tensor-parallel node hold one model's shards."""
        out = self._make(name)
        del self.shapes[name]
        self._made = None
        if rows is not None:
            out = out[rows[0]:rows[1]]
        if cols is not None:
            out = out[:, cols[0]:cols[1]]
        return out.clone() if rows is not None or cols is not None else out


def validate_checkpoint_dir(path: Path, load_format: str = "safetensors") -> ModelConfig:
    """The checkpoint's config, or CheckpointError / UnsupportedModel in one line saying why
    the node cannot serve it (the launcher reads the architecture, unserved_model, before any
    process starts)."""
    if not path.is_dir():
        raise CheckpointError(f"model path {path} is not a directory")
    for needed in ("config.json", "tokenizer.json"):
        if not (path / needed).exists():
            raise CheckpointError(f"{path} has no {needed}")
    try:
        config = ModelConfig.from_checkpoint(path)
    except UnsupportedModel:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path / 'config.json'} is not a usable model config ({type(exc).__name__}: "
                              f"{exc})") from None
    if load_format == "safetensors":
        safetensors_files(path)
    return config
