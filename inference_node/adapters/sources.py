"""Where adapters come from: the adapter store over gRPC, or a local directory.

Both produce validated `AdapterWeights` on a background thread; the engine thread never
waits on them.
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors

from ..model.config import ModelConfig
from .errors import AdapterNotFound, AdapterRejected
from .weights import AdapterIncompatible, AdapterWeights, build_adapter_weights

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def weights_from_files(name: str, version: str, config_text: str, weights_bytes: bytes | bytearray,
                       model: ModelConfig, max_rank: int) -> AdapterWeights:
    """Parses a PEFT adapter (config + safetensors bytes) into weights for this base model."""
    try:
        config = json.loads(config_text)
    except json.JSONDecodeError as exc:
        raise AdapterRejected(f"adapter {name!r}: {CONFIG_FILE} is not JSON ({exc})") from exc
    if str(config.get("peft_type", "")).upper() != "LORA":
        raise AdapterRejected(f"adapter {name!r}: peft_type {config.get('peft_type')!r} is not LORA")
    if config.get("use_dora"):
        raise AdapterRejected(f"adapter {name!r}: DoRA adapters are not supported")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise AdapterRejected(f"adapter {name!r}: per-module rank_pattern/alpha_pattern are not supported")
    try:
        rank = int(config["r"])
        alpha = float(config.get("lora_alpha", rank))
    except (KeyError, TypeError, ValueError) as exc:
        raise AdapterRejected(f"adapter {name!r}: {CONFIG_FILE} lacks a valid r/lora_alpha") from exc
    try:
        tensors = load_safetensors(bytes(weights_bytes))
    except Exception as exc:  # safetensors raises its own error types
        raise AdapterRejected(f"adapter {name!r}: {WEIGHTS_FILE} is not valid safetensors ({exc})") from exc
    for tname, t in tensors.items():
        if not t.is_floating_point():
            raise AdapterRejected(f"adapter {name!r}: tensor {tname} has dtype {t.dtype}")
        if not torch.isfinite(t).all():
            raise AdapterRejected(f"adapter {name!r}: tensor {tname} holds NaN or Inf")
    try:
        return build_adapter_weights(name, version, rank, alpha, bool(config.get("use_rslora")),
                                     tensors, model, max_rank)
    except AdapterIncompatible as exc:
        raise AdapterRejected(str(exc)) from exc


class LocalDirSource:
    """Adapters as `<root>/<name>/adapter_config.json` + `adapter_model.safetensors`.

    The version is derived from the files' content, so replacing the files is a new version.
    """

    def __init__(self, root: Path, model: ModelConfig, max_rank: int) -> None:
        self.root = root.resolve()
        self.model = model
        self.max_rank = max_rank

    def load(self, name: str, version: str) -> AdapterWeights:
        if not _SAFE_NAME.match(name):
            raise AdapterRejected(f"adapter name {name!r} is not allowed")
        folder = self.root / name
        config_path, weights_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
        if not config_path.is_file():
            raise AdapterNotFound(f"adapter {name!r} not found in {self.root}")
        if not weights_path.is_file():
            raise AdapterRejected(f"adapter {name!r} has no {WEIGHTS_FILE} (pickle weights are never loaded)")
        config_bytes, weights_bytes = config_path.read_bytes(), weights_path.read_bytes()
        content_version = content_hash([config_bytes, weights_bytes])
        if version and version != content_version:
            raise AdapterNotFound(f"adapter {name!r} has version {content_version}, not {version}")
        return weights_from_files(name, content_version, config_bytes.decode("utf-8", "replace"),
                                  weights_bytes, self.model, self.max_rank)


def content_hash(files: list[bytes]) -> str:
    digests = b"".join(hashlib.sha256(f).digest() for f in files)
    return hashlib.sha256(digests).hexdigest()
