"""Adapter names and S3 keys are untrusted input: these functions are the only way in.

A name becomes one path component of an S3 key and of log lines and cache paths
elsewhere, so it must never escape its prefix (no `/`, no `..`, no control characters)
and must stay short.
"""
from __future__ import annotations

import re

MAX_NAME_LENGTH = 128
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class InvalidName(ValueError):
    """The name cannot be used (maps to INVALID_ARGUMENT)."""


def check_name(name: object) -> str:
    """Returns the name if it is a safe single path component, else raises InvalidName."""
    if not isinstance(name, str) or not name:
        raise InvalidName("adapter name is empty")
    if len(name) > MAX_NAME_LENGTH:
        raise InvalidName(f"adapter name is {len(name)} characters long; at most {MAX_NAME_LENGTH} allowed")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in name):
        raise InvalidName(f"adapter name {name!r} contains control characters")
    if ".." in name:
        raise InvalidName(f"adapter name {name!r} contains '..'")
    if "/" in name or "\\" in name or name.startswith("~"):
        raise InvalidName(f"adapter name {name!r} contains a path separator")
    if not _NAME.fullmatch(name):
        raise InvalidName(f"adapter name {name!r} must be letters, digits, '.', '_' or '-', "
                          "starting with a letter or digit")
    return name


def normalize_prefix(prefix: str) -> str:
    """'adapters' and 'adapters/' both mean the folder adapters/; '' means the bucket root."""
    prefix = prefix.strip()
    if prefix.startswith("/"):
        prefix = prefix.lstrip("/")
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    if any(part in ("..", ".") for part in prefix.split("/")[:-1]):
        raise InvalidName(f"prefix {prefix!r} contains a '.' or '..' component")
    return prefix


def object_key(prefix: str, name: str, filename: str) -> str:
    """The S3 key of one file of an adapter; the name is checked first."""
    return f"{prefix}{check_name(name)}/{filename}"


def split_key(prefix: str, key: str) -> tuple[str, str] | None:
    """(name, filename) for a key directly inside `<prefix><name>/`, else None.

    Keys nested deeper, outside the prefix, or whose name is not safe give None: they are
    not part of the catalog.
    """
    if not key.startswith(prefix):
        return None
    parts = key[len(prefix):].split("/")
    if len(parts) != 2 or not parts[1]:
        return None
    try:
        return check_name(parts[0]), parts[1]
    except InvalidName:
        return None
