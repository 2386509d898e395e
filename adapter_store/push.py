"""`adapter-store push`: checks a local PEFT adapter and uploads it where the store looks.

The weights go first and the config last, so a store polling mid-upload sees the new
config only once the weights it describes are in place.
"""
from __future__ import annotations

import logging
import mmap
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from lora_common.names import CONFIG_FILE, WEIGHTS_FILE, check_name, object_key
from .s3 import MULTIPART_BYTES, ObjectInfo, S3Store
from lora_common.validation import DEFAULT_MAX_WEIGHT_ABS, AdapterInvalid, AdapterSpec, validate_adapter

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Pushed:
    name: str
    objects: tuple[ObjectInfo, ...]
    spec: AdapterSpec | None


def check_local_adapter(folder: Path, max_weight_abs: float = DEFAULT_MAX_WEIGHT_ABS) -> AdapterSpec:
    """Validates a local adapter folder as the store would; raises AdapterInvalid."""
    config, weights = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not weights.is_file():
        pickles = sorted(p.name for p in folder.glob("*.bin"))
        if pickles:
            raise AdapterInvalid(f"{folder} has {', '.join(pickles)} (pickle) but no {WEIGHTS_FILE}; pickle is "
                                 "never loaded: save with safe_serialization=True")
        raise AdapterInvalid(f"{folder}: missing {WEIGHTS_FILE}")
    if not config.is_file():
        raise AdapterInvalid(f"{folder}: missing {CONFIG_FILE}")
    if weights.stat().st_size == 0:
        raise AdapterInvalid(f"{weights} is empty")
    with open(weights, "rb") as f:
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return validate_adapter(config.read_bytes(), data, max_weight_abs=max_weight_abs)
    finally:
        try:
            data.close()
        except BufferError:
            pass


def push_adapter(folder: str | Path, name: str, s3: S3Store, prefix: str, *, validate: bool = True,
                 progress: bool = True, on_bytes: Callable[[int], None] | None = None,
                 multipart_bytes: int = MULTIPART_BYTES,
                 max_weight_abs: float = DEFAULT_MAX_WEIGHT_ABS) -> Pushed:
    """Uploads `<folder>/adapter_model.safetensors` and `adapter_config.json` to
    `<prefix><name>/` (multipart for large files), with a progress bar when asked."""
    folder = Path(folder)
    check_name(name)
    spec = check_local_adapter(folder, max_weight_abs) if validate else None
    files = [folder / WEIGHTS_FILE, folder / CONFIG_FILE]
    for path in files:
        if not path.is_file():
            raise AdapterInvalid(f"{path} is missing")
    total = sum(p.stat().st_size for p in files)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=f"push {name}")

    def advance(n: int) -> None:
        if bar is not None:
            bar.update(n)
        if on_bytes is not None:
            on_bytes(n)

    try:
        objects = tuple(s3.upload_file(str(p), object_key(prefix, name, p.name), advance, multipart_bytes,
                                       content_type="application/json" if p.suffix == ".json" else
                                       "application/octet-stream") for p in files)
    finally:
        if bar is not None:
            bar.close()
    log.info("pushed %s to %s/%s%s/ (%d bytes)", name, s3.bucket, prefix, name, total)
    return Pushed(name, objects, spec)
