"""Where adapters come from: the adapter store over gRPC, or a local directory.

Both validate with the store's own validator (one set of rules), then view the tensors
directly in the fetched buffer (no copy), and check them against this base model. They run
on background threads; the engine thread never waits on them.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from adapter_store.client import Cancellation, adapter_digest, version_of
from lora_common.names import InvalidName, check_name
from lora_common.validation import (DEFAULT_MAX_CONFIG_BYTES, DEFAULT_MAX_WEIGHT_ABS, AdapterInvalid, Buffer,
                                    TensorInfo, parse_adapter_config, validate_adapter)

from ..model.config import ModelConfig
from .errors import AdapterNotFound, AdapterRejected
from ..model.families import FAMILIES
from .slots import ADAPTER_MODULES, held_modules
from .weights import (AdapterIncompatible, AdapterWeights, build_adapter_weights, never_servable,
                      probe_in_dtype)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


def host_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    """Host memory an adapter's files are read or received into: page-locked on a CUDA node
    (so slot copies run asynchronously, straight from it; torch's pinned allocator reuses
    freed blocks), pageable elsewhere."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)


def weights_from_files(name: str, version: str, config_text: str | bytes, weights: torch.Tensor | Buffer,
                       model: ModelConfig, max_rank: int, check_values: bool = True, *,
                       max_weight_abs: float = DEFAULT_MAX_WEIGHT_ABS,
                       dtype: torch.dtype = torch.float32) -> AdapterWeights:
    """Validates a PEFT adapter (config + safetensors bytes, a uint8 tensor or any buffer)
    and fits it to this base model and to the dtype it serves in. The tensors are views of
    `weights`. `check_values=False` skips the scan for NaN, Inf and the weight bound, for bytes
    proven (by sha256) to be ones it passed before."""
    tensor = isinstance(weights, torch.Tensor)
    try:  # the store's rules; the rank limit and the weight bound are this node's
        spec = validate_adapter(config_text, weights.numpy() if tensor else weights, check_values=check_values,
                                max_weight_abs=max_weight_abs)
    except AdapterInvalid as exc:
        raise AdapterRejected(f"adapter {name!r}: {exc}") from exc
    base = weights if tensor else torch.frombuffer(weights, dtype=torch.uint8)
    pairs = {key: (_view(base, m.a), _view(base, m.b)) for key, m in spec.modules.items()}
    try:
        config = spec.config
        built = build_adapter_weights(name, version, config.r, config.lora_alpha, config.use_rslora, pairs, model,
                                      max_rank, {p: config.expert_rank(p) for p in config.target_parameters},
                                      {p: config.expert_scaling(p) for p in config.target_parameters})
        probe_in_dtype(built, dtype, max_weight_abs)
        return built
    except AdapterIncompatible as exc:
        raise AdapterRejected(str(exc)) from exc


def _view(base: torch.Tensor, info: TensorInfo) -> torch.Tensor:
    """The tensor as a view of the file's bytes (no copy), or a copy where the file places it
    off its dtype's alignment."""
    dtype = _DTYPES.get(info.dtype)
    if dtype is None:
        raise AdapterRejected(f"tensor {info.name} has dtype {info.dtype}; LoRA weights are floats")
    raw = base[info.start:info.start + info.nbytes]
    if (base.storage_offset() + info.start) % dtype.itemsize:
        raw = raw.clone()
    return raw.view(dtype).view(info.shape)


def _identity(*paths: Path) -> tuple:
    """What changes when a file is rewritten or replaced: its inode, size and times, ctime
    included, which no write can keep (utime sets mtime, never ctime)."""
    return tuple((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
                 for st in (p.stat() for p in paths))


def content_hash(files: list[Buffer]) -> str:
    """A local adapter's version (config, then weights): the version the adapter store gives
    the same bytes, so an adapter keeps its version id when it moves between a folder and
    the store. A first load from the folder hashes every byte once (`_passed` keeps it)."""
    return version_of(adapter_digest(hashlib.sha256(f).hexdigest() for f in files))


class LocalDirSource:
    """Adapters as `<root>/<name>/adapter_config.json` + `adapter_model.safetensors`.

    The version is derived from the files' content, so replacing the files is a new version.
    Files that passed once are not hashed or scanned again while their identity (`_identity`)
    is unchanged: under churn the same adapters come back from this folder again and again,
    and the hash and value scan were most of a reload's time.
    """

    def __init__(self, root: Path, model: ModelConfig, max_rank: int, max_bytes: int = 0,
                 pin_memory: bool = False, *, max_weight_abs: float = DEFAULT_MAX_WEIGHT_ABS,
                 dtype: torch.dtype = torch.float32, modules: tuple[str, ...] = ADAPTER_MODULES) -> None:
        """max_bytes > 0: larger adapters are refused before they are read into memory;
        max_weight_abs, dtype: the numerical checks (weights_from_files); modules: those
        adapters may target (--lora-modules)."""
        self.root = root.resolve()
        self.model = model
        self.max_rank = max_rank
        self.modules = held_modules(modules)
        self.max_bytes = max_bytes
        self.pin_memory = pin_memory
        self.max_weight_abs = max_weight_abs
        self.dtype = dtype
        self._passed: dict[str, tuple[tuple, str]] = {}  # name -> (its files' identity, version)

    def disk_copies(self) -> list[tuple[str, str, int]]:
        """Adapters kept on this node's disk besides the source itself: none (the folder is it)."""
        return []

    def catalog(self) -> list[tuple[str, int]]:
        """Folders with an allowed name and both files whose config this node could serve
        (their weights are checked at load)."""
        found = []
        for folder in sorted(self.root.iterdir()) if self.root.is_dir() else []:
            try:
                check_name(folder.name)
            except InvalidName:
                continue
            config = folder / CONFIG_FILE
            if config.is_file() and (folder / WEIGHTS_FILE).is_file() and self._refusal(folder.name, config) is None:
                found.append((folder.name, int(config.stat().st_mtime)))
        return found

    def _refusal(self, name: str, config: Path) -> str | None:
        """Why the config says this node can never serve the adapter (its rank, its targets
        unless a pattern names them); None when it may (an invalid config is refused at load,
        with the reason)."""
        try:
            if config.stat().st_size > DEFAULT_MAX_CONFIG_BYTES:
                return None
            parsed = parse_adapter_config(config.read_bytes())
        except (OSError, AdapterInvalid):
            return None
        targets = (() if parsed.targets_from_pattern else parsed.target_modules) + tuple(
            f"experts.{p}" for p in parsed.target_parameters)
        return never_servable(name, parsed.r, targets, self.max_rank, self.modules,
                              FAMILIES[self.model.family])

    def load(self, name: str, version: str, cancel: Cancellation | None = None) -> AdapterWeights:
        """The folder's adapter (`cancel` is not needed: a local read ends by itself)."""
        try:
            check_name(name)
        except InvalidName as exc:
            raise AdapterRejected(str(exc)) from exc
        # Resolved once: a folder swapped by a symlink (a deploy) is read as one consistent pair.
        folder = (self.root / name).resolve()
        config_path, weights_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
        if not config_path.is_file():
            raise AdapterNotFound(f"adapter {name!r} not found in {self.root}")
        if not weights_path.is_file():
            raise AdapterRejected(f"adapter {name!r} has no {WEIGHTS_FILE} (pickle weights are never loaded)")
        refusal = self._refusal(name, config_path)
        if refusal is not None:
            raise AdapterRejected(refusal)
        size = config_path.stat().st_size + weights_path.stat().st_size
        if self.max_bytes and size > self.max_bytes:
            raise AdapterRejected(f"adapter {name!r} is {size / 1e6:.1f} MB; this node loads adapters up to "
                                  f"{self.max_bytes / 1e6:.1f} MB (--max-adapter-mb)")
        for _ in range(3):
            before = _identity(config_path, weights_path)
            config_bytes = config_path.read_bytes()
            weights = host_buffer(weights_path.stat().st_size, self.pin_memory)
            with weights_path.open("rb") as f:
                f.readinto(weights.numpy())
            if _identity(config_path, weights_path) == before:
                break
        else:
            raise AdapterRejected(f"adapter {name!r} kept changing while it was read; try again once it is "
                                  "written (replace files atomically, or swap a symlinked folder)")
        passed = self._passed.get(name)
        known = passed is not None and passed[0] == before
        content_version = passed[1] if known else content_hash([config_bytes, weights.numpy()])
        if version and version != content_version:
            raise AdapterNotFound(f"adapter {name!r} has version {content_version}, not {version}")
        loaded = weights_from_files(name, content_version, config_bytes, weights, self.model,
                                    self.max_rank, check_values=not known,
                                    max_weight_abs=self.max_weight_abs, dtype=self.dtype)
        self._passed[name] = (before, content_version)
        loaded.source_tier = "disk"  # the directory is this node's disk
        return loaded
