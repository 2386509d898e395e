"""The node's disk tier: adapters fetched from the store kept as verified files on local disk,
so a restarted node, or one whose host memory let them go, loads them without the store.

Layout under its directory:
  <adapter sha256>/manifest.pb   the store's AdapterManifest (name, version, files and their sha256)
  <adapter sha256>/<i>           file i of the manifest, named by its index: neither the
                                 adapter's name nor the manifest's paths ever become a path
  tmp/                           entries being written, renamed into place once whole and fsynced

Every read hashes the files against the manifest, whose digests must give the adapter
sha256 the entry is named by; an entry that fails is deleted and reported as DiskCorrupt.
Entries are evicted least recently used first once their total passes the bound; a read
refreshes the entry's mtime, so the order survives restarts. Writes happen on a background
thread, off the load's path.
"""
from __future__ import annotations

import hashlib
import logging
import os
import queue
import re
import shutil
import stat
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from google.protobuf.message import DecodeError

from adapter_store.client import Manifest, adapter_digest, file_offsets
from lora.v1 import adapter_store_pb2 as pb
from lora_common.names import InvalidName, check_name

log = logging.getLogger(__name__)

MANIFEST_FILE = "manifest.pb"
MAX_MANIFEST_BYTES = 16 << 20
READ_CHUNK_BYTES = 8 << 20    # read and hashed in turn: the hash of one chunk overlaps the next read
PENDING_WRITES = 4            # adapters waiting for the writer; more are not kept on disk
_SHA256 = re.compile(r"[0-9a-f]{64}")


class DiskCorrupt(Exception):
    """An entry's bytes no longer match its manifest (the entry has been deleted)."""


@dataclass(frozen=True)
class DiskEntry:
    manifest: Manifest
    size: int  # bytes of its files

    @property
    def name(self) -> str:
        return self.manifest.info.name

    @property
    def version(self) -> str:
        return self.manifest.info.version

    @property
    def sha256(self) -> str:
        return self.manifest.adapter_sha256


def _check_manifest(manifest: Manifest) -> None:
    """Refuses a manifest whose digests do not name its content (ValueError)."""
    check_name(manifest.info.name)
    if not _SHA256.fullmatch(manifest.adapter_sha256):
        raise ValueError(f"adapter sha256 {manifest.adapter_sha256!r} is not 64 hex digits")
    if adapter_digest(f.sha256 for f in manifest.files) != manifest.adapter_sha256:
        raise ValueError("the files' digests do not give the adapter sha256")
    if not manifest.info.version or not manifest.adapter_sha256.startswith(manifest.info.version):
        raise ValueError(f"version {manifest.info.version!r} is not the adapter sha256's prefix")
    if not manifest.files or any(f.size < 0 for f in manifest.files):
        raise ValueError("no files, or a file with a negative size")


class DiskTier:
    def __init__(self, root: str | Path, max_bytes: int) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._entries: dict[str, DiskEntry] = {}          # adapter sha256 -> entry
        self._used: dict[str, float] = {}                 # adapter sha256 -> last use (mtime)
        self.total_bytes = 0
        self._writes: queue.Queue = queue.Queue(PENDING_WRITES)
        self.root.mkdir(parents=True, exist_ok=True)
        staging = self.root / "tmp"  # writes a crash cut short
        if staging.is_symlink() or staging.is_file():
            staging.unlink()
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        self._recover()
        self._writer = threading.Thread(target=self._write_loop, name="adapter-disk-writer", daemon=True)
        self._writer.start()

    # -- index -------------------------------------------------------------------------------------
    def _recover(self) -> None:
        for folder in self.root.iterdir():
            if folder.name == "tmp":
                continue
            try:
                entry = self._load_entry(folder)
            except (OSError, ValueError, InvalidName, DecodeError) as exc:
                log.warning("adapter disk tier: dropping %s (%s)", folder.name[:80], exc)
                if folder.is_dir() and not folder.is_symlink():
                    shutil.rmtree(folder, ignore_errors=True)
                else:
                    folder.unlink(missing_ok=True)
                continue
            self._add(entry, (folder / MANIFEST_FILE).stat().st_mtime)
        for names in self._versions_by_name().values():  # one version per name: the newest
            for stale in sorted(names, key=lambda e: e.manifest.info.updated_at)[:-1]:
                self._delete(stale.sha256)
        self._evict()
        if self._entries:
            log.info("adapter disk tier %s: %d adapters, %.1f MB", self.root, len(self._entries),
                     self.total_bytes / 1e6)

    def _load_entry(self, folder: Path) -> DiskEntry:
        if not _SHA256.fullmatch(folder.name) or not stat.S_ISDIR(folder.lstat().st_mode):
            raise ValueError("not an entry")
        path = folder / MANIFEST_FILE
        if _regular_size(path) > MAX_MANIFEST_BYTES:
            raise ValueError("manifest too large")
        manifest = Manifest.from_proto(pb.AdapterManifest.FromString(path.read_bytes()))
        _check_manifest(manifest)
        if manifest.adapter_sha256 != folder.name:
            raise ValueError("the manifest is not this entry's")
        for i, f in enumerate(manifest.files):
            if _regular_size(folder / str(i)) != f.size:
                raise ValueError(f"file {i} has the wrong size")
        return DiskEntry(manifest, sum(f.size for f in manifest.files))

    def _add(self, entry: DiskEntry, used: float) -> None:
        with self._lock:
            if entry.sha256 not in self._entries:
                self.total_bytes += entry.size
            self._entries[entry.sha256] = entry
            self._used[entry.sha256] = used

    def _versions_by_name(self) -> dict[str, list[DiskEntry]]:
        with self._lock:
            by_name: dict[str, list[DiskEntry]] = {}
            for entry in self._entries.values():
                by_name.setdefault(entry.name, []).append(entry)
            return by_name

    def entries(self) -> list[DiskEntry]:
        with self._lock:
            return list(self._entries.values())

    def lookup(self, name: str, version: str = "") -> DiskEntry | None:
        """The entry of that version, or for version "" the newest one kept of that name."""
        with self._lock:
            found = [e for e in self._entries.values() if e.name == name and (not version or e.version == version)]
        return max(found, key=lambda e: e.manifest.info.updated_at) if found else None

    # -- reads -------------------------------------------------------------------------------------
    def read(self, entry: DiskEntry, allocate: Callable[[int], Any]) -> tuple[Any, list[int]]:
        """The entry's files in one buffer from `allocate` (at file_offsets), verified against
        the manifest. Raises DiskCorrupt (after deleting the entry), or FileNotFoundError when
        it was evicted meanwhile."""
        folder = self.root / entry.sha256
        offsets = file_offsets(entry.manifest)
        files = entry.manifest.files
        buffer = allocate(offsets[-1] + files[-1].size)
        whole = memoryview(buffer).cast("B")
        with ThreadPoolExecutor(1, thread_name_prefix="adapter-disk-sha256") as hasher:
            for i, (f, start) in enumerate(zip(files, offsets)):
                digest = hashlib.sha256()
                pending = []
                with open(folder / str(i), "rb", buffering=0) as src:
                    at = 0
                    while at < f.size:
                        chunk = whole[start + at:start + min(f.size, at + READ_CHUNK_BYTES)]
                        n = src.readinto(chunk)
                        if not n:
                            break
                        pending.append(hasher.submit(digest.update, chunk[:n]))
                        at += n
                    extra = src.read(1)
                for future in pending:
                    future.result()
                if at != f.size or extra or digest.hexdigest() != f.sha256:
                    self.remove(entry.sha256)
                    raise DiskCorrupt(f"{entry.name}@{entry.version}: file {i} ({f.path}) on the node's disk does "
                                      "not match its sha256; deleted it")
        now = time.time()
        try:
            os.utime(folder / MANIFEST_FILE, (now, now))
        except OSError:
            pass
        with self._lock:
            if entry.sha256 in self._used:
                self._used[entry.sha256] = now
        return buffer, offsets

    # -- writes ------------------------------------------------------------------------------------
    def put_later(self, manifest: Manifest, files: Sequence[Any]) -> None:
        """Queues a verified adapter (its files as buffers, kept alive until written) for the
        writer; dropped with a log line when the writer is behind."""
        if self.contains(manifest.adapter_sha256):
            return
        try:
            self._writes.put_nowait((manifest, files))
        except queue.Full:
            log.info("adapter disk tier: writer busy; %s@%s is not kept on disk this time", manifest.info.name,
                     manifest.info.version)

    def flush(self, timeout_s: float = 60.0) -> None:
        """Waits until the queued writes are done (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        while self._writes.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)

    def _write_loop(self) -> None:
        while True:
            manifest, files = self._writes.get()
            try:
                self.put(manifest, files)
            except Exception:
                log.exception("adapter disk tier: writing %s failed", manifest.info.name)
            finally:
                self._writes.task_done()

    def put(self, manifest: Manifest, files: Sequence[Any]) -> bool:
        """Writes an adapter atomically (files fsynced, then the folder renamed into place),
        replacing older versions of its name; False when it is larger than the whole tier."""
        _check_manifest(manifest)
        size = sum(f.size for f in manifest.files)
        if size > self.max_bytes or len(files) != len(manifest.files):
            return False
        final = self.root / manifest.adapter_sha256
        if not final.exists():
            staging = Path(tempfile.mkdtemp(dir=self.root / "tmp"))
            try:
                for i, data in enumerate(files):
                    _write_synced(staging / str(i), data)
                _write_synced(staging / MANIFEST_FILE, manifest.to_proto().SerializeToString())
                _fsync_dir(staging)
                try:
                    os.rename(staging, final)
                except OSError:
                    if not final.exists():  # else another writer put the same content first
                        raise
                _fsync_dir(self.root)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        self._add(DiskEntry(manifest, size), time.time())
        for other in self._versions_by_name().get(manifest.info.name, []):
            if other.sha256 != manifest.adapter_sha256:
                self._delete(other.sha256)
        self._evict(keep=manifest.adapter_sha256)
        return True

    def contains(self, adapter_sha256: str) -> bool:
        with self._lock:
            return adapter_sha256 in self._entries

    def remove(self, adapter_sha256: str) -> None:
        self._delete(adapter_sha256)

    def remove_name(self, name: str) -> None:
        """Deletes every version of an adapter (it was deleted from the store)."""
        for entry in self._versions_by_name().get(name, []):
            self._delete(entry.sha256)

    def _delete(self, adapter_sha256: str) -> None:
        with self._lock:
            entry = self._entries.pop(adapter_sha256, None)
            self._used.pop(adapter_sha256, None)
            if entry is not None:
                self.total_bytes -= entry.size
        if _SHA256.fullmatch(adapter_sha256):
            shutil.rmtree(self.root / adapter_sha256, ignore_errors=True)

    def _evict(self, keep: str | None = None) -> None:
        while True:
            with self._lock:
                if self.total_bytes <= self.max_bytes:
                    return
                candidates = [(used, sha) for sha, used in self._used.items() if sha != keep]
                if not candidates:
                    return
                victim = min(candidates)[1]
                name = self._entries[victim].name
            log.info("adapter disk tier: evicting %s (%s)", name, victim[:16])
            self._delete(victim)


def _regular_size(path: Path) -> int:
    """The size of a regular file (not a link or a device: the tier only reads what it wrote)."""
    st = path.lstat()
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{path.name} is not a regular file")
    return st.st_size


def _write_synced(path: Path, data: Any) -> None:
    with open(path, "wb", buffering=0) as out:
        view = memoryview(data).cast("B")
        while view:
            view = view[out.write(view):]
        os.fsync(out.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
