"""Local disk cache of S3 objects, keyed by content, bounded in size with LRU eviction.

Layout under the root:
  blobs/ab/<sha256>        the bytes, named by their sha256 (so a blob is either whole or absent)
  refs/cd/<sha256(ref)>    {"ref": "<bucket>/<key>#<etag>", "sha256": ..., "size": ...}
  tmp/                     downloads in progress; renamed into blobs/ only once complete

A download is written to tmp/, flushed, fsynced and atomically renamed; a crash leaves
only a tmp file, which the next start deletes. Concurrent requests for the same ref share
one download (single flight). Blobs found on disk at start are re-hashed on first use.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable

log = logging.getLogger(__name__)

# Writes the object into the file it is given and returns its (sha256 hex, size).
Filler = Callable[[BinaryIO], tuple[str, int]]


class CacheCorrupt(Exception):
    """What was downloaded does not hash to what was expected."""


@dataclass(frozen=True)
class Blob:
    sha256: str
    size: int
    path: Path


def hash_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


class DiskCache:
    def __init__(self, root: str | Path, max_bytes: int, on_hit: Callable[[], None] | None = None,
                 on_miss: Callable[[], None] | None = None) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.on_hit, self.on_miss = on_hit, on_miss
        self._lock = threading.Lock()
        self._inflight: dict[str, Future[Blob]] = {}
        self._lru: OrderedDict[str, int] = OrderedDict()  # sha256 -> size, oldest first
        self._verified: set[str] = set()
        self.total_bytes = 0
        for sub in ("blobs", "refs", "tmp"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self._recover()

    # ------------------------------------------------------------------ layout

    def _blob_path(self, sha256: str) -> Path:
        return self.root / "blobs" / sha256[:2] / sha256

    def _ref_path(self, ref: str) -> Path:
        digest = hashlib.sha256(ref.encode()).hexdigest()
        return self.root / "refs" / digest[:2] / f"{digest}.json"

    def _recover(self) -> None:
        """Drops partial downloads and orders existing blobs by last use (mtime)."""
        shutil.rmtree(self.root / "tmp", ignore_errors=True)
        (self.root / "tmp").mkdir(exist_ok=True)
        found = []
        for path in (self.root / "blobs").glob("*/*"):
            if len(path.name) == 64 and path.is_file():
                st = path.stat()
                found.append((st.st_mtime, path.name, st.st_size))
            else:
                path.unlink(missing_ok=True)
        for _, sha, size in sorted(found):
            self._lru[sha] = size
            self.total_bytes += size
        if found:
            log.info("cache %s: %d blobs, %.1f MB", self.root, len(found), self.total_bytes / 1e6)
        self._evict()

    # ------------------------------------------------------------------ lookups

    def lookup(self, ref: str) -> Blob | None:
        """The cached blob for a ref, or None."""
        try:
            entry = json.loads(self._ref_path(ref).read_text())
            sha, size = str(entry["sha256"]), int(entry["size"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        path = self._blob_path(sha)
        try:
            if path.stat().st_size != size:
                raise FileNotFoundError(path)
        except FileNotFoundError:
            return None
        if sha not in self._verified:
            if hash_file(path) != sha:
                log.warning("cache blob %s does not match its name; dropping it", sha)
                self._remove(sha)
                return None
            self._verified.add(sha)
        self._touch(sha, size)
        return Blob(sha, size, path)

    def get(self, ref: str, fill: Filler, expected_sha256: str | None = None) -> Blob:
        """The blob for `ref`, downloading it with `fill` when absent. Concurrent callers of
        one ref wait for a single download; its error, if any, reaches all of them."""
        with self._lock:
            future = self._inflight.get(ref)
            owner = future is None
            if owner:
                future = Future()
                self._inflight[ref] = future
        assert future is not None
        if not owner:
            return future.result()
        try:
            blob = self.lookup(ref)
            if blob is not None:
                if self.on_hit:
                    self.on_hit()
            else:
                if self.on_miss:
                    self.on_miss()
                blob = self._fill(ref, fill, expected_sha256)
            future.set_result(blob)
            return blob
        except BaseException as exc:
            future.set_exception(exc)
            raise
        finally:
            with self._lock:
                self._inflight.pop(ref, None)

    def _fill(self, ref: str, fill: Filler, expected_sha256: str | None) -> Blob:
        fd, tmp_name = tempfile.mkstemp(dir=self.root / "tmp", suffix=".part")
        tmp = Path(tmp_name)
        try:
            with os.fdopen(fd, "wb") as f:
                sha, size = fill(f)
                f.flush()
                os.fsync(f.fileno())
            if expected_sha256 is not None and sha != expected_sha256:
                raise CacheCorrupt(f"{ref}: downloaded sha256 {sha}, expected {expected_sha256}")
            if tmp.stat().st_size != size:
                raise CacheCorrupt(f"{ref}: wrote {tmp.stat().st_size} bytes, expected {size}")
            final = self._blob_path(sha)
            final.parent.mkdir(exist_ok=True)
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self._write_ref(ref, sha, size)
        self._verified.add(sha)
        self._touch(sha, size)
        self._evict(keep=sha)
        return Blob(sha, size, final)

    def _write_ref(self, ref: str, sha: str, size: int) -> None:
        path = self._ref_path(ref)
        path.parent.mkdir(exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.root / "tmp", suffix=".ref")
        with os.fdopen(fd, "w") as f:
            json.dump({"ref": ref, "sha256": sha, "size": size}, f)
        os.replace(tmp, path)

    # ------------------------------------------------------------------ LRU

    def _touch(self, sha: str, size: int) -> None:
        with self._lock:
            if sha not in self._lru:
                self.total_bytes += size
            self._lru[sha] = size
            self._lru.move_to_end(sha)
        try:
            os.utime(self._blob_path(sha))
        except OSError:
            pass

    def _evict(self, keep: str | None = None) -> None:
        """Removes least recently used blobs until the total fits. Open readers keep their
        file (POSIX unlink semantics), so a stream in progress is never cut."""
        victims = []
        with self._lock:
            for sha in list(self._lru):
                if self.total_bytes <= self.max_bytes:
                    break
                if sha == keep:
                    continue
                self.total_bytes -= self._lru.pop(sha)
                self._verified.discard(sha)
                victims.append(sha)
        for sha in victims:
            log.info("cache: evicting %s", sha[:16])
            self._blob_path(sha).unlink(missing_ok=True)

    def discard(self, sha256: str) -> None:
        """Drops a blob found to be corrupt; the next get() downloads it again."""
        log.warning("cache: dropping blob %s", sha256[:16])
        self._remove(sha256)

    def _remove(self, sha: str) -> None:
        with self._lock:
            size = self._lru.pop(sha, None)
            if size is not None:
                self.total_bytes -= size
            self._verified.discard(sha)
        self._blob_path(sha).unlink(missing_ok=True)

    def clear(self) -> None:
        """Drops every blob (refs then dangle and are ignored)."""
        for sha in list(self._lru):
            self._remove(sha)

    def contains(self, sha256: str) -> bool:
        return sha256 in self._lru and self._blob_path(sha256).exists()

    def partial_files(self) -> list[Path]:
        return sorted((self.root / "tmp").glob("*.part"))
