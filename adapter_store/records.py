"""Plain data the server and the client share, and their protobuf conversions.

Kept apart from the generated code so callers handle typed, immutable values instead of
mutable protobuf messages.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from lora.v1 import adapter_store_pb2 as pb


def adapter_digest(file_sha256s: Iterable[str]) -> str:
    """The whole adapter's sha256: over the files' raw sha256 digests in manifest order."""
    return hashlib.sha256(b"".join(bytes.fromhex(h) for h in file_sha256s)).hexdigest()


def version_of(adapter_sha256: str) -> str:
    """An adapter's version id: the first 16 hex digits of its adapter_digest. The store names
    a version so, and so does a node for an adapter in --adapter-dir: the same bytes have one
    version whatever their source."""
    return adapter_sha256[:16]


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    version: str
    rank: int = 0
    lora_alpha: float = 0.0
    use_rslora: bool = False
    target_modules: tuple[str, ...] = ()
    base_model: str = ""
    size_bytes: int = 0
    valid: bool = False
    invalid_reason: str = ""
    updated_at: int = 0

    def to_proto(self) -> pb.AdapterInfo:
        return pb.AdapterInfo(name=self.name, version=self.version, rank=self.rank, lora_alpha=self.lora_alpha,
                              use_rslora=self.use_rslora, target_modules=list(self.target_modules),
                              base_model=self.base_model, size_bytes=self.size_bytes, valid=self.valid,
                              invalid_reason=self.invalid_reason, updated_at=self.updated_at)

    @classmethod
    def from_proto(cls, m: pb.AdapterInfo) -> "AdapterInfo":
        return cls(m.name, m.version, m.rank, m.lora_alpha, m.use_rslora, tuple(m.target_modules),
                   m.base_model, m.size_bytes, m.valid, m.invalid_reason, m.updated_at)


@dataclass(frozen=True)
class FileEntry:
    path: str
    size: int
    sha256: str
    blake3: str = ""  # of the same bytes; empty in manifests of stores that do not compute it

    def to_proto(self) -> pb.FileEntry:
        return pb.FileEntry(path=self.path, size=self.size, sha256=self.sha256, blake3=self.blake3)

    @classmethod
    def from_proto(cls, m: pb.FileEntry) -> "FileEntry":
        return cls(m.path, m.size, m.sha256, m.blake3)


@dataclass(frozen=True)
class Manifest:
    info: AdapterInfo
    config_json: str
    files: tuple[FileEntry, ...]
    adapter_sha256: str

    def to_proto(self) -> pb.AdapterManifest:
        return pb.AdapterManifest(info=self.info.to_proto(), config_json=self.config_json,
                                  files=[f.to_proto() for f in self.files], adapter_sha256=self.adapter_sha256)

    @classmethod
    def from_proto(cls, m: pb.AdapterManifest) -> "Manifest":
        return cls(AdapterInfo.from_proto(m.info), m.config_json, tuple(FileEntry.from_proto(f) for f in m.files),
                   m.adapter_sha256)


@dataclass(frozen=True)
class FileRead:
    """Where one file of a read plan is read: a presigned GET (a credential: kept out of
    reprs, never logged) and the If-Match value signed into it."""

    url: str = field(repr=False)
    if_match: str = ""

    def to_proto(self) -> pb.FileRead:
        return pb.FileRead(url=self.url, if_match=self.if_match)

    @classmethod
    def from_proto(cls, m: pb.FileRead) -> "FileRead":
        return cls(m.url, m.if_match)


@dataclass(frozen=True)
class ReadPlan:
    """GetReadPlan's answer: the manifest and, when a plan is offered, one FileRead per file
    in its order (none, with the reason, when it is not)."""

    manifest: Manifest
    files: tuple[FileRead, ...] = ()
    expires_at: int = 0  # unix seconds
    reason: str = ""

    def to_proto(self) -> pb.ReadPlan:
        return pb.ReadPlan(manifest=self.manifest.to_proto(), files=[f.to_proto() for f in self.files],
                           expires_at=self.expires_at, reason=self.reason)

    @classmethod
    def from_proto(cls, m: pb.ReadPlan) -> "ReadPlan":
        return cls(Manifest.from_proto(m.manifest), tuple(FileRead.from_proto(f) for f in m.files),
                   m.expires_at, m.reason)


ADDED, UPDATED, DELETED, SYNCED = "ADDED", "UPDATED", "DELETED", "SYNCED"


@dataclass(frozen=True)
class CatalogEvent:
    kind: str  # ADDED, UPDATED, DELETED or SYNCED
    adapter: AdapterInfo | None = None
    previous_version: str = ""

    def to_proto(self) -> pb.AdapterEvent:
        return pb.AdapterEvent(kind=pb.AdapterEvent.Kind.Value(self.kind),
                               adapter=self.adapter.to_proto() if self.adapter else None,
                               previous_version=self.previous_version)

    @classmethod
    def from_proto(cls, m: pb.AdapterEvent) -> "CatalogEvent":
        kind = pb.AdapterEvent.Kind.Name(m.kind)
        return cls(kind, AdapterInfo.from_proto(m.adapter) if m.HasField("adapter") else None, m.previous_version)


FILE_ALIGN = 4096  # each file of a fetched adapter starts this aligned within its buffer


def file_offsets(manifest: Manifest) -> list[int]:
    """Where each file starts in the one buffer an adapter is received into: aligned, so
    tensors can be viewed in place at their dtype's alignment."""
    offsets, start = [], 0
    for f in manifest.files:
        offsets.append(start)
        start += -(-f.size // FILE_ALIGN) * FILE_ALIGN
    return offsets


@dataclass
class FetchedAdapter:
    """A fetched adapter: every byte verified against the manifest's sha256 digests. The
    files are views of one `buffer`, at `offsets` (see file_offsets)."""

    manifest: Manifest
    files: dict[str, memoryview] = field(default_factory=dict)
    buffer: Any = None
    offsets: dict[str, int] = field(default_factory=dict)

    @property
    def info(self) -> AdapterInfo:
        return self.manifest.info

    @property
    def name(self) -> str:
        return self.manifest.info.name

    @property
    def version(self) -> str:
        return self.manifest.info.version

    @property
    def config_json(self) -> str:
        return self.manifest.config_json

    @property
    def weights(self) -> memoryview:
        """The adapter_model.safetensors bytes."""
        return self.files["adapter_model.safetensors"]

    def sizes(self) -> Sequence[int]:
        return [len(b) for b in self.files.values()]
