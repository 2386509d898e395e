"""The node's disk tier: adapters fetched from the store kept as verified files on local disk,
so a restarted node, or one whose host memory let them go, loads them without the store.

Layout under its directory:
  <adapter sha256>/manifest.pb   the store's AdapterManifest (name, version, files and their sha256)
  <adapter sha256>/<i>           file i of the manifest, named by its index: neither the
                                 adapter's name nor the manifest's paths ever become a path
  <adapter sha256>/chunks.json   the sha256 of every CHUNK_BYTES chunk of every file
  tmp/                           entries being written, renamed into place once whole and fsynced

One node at a time owns a directory: it holds an exclusive lock on it (flock) from start to
close, since a second one would wipe the first's writes in progress and evict by an index
that is not the first's. `first_free` gives nodes sharing a parent folder (several on one
host) a slot each; a restarted node takes its old slot again, and with it its adapters.

A write checks the files against the manifest, whose digests must give the adapter sha256 the
entry is named by, and records their chunk digests beside them. Every read checks every chunk
against those, read and hashed by several threads at once (one stream's sha256 cannot be
split); an entry that fails, or whose chunk digests are unreadable, is deleted and reported
as DiskCorrupt. An entry without chunk digests (written by an older node) is checked against
the manifest's whole-file sha256 instead and gains them. Entries are evicted least recently
used first once their total passes the bound; a read refreshes the entry's mtime, so the order
survives restarts. Writes happen on a background thread, off the load's path.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import queue
import re
import shutil
import stat
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NoReturn, Sequence

from google.protobuf.message import DecodeError

from adapter_store.client import Manifest, adapter_digest, file_offsets
from lora.v1 import adapter_store_pb2 as pb
from lora_common.names import InvalidName, check_name

log = logging.getLogger(__name__)

MANIFEST_FILE = "manifest.pb"
CHUNKS_FILE = "chunks.json"
MAX_MANIFEST_BYTES = 16 << 20
# The unit of a read and of its check: large enough that a read is one efficient disk request
# and a hash call's overhead vanishes, small enough that an 8B model's adapter (~84 MB) gives
# every read thread a few chunks to share.
CHUNK_BYTES = 4 << 20
MIN_CHUNK_BYTES, MAX_CHUNK_BYTES = 64 << 10, 1 << 30  # what a chunk digest file may claim
# Reads in flight at once: enough to keep a disk's request queue full, and each hashes its own
# chunk, so at SHA-256's 1-2 GB/s per core eight cover a fast local disk without taking every
# core of a node whose engine is busy.
READ_THREADS = 8
PENDING_WRITES = 4            # adapters waiting for the writer; more are not kept on disk
_SHA256 = re.compile(r"[0-9a-f]{64}")


class DiskCorrupt(Exception):
    """An entry's bytes no longer match its manifest (the entry has been deleted)."""


class DiskTierInUse(Exception):
    """Another process's disk tier holds the directory."""


MAX_SLOTS = 64  # nodes of one model and store on one host sharing first_free's folder


def lock_directory(root: Path) -> int:
    """An open descriptor of `root` holding its exclusive lock (released when it closes, or
    when the process dies); DiskTierInUse when another holder has it."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DiskTierInUse(f"{root} is in use by another node's disk tier (one node a directory)") from None
    return fd


@dataclass(frozen=True)
class ChunkDigests:
    """The sha256 of each `chunk_bytes` chunk of each file of an entry (the last chunk of a file
    may be shorter), so a read can check chunks in parallel.

    They are trusted only because this node wrote them, into the entry's own folder, from
    bytes it had just checked against the manifest's whole-file sha256 (DiskTier.put, or a
    read of an older entry that checked the whole files): they stand in for those digests
    and are no more trusted than the entry's bytes beside them (anything that could rewrite
    them could rewrite the files too). A record that is unreadable, another entry's, or not
    one digest per chunk of the manifest's files is treated as corrupt data."""
    chunk_bytes: int
    files: tuple[tuple[bytes, ...], ...]

    def encode(self, adapter_sha256: str) -> bytes:
        return json.dumps({"adapter_sha256": adapter_sha256, "chunk_bytes": self.chunk_bytes,
                           "files": [[d.hex() for d in file] for file in self.files]}).encode()

    @classmethod
    def decode(cls, data: bytes, manifest: Manifest) -> ChunkDigests:
        """Parses and checks them against the entry's manifest (ValueError when they are not
        well formed, not this entry's, or not one digest per chunk of its files)."""
        doc = json.loads(data)
        if not isinstance(doc, dict) or set(doc) != {"adapter_sha256", "chunk_bytes", "files"}:
            raise ValueError("not a chunk digest record")
        if doc["adapter_sha256"] != manifest.adapter_sha256:
            raise ValueError("another entry's chunk digests")
        chunk_bytes, files = doc["chunk_bytes"], doc["files"]
        if type(chunk_bytes) is not int or not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk size {chunk_bytes!r} out of range")
        if not isinstance(files, list) or len(files) != len(manifest.files):
            raise ValueError("not one digest list per file")
        digests = []
        for i, (listed, f) in enumerate(zip(files, manifest.files)):
            if not isinstance(listed, list) or len(listed) != _chunk_count(f.size, chunk_bytes):
                raise ValueError(f"file {i}: not one digest per chunk")
            if not all(isinstance(d, str) and _SHA256.fullmatch(d) for d in listed):
                raise ValueError(f"file {i}: a digest that is not 64 hex digits")
            digests.append(tuple(bytes.fromhex(d) for d in listed))
        return cls(chunk_bytes, tuple(digests))


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
    def __init__(self, root: str | Path, max_bytes: int, read_threads: int = READ_THREADS) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock_fd: int | None = lock_directory(self.root)
        self.max_bytes = max_bytes
        self._readers = ThreadPoolExecutor(read_threads, thread_name_prefix="adapter-disk-read")
        self._lock = threading.Lock()
        self._entries: dict[str, DiskEntry] = {}          # adapter sha256 -> entry
        self._used: dict[str, float] = {}                 # adapter sha256 -> last use (mtime)
        self.total_bytes = 0
        self._writes: queue.Queue = queue.Queue(PENDING_WRITES)
        self._closed = False
        staging = self.root / "tmp"  # writes a crash cut short
        if staging.is_symlink() or staging.is_file():
            staging.unlink()
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        self._recover()
        self._writer = threading.Thread(target=self._write_loop, name="adapter-disk-writer", daemon=True)
        self._writer.start()

    @classmethod
    def first_free(cls, parent: Path, max_bytes: int, read_threads: int = READ_THREADS) -> "DiskTier":
        """The tier in the first slot of `parent` (parent/0, parent/1, ...) no other node holds."""
        for slot in range(MAX_SLOTS):
            try:
                return cls(parent / str(slot), max_bytes, read_threads)
            except DiskTierInUse:
                continue
        raise DiskTierInUse(f"all {MAX_SLOTS} disk tier slots under {parent} are in use")

    def close(self, timeout_s: float = 10.0) -> None:
        """Finishes the queued writes (up to timeout_s) and lets the directory go; later
        writes are dropped."""
        if self._lock_fd is None:
            return
        self._closed = True
        self.flush(timeout_s)
        os.close(self._lock_fd)
        self._lock_fd = None

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
        """The entry's files in one buffer from `allocate` (at file_offsets), every chunk
        checked against its digest (or, for an entry without chunk digests, every file
        against the manifest's sha256). Raises DiskCorrupt (after deleting the entry), or
        FileNotFoundError when it was evicted meanwhile."""
        folder = self.root / entry.sha256
        offsets = file_offsets(entry.manifest)
        files = entry.manifest.files
        try:
            expected = self._chunk_digests(folder, entry.manifest)
        except ValueError as exc:
            self._corrupt(entry, f"its chunk digests on the node's disk are unreadable ({exc})")
        chunk_bytes = expected.chunk_bytes if expected is not None else CHUNK_BYTES
        buffer = allocate(offsets[-1] + files[-1].size)
        whole = memoryview(buffer).cast("B")
        with ExitStack() as opened:
            fds = []
            for i, f in enumerate(files):
                fd = os.open(folder / str(i), os.O_RDONLY)
                opened.callback(os.close, fd)
                fds.append(fd)
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_size != f.size:
                    self._corrupt(entry, f"file {i} ({f.path}) on the node's disk has the wrong size")
            reads = [[self._readers.submit(_read_chunk, fd, whole[start + at:start + min(f.size, at + chunk_bytes)], at)
                      for at in range(0, f.size, chunk_bytes)]
                     for fd, f, start in zip(fds, files, offsets)]
            try:
                if expected is None:  # an older entry: the whole files' sha256, hashed here in order
                    found = self._check_whole_files(entry, whole, offsets, reads, chunk_bytes)
                else:
                    found = tuple(tuple(r.result() for r in file) for file in reads)
            finally:  # none may still write into the buffer, or read a closed descriptor
                for r in (r for file in reads for r in file):
                    r.cancel()
                wait([r for file in reads for r in file])
        if expected is not None:
            for i, (f, got, want) in enumerate(zip(files, found, expected.files)):
                if got != want:
                    self._corrupt(entry, f"file {i} ({f.path}) on the node's disk does not match its sha256")
        else:
            self._queue(f"chunk digests of {entry.name}", lambda: self._write_chunk_digests(
                entry, ChunkDigests(chunk_bytes, found)))
        now = time.time()
        try:
            os.utime(folder / MANIFEST_FILE, (now, now))
        except OSError:
            pass
        with self._lock:
            if entry.sha256 in self._used:
                self._used[entry.sha256] = now
        return buffer, offsets

    def _check_whole_files(self, entry: DiskEntry, whole: memoryview, offsets: list[int],
                           reads: list[list[Future]], chunk_bytes: int) -> tuple[tuple[bytes | None, ...], ...]:
        """Each file's sha256 against the manifest, fed the chunks in order as the readers
        finish them; their chunk digests."""
        found = []
        for i, (f, start, file) in enumerate(zip(entry.manifest.files, offsets, reads)):
            digest = hashlib.sha256()
            for at, r in zip(range(0, f.size, chunk_bytes), file):
                if r.result() is not None:
                    digest.update(whole[start + at:start + min(f.size, at + chunk_bytes)])
            if digest.hexdigest() != f.sha256:
                self._corrupt(entry, f"file {i} ({f.path}) on the node's disk does not match its sha256")
            found.append(tuple(r.result() for r in file))
        return tuple(found)

    def _chunk_digests(self, folder: Path, manifest: Manifest) -> ChunkDigests | None:
        """The entry's chunk digests; None when it has none (ValueError when they are unreadable)."""
        path = folder / CHUNKS_FILE
        try:
            if _regular_size(path) > MAX_MANIFEST_BYTES:
                raise ValueError("too large")
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise ValueError(str(exc)) from exc
        return ChunkDigests.decode(data, manifest)

    def _corrupt(self, entry: DiskEntry, problem: str) -> NoReturn:
        self.remove(entry.sha256)
        raise DiskCorrupt(f"{entry.name}@{entry.version}: {problem}; deleted it")

    # -- writes ------------------------------------------------------------------------------------
    def put_later(self, manifest: Manifest, files: Sequence[Any]) -> None:
        """Queues a verified adapter (its files as buffers, kept alive until written) for the
        writer; dropped with a log line when the writer is behind."""
        if self._closed or self.contains(manifest.adapter_sha256):
            return
        if not self._queue(f"{manifest.info.name}@{manifest.info.version}", lambda: self.put(manifest, files)):
            log.info("adapter disk tier: writer busy; %s@%s is not kept on disk this time", manifest.info.name,
                     manifest.info.version)

    def _queue(self, what: str, write: Callable[[], Any]) -> bool:
        if self._closed:
            return False
        try:
            self._writes.put_nowait((what, write))
        except queue.Full:
            return False
        return True

    def flush(self, timeout_s: float = 60.0) -> None:
        """Waits until the queued writes are done (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        while self._writes.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)

    def _write_loop(self) -> None:
        while True:
            what, write = self._writes.get()
            try:
                write()
            except Exception:
                log.exception("adapter disk tier: writing %s failed", what)
            finally:
                self._writes.task_done()

    def put(self, manifest: Manifest, files: Sequence[Any]) -> bool:
        """Writes an adapter atomically (files and their chunk digests fsynced, then the folder
        renamed into place), replacing older versions of its name; False when it is larger
        than the whole tier. The files must match the manifest (ValueError): the chunk
        digests recorded from them are what later reads trust."""
        _check_manifest(manifest)
        size = sum(f.size for f in manifest.files)
        if size > self.max_bytes or len(files) != len(manifest.files):
            return False
        final = self.root / manifest.adapter_sha256
        if not final.exists():
            chunks = _chunk_digests_of(manifest, files)
            staging = Path(tempfile.mkdtemp(dir=self.root / "tmp"))
            try:
                for i, data in enumerate(files):
                    _write_synced(staging / str(i), data)
                _write_synced(staging / CHUNKS_FILE, chunks.encode(manifest.adapter_sha256))
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

    def _write_chunk_digests(self, entry: DiskEntry, chunks: ChunkDigests) -> None:
        """Adds chunk digests, found by a read that checked the whole files, to an older entry
        (fsynced, then renamed into its folder unless it was deleted meanwhile)."""
        fd, staged = tempfile.mkstemp(dir=self.root / "tmp")
        os.close(fd)
        try:
            _write_synced(Path(staged), chunks.encode(entry.sha256))
            with self._lock:  # a deletion takes the entry out under it before removing the folder
                if entry.sha256 not in self._entries:
                    return
                os.rename(staged, self.root / entry.sha256 / CHUNKS_FILE)
            _fsync_dir(self.root / entry.sha256)
        finally:
            Path(staged).unlink(missing_ok=True)

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


def _chunk_count(size: int, chunk_bytes: int) -> int:
    return -(-size // chunk_bytes)


def _read_chunk(fd: int, into: memoryview, offset: int) -> bytes | None:
    """Fills `into` from the file at `offset` and returns its sha256 digest; None when the file
    ends first. (Both the read and the hash let go of the GIL, so readers run in parallel.)"""
    done = 0
    while done < len(into):
        n = os.preadv(fd, [into[done:]], offset + done)
        if n == 0:
            return None
        done += n
    return hashlib.sha256(into).digest()


def _chunk_digests_of(manifest: Manifest, files: Sequence[Any]) -> ChunkDigests:
    """The chunk digests of files about to be written, each file checked against the
    manifest's size and sha256 on the way (ValueError): only bytes proven the adapter's get
    digests a read will trust."""
    digests = []
    for i, (f, data) in enumerate(zip(manifest.files, files)):
        view = memoryview(data).cast("B")
        whole = hashlib.sha256(view)
        if view.nbytes != f.size or whole.hexdigest() != f.sha256:
            raise ValueError(f"file {i} ({f.path}) does not match the manifest's size and sha256")
        digests.append(tuple(hashlib.sha256(view[at:at + CHUNK_BYTES]).digest()
                             for at in range(0, f.size, CHUNK_BYTES)))
    return ChunkDigests(CHUNK_BYTES, tuple(digests))


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
