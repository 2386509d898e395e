"""Local disk cache of S3 objects, keyed by content, bounded in size with LRU eviction.

Layout under the root:
  blobs/ab/<sha256>        the bytes, named by their sha256 (so a blob is either whole or absent)
  refs/cd/<sha256(ref)>    {"ref": "<bucket>/<key>#<etag>", "sha256": ..., "size": ..., "blake3": ...}
  tmp/                     downloads in progress; renamed into blobs/ only once complete

A download is written to tmp/, fsynced and atomically renamed once it passed its checks:
the expected BLAKE3 or sha256 where the caller knows one (the catalog's record of these
bytes), else the filler's (the S3 ETag's MD5); a crash leaves only a tmp file, which the next start
deletes. Concurrent requests for the same ref share one download (single flight), and
can read it while it is in progress; they hear that it is verified before it is fsynced,
so durability is not on their path. Blobs found on disk at start are re-hashed on first use.

Per verified blob the cache also keeps, in memory, the digest (sha256 or BLAKE3) of each
shard of a given size (`shard_digests`), so a blob streamed again is not hashed again. Each blob's BLAKE3 is
computed as it is written (or when a blob found at start is re-hashed) and kept in its ref:
manifests carry it for the node, which checks it instead of the sha256.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable

import blake3

log = logging.getLogger(__name__)

# Writes the object into the file it is given and returns its (sha256 hex, size); the sha256
# may be "" when the cache is given the BLAKE3 to expect (the cache hashes BLAKE3 as it writes).
Filler = Callable[[BinaryIO], tuple[str, int]]
MAX_SHARD_TABLES = 16384  # shard digest tables kept (each a few KB at most)


class CacheCorrupt(Exception):
    """What was downloaded does not hash to what was expected."""


@dataclass(frozen=True)
class Blob:
    sha256: str
    size: int
    path: Path
    blake3: str = ""


def hash_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def file_digests(path: Path, chunk: int = 1 << 20) -> tuple[str, str]:
    """(sha256, BLAKE3) of a file, hex."""
    sha, b3 = hashlib.sha256(), blake3.blake3()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            sha.update(block)
            b3.update(block)
    return sha.hexdigest(), b3.hexdigest()


class _Download:
    """A fill in progress: how many bytes are on disk, and how it ended."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.cond = threading.Condition()
        self.written = 0
        self.done = False
        self.verified: Blob | None = None  # its bytes passed their checks (maybe not yet durable)
        self.blob: Blob | None = None      # renamed into blobs/
        self.error: BaseException | None = None

    def advance(self, n: int) -> None:
        with self.cond:
            self.written += n
            self.cond.notify_all()

    def verify(self, blob: Blob) -> None:
        with self.cond:
            self.verified = blob
            self.cond.notify_all()

    def finish(self, blob: Blob | None, error: BaseException | None) -> None:
        with self.cond:
            self.blob, self.error, self.done = blob, error, True
            self.cond.notify_all()


class _ProgressWriter:
    """The file a filler writes to: every write is on disk (unbuffered) before readers hear of it."""

    def __init__(self, raw: BinaryIO, download: _Download) -> None:
        self.raw, self.download = raw, download
        self.blake3 = blake3.blake3()  # a filler writes in order (the writer cannot seek)

    def write(self, data: bytes) -> int:
        view = memoryview(data)
        self.blake3.update(view)
        while view:
            n = self.raw.write(view)
            view = view[n:]
        self.download.advance(len(data))
        return len(data)


class BlobReader:
    """Positional reads of a cached blob or of a download in progress (same inode: the
    rename from tmp/ to blobs/ does not disturb an open file)."""

    def __init__(self, fd: int, download: _Download | None, blob: Blob | None, timeout_s: float | None) -> None:
        self.fd, self.download, self.blob, self.timeout_s = fd, download, blob, timeout_s

    @classmethod
    def of_blob(cls, blob: Blob) -> "BlobReader":
        return cls(os.open(blob.path, os.O_RDONLY), None, blob, None)

    @classmethod
    def of_download(cls, download: _Download, timeout_s: float | None) -> "BlobReader":
        with download.cond:
            if download.done and download.error is not None:
                raise download.error
            # blob is set under this lock as the file is renamed, before the download is done
            path = download.blob.path if download.blob is not None else download.tmp_path
            try:
                return cls(os.open(path, os.O_RDONLY), download, download.blob, timeout_s)
            except FileNotFoundError:
                # A failed download removes its partial file before it reports the failure:
                # wait for that report (the fill does not need this lock to remove it).
                if not download.cond.wait_for(lambda: download.done, timeout_s) or download.error is None:
                    raise
                raise download.error from None

    @property
    def streaming(self) -> bool:
        return self.download is not None and not self.download.done

    def read(self, offset: int, n: int) -> bytes:
        """Up to n bytes at offset, waiting for a download to get there."""
        download = self.download
        if download is not None:
            with download.cond:
                if not download.cond.wait_for(lambda: download.done or download.written >= offset + n,
                                              self.timeout_s):
                    raise TimeoutError(f"the download did not reach byte {offset + n} in time")
                if download.error is not None:
                    raise download.error
        return os.pread(self.fd, n, offset)

    def wait_complete(self, stored: bool = False) -> Blob:
        """The blob once complete and verified; raises the download's error. Readers of
        this open file need no more; `stored` also waits until it is fsynced and in blobs/
        (for callers that open `blob.path` themselves)."""
        download = self.download
        if download is not None:
            def ready() -> bool:
                return download.done or (not stored and download.verified is not None)

            with download.cond:
                if not download.cond.wait_for(ready, self.timeout_s):
                    raise TimeoutError("the download did not complete in time")
                if download.error is not None and (stored or download.verified is None):
                    raise download.error
                self.blob = download.blob if stored else download.verified
        assert self.blob is not None
        return self.blob

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "BlobReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class DiskCache:
    def __init__(self, root: str | Path, max_bytes: int, on_hit: Callable[[], None] | None = None,
                 on_miss: Callable[[], None] | None = None) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.on_hit, self.on_miss = on_hit, on_miss
        self._lock = threading.Lock()
        self._inflight: dict[str, _Download] = {}
        self._finished = 0  # downloads ended so far (open() notices one ending mid-lookup)
        self._lru: OrderedDict[str, int] = OrderedDict()  # sha256 -> size, oldest first
        self._verified: dict[str, str] = {}  # sha256 -> BLAKE3 of the blobs hashed since start
        # (blob sha256, shard size, "sha256" or "blake3") -> each shard's digest, hex
        self._shard_digests: dict[tuple[str, int, str], tuple[str, ...]] = {}
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
            sha, size, b3 = str(entry["sha256"]), int(entry["size"]), str(entry.get("blake3", ""))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None
        path = self._blob_path(sha)
        try:
            if path.stat().st_size != size:
                raise FileNotFoundError(path)
        except FileNotFoundError:
            return None
        known = self._verified.get(sha)
        if known is None:
            digest, known = file_digests(path)
            if digest != sha:
                log.warning("cache blob %s does not match its name; dropping it", sha)
                self._remove(sha)
                return None
            self._verified[sha] = known
            if b3 != known:  # a ref written before BLAKE3 was kept (or a wrong one)
                self._write_ref(ref, sha, size, known)
        self._touch(sha, size)
        return Blob(sha, size, path, known)

    def get(self, ref: str, fill: Filler, expected_sha256: str | None = None, expected_blake3: str = "") -> Blob:
        """The blob for `ref`, downloading it with `fill` when absent. Concurrent callers of
        one ref share a single download; its error, if any, reaches all of them."""
        reader = self.open(ref, fill, expected_sha256, expected_blake3=expected_blake3)
        try:
            return reader.wait_complete(stored=True)
        finally:
            reader.close()

    def open(self, ref: str, fill: Filler, expected_sha256: str | None = None,
             timeout_s: float | None = None, expected_blake3: str = "") -> "BlobReader":
        """A reader of the ref's bytes: from the cached blob, or from the download in
        progress (started here if none is), serving each byte as soon as it is on disk.
        Bytes read before the download completes are unverified: wait_complete() raises
        if the download then fails its checks. A download is checked against
        `expected_blake3` and/or `expected_sha256` where given; with both, the BLAKE3 match
        proves these are the bytes whose sha256 was recorded, and `fill` need not hash them."""
        if expected_blake3 and expected_sha256 is None:
            raise ValueError("expected_blake3 comes with the expected_sha256 the blob is named by")
        for attempt in range(3):
            with self._lock:
                download = self._inflight.get(ref)
                finished = self._finished
            if download is not None:
                break
            blob = self.lookup(ref)
            if blob is not None:
                try:
                    reader = BlobReader.of_blob(blob)
                except FileNotFoundError:  # evicted just now: download it again
                    reader = None
                if reader is not None:
                    if self.on_hit:
                        self.on_hit()
                    return reader
            with self._lock:
                download = self._inflight.get(ref)
                # A download that started and ended between the lookup and here (a small file
                # can) may have been this ref's: look again rather than download it twice.
                if download is None and self._finished != finished and attempt < 2:
                    continue
                start = download is None
                if start:
                    fd, tmp_name = tempfile.mkstemp(dir=self.root / "tmp", suffix=".part")
                    os.close(fd)
                    download = _Download(Path(tmp_name))
                    self._inflight[ref] = download
            if start:
                if self.on_miss:
                    self.on_miss()
                threading.Thread(target=self._fill, args=(ref, download, fill, expected_sha256, expected_blake3),
                                 name="cache-fill", daemon=True).start()
            break
        return BlobReader.of_download(download, timeout_s)

    def _fill(self, ref: str, download: "_Download", fill: Filler, expected_sha256: str | None,
              expected_blake3: str) -> None:
        tmp = download.tmp_path
        try:
            with open(tmp, "wb", buffering=0) as raw:
                writer = _ProgressWriter(raw, download)
                sha, size = fill(writer)
                b3 = writer.blake3.hexdigest()
                if expected_blake3 and b3 != expected_blake3:
                    raise CacheCorrupt(f"{ref}: downloaded BLAKE3 {b3}, expected {expected_blake3}")
                if sha and expected_sha256 is not None and sha != expected_sha256:
                    raise CacheCorrupt(f"{ref}: downloaded sha256 {sha}, expected {expected_sha256}")
                if not sha:  # the filler left the proof to the expected BLAKE3
                    if not expected_blake3 or expected_sha256 is None:
                        raise ValueError(f"{ref}: the filler hashed nothing and no BLAKE3 was expected")
                    sha = expected_sha256
                if os.fstat(raw.fileno()).st_size != size:
                    raise CacheCorrupt(f"{ref}: wrote {os.fstat(raw.fileno()).st_size} bytes, expected {size}")
                final = self._blob_path(sha)
                blob = Blob(sha, size, final, b3)
                download.verify(blob)  # streams may finish now; the fsync is the cache's own business
                os.fsync(raw.fileno())
            final.parent.mkdir(exist_ok=True)
            with download.cond:  # readers open the file under this lock, so never between names
                os.replace(tmp, final)
                download.blob = blob
            self._write_ref(ref, sha, size, blob.blake3)
            self._verified[sha] = blob.blake3
            self._touch(sha, size)
            self._evict(keep=sha)
            download.finish(blob, None)
        except BaseException as exc:
            tmp.unlink(missing_ok=True)
            download.finish(None, exc)
        finally:
            with self._lock:
                self._inflight.pop(ref, None)
                self._finished += 1

    def _write_ref(self, ref: str, sha: str, size: int, b3: str) -> None:
        path = self._ref_path(ref)
        path.parent.mkdir(exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.root / "tmp", suffix=".ref")
        with os.fdopen(fd, "w") as f:
            json.dump({"ref": ref, "sha256": sha, "size": size, "blake3": b3}, f)
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
                self._forget(sha)
                victims.append(sha)
        for sha in victims:
            log.info("cache: evicting %s", sha[:16])
            self._blob_path(sha).unlink(missing_ok=True)

    def discard(self, sha256: str) -> None:
        """Drops a blob found to be corrupt; the next get() downloads it again."""
        log.warning("cache: dropping blob %s", sha256[:16])
        self._remove(sha256)

    def verify(self, blob: Blob) -> bool:
        """Re-hashes a cached blob (a client found its bytes wrong); drops it if it rotted."""
        if hash_file(blob.path) == blob.sha256:
            return True
        log.warning("cache blob %s no longer matches its sha256", blob.sha256[:16])
        self._remove(blob.sha256)
        return False

    def _remove(self, sha: str) -> None:
        with self._lock:
            size = self._lru.pop(sha, None)
            if size is not None:
                self.total_bytes -= size
            self._forget(sha)
        self._blob_path(sha).unlink(missing_ok=True)

    def _forget(self, sha: str) -> None:
        """Drops what is known about a blob's content (under the lock)."""
        self._verified.pop(sha, None)
        for key in [k for k in self._shard_digests if k[0] == sha]:
            del self._shard_digests[key]

    # ------------------------------------------------------------------ shard digests

    def shard_digests(self, sha256: str, shard_bytes: int, algorithm: str) -> tuple[str, ...] | None:
        """The digest (hex, by `algorithm`) of each `shard_bytes` shard of a verified blob, if recorded."""
        with self._lock:
            return self._shard_digests.get((sha256, shard_bytes, algorithm))

    def record_shard_digests(self, sha256: str, shard_bytes: int, algorithm: str, digests: tuple[str, ...]) -> None:
        """Remembers the shard digests of a blob read whole after it was verified. They are
        a function of the content, so they stay true while the blob does (dropped with it)."""
        with self._lock:
            self._shard_digests[(sha256, shard_bytes, algorithm)] = digests
            while len(self._shard_digests) > MAX_SHARD_TABLES:
                del self._shard_digests[next(iter(self._shard_digests))]

    def clear(self) -> None:
        """Drops every blob (refs then dangle and are ignored)."""
        for sha in list(self._lru):
            self._remove(sha)

    def wait_idle(self, timeout_s: float) -> bool:
        """Waits until no download is in flight (and stored); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if not self._inflight:
                    return True
            time.sleep(0.01)
        return False

    def contains(self, sha256: str) -> bool:
        return sha256 in self._lru and self._blob_path(sha256).exists()

    def partial_files(self) -> list[Path]:
        return sorted((self.root / "tmp").glob("*.part"))
