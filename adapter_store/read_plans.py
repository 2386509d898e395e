"""Read plans: the store hands a node presigned GETs of an adapter's objects, so the bytes go
from the object store to the node without passing through the store's CPU.

The store stays the authority: a plan is offered only for an adapter the catalog validated,
pinned to the object versions it validated (If-Match: ETag, signed into each URL) and
carrying the BLAKE3 it recorded of their bytes, which the node checks before using them.
Files without a recorded BLAKE3 get no plan (the node streams them through FetchAdapter).
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Callable

from .catalog import CatalogEntry
from .records import FileRead, ReadPlan
from .s3 import ObjectInfo

# (object, seconds valid) -> presigned GET URL
Presign = Callable[[ObjectInfo, int], str]
_BLAKE3_HEX = re.compile(r"[0-9a-f]{64}")
OFF_REASON = "this store does not offer direct reads (adapter-store serve --direct-reads)"


@dataclass(frozen=True)
class DirectReads:
    """The store's direct-read setting."""

    enabled: bool = False
    # S3 endpoint URL the nodes reach, when not the store's own (another host name, as in
    # compose): the URLs are presigned for it. None: the store's --s3-endpoint.
    endpoint: str | None = None
    expiry_s: int = 60  # how long a plan's URLs are valid: a load reads them at once


class ReadPlanner:
    def __init__(self, presign: Presign, expiry_s: int) -> None:
        self.presign = presign
        self.expiry_s = expiry_s

    def plan(self, entry: CatalogEntry) -> ReadPlan:
        """A plan for a valid catalog entry, or one without files (and the reason)."""
        manifest = entry.manifest()
        unknown = [f.path for f in entry.files if not _BLAKE3_HEX.fullmatch(f.blake3)]
        if not entry.info.valid or not entry.files or unknown:
            reason = (f"no BLAKE3 recorded for {', '.join(unknown)}" if unknown
                      else "the adapter is not validated")
            return ReadPlan(manifest, (), 0, reason)
        expires_at = int(time.time()) + self.expiry_s
        reads = tuple(FileRead(self.presign(f.obj, self.expiry_s), f'"{f.obj.etag}"') for f in entry.files)
        return ReadPlan(manifest, reads, expires_at)
