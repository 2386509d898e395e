"""An adapter's files read straight from the object store, by the read plan the adapter
store hands out (GetReadPlan): presigned GETs pinned to the object versions the store
validated, beside the BLAKE3 it recorded of their bytes.

Each file is cut into ranges fetched by parallel GETs (urllib3, connections kept open)
straight into the one buffer the streaming path would fill (same layout: file_offsets),
while this thread hashes the ranges in order as they complete. Nothing here trusts the
plan beyond what it can check: the URLs must be http(s), the sizes are the manifest's and
each response must say it carries exactly the range asked of an object of that size, and
every file must match its BLAKE3 before the adapter is returned. Any failure raises
DirectReadFailed, whose message never holds a URL (they are credentials): the caller then
streams the adapter from the store.
"""
from __future__ import annotations

import re
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import blake3
import urllib3
from urllib3.exceptions import HTTPError, LocationParseError

from adapter_store.client import FetchedAdapter, ReadPlan, adapter_digest, file_offsets

Allocate = Callable[[int], Any]  # nbytes -> a writable buffer
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+)")
_BLAKE3_HEX = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class DirectReadSettings:
    connections: int = 4          # GETs in flight at once (and connections kept open)
    range_bytes: int = 16 << 20   # bytes per GET
    read_bytes: int = 4 << 20     # bytes per read of a response (a cancelled read stops between them)
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 20.0  # without a byte arriving


class DirectReadFailed(Exception):
    """The plan could not be read or its bytes failed their checks (the message names the
    file and the cause, never the URL)."""


@dataclass(frozen=True)
class _Range:
    file_index: int
    start: int
    end: int  # exclusive


class DirectReader:
    """Reads read plans; one per node (its connection pool and workers are reused)."""

    def __init__(self, settings: DirectReadSettings = DirectReadSettings()) -> None:
        self.settings = settings
        self.http = urllib3.PoolManager(
            num_pools=4, maxsize=settings.connections, retries=False,
            timeout=urllib3.Timeout(connect=settings.connect_timeout_s, read=settings.read_timeout_s))
        self.workers = ThreadPoolExecutor(settings.connections, thread_name_prefix="direct-read")

    def close(self) -> None:
        self.workers.shutdown(wait=False, cancel_futures=True)
        self.http.clear()

    def read(self, plan: ReadPlan, allocate: Allocate, version: str = "") -> FetchedAdapter:
        """The plan's files in one buffer from `allocate`, each verified against its BLAKE3.
        `version`, when given, is the one the plan must be for."""
        manifest = plan.manifest
        name = manifest.info.name
        self._check(plan, version)
        offsets = file_offsets(manifest)
        total = offsets[-1] + manifest.files[-1].size
        buffer = allocate(total)
        whole = memoryview(buffer).cast("B")
        if len(whole) != total:
            raise ValueError(f"allocate({total}) returned {len(whole)} bytes")
        views = [whole[start:start + f.size] for start, f in zip(offsets, manifest.files)]
        ranges = [_Range(i, start, min(start + self.settings.range_bytes, f.size))
                  for i, f in enumerate(manifest.files) for start in range(0, f.size, self.settings.range_bytes)]
        cancel = threading.Event()
        pending: deque[tuple[_Range, Future]] = deque(
            (r, self.workers.submit(self._get, plan, r, views[r.file_index], cancel)) for r in ranges)
        hashers = [blake3.blake3() for _ in manifest.files]
        try:
            while pending:  # hashed in order as they complete, while later ranges download
                part, future = pending.popleft()
                future.result()
                hashers[part.file_index].update(views[part.file_index][part.start:part.end])
        except BaseException:
            cancel.set()
            for _, future in pending:  # no worker writes into the buffer once this returns
                future.cancel()
            for _, future in pending:
                if not future.cancelled():
                    future.exception()
            raise
        for entry, hasher in zip(manifest.files, hashers):
            if hasher.hexdigest() != entry.blake3:
                raise DirectReadFailed(f"adapter {name!r}: {entry.path} from the object store has BLAKE3 "
                                       f"{hasher.hexdigest()}, the store's catalog says {entry.blake3}")
        return FetchedAdapter(manifest, {f.path: view for f, view in zip(manifest.files, views)}, buffer,
                              {f.path: start for f, start in zip(manifest.files, offsets)})

    @staticmethod
    def _check(plan: ReadPlan, version: str) -> None:
        """What the plan must be before any byte is read: one http(s) URL per manifest file,
        every file with a BLAKE3, and a manifest consistent with itself."""
        manifest = plan.manifest
        name = manifest.info.name
        if not manifest.files or len(plan.files) != len(manifest.files):
            raise DirectReadFailed(f"adapter {name!r}: the plan has {len(plan.files)} URLs for "
                                   f"{len(manifest.files)} files")
        if version and manifest.info.version != version:
            raise DirectReadFailed(f"adapter {name!r}: the plan is for version {manifest.info.version}, "
                                   f"not {version}")
        if adapter_digest(f.sha256 for f in manifest.files) != manifest.adapter_sha256:
            raise DirectReadFailed(f"adapter {name!r}: the plan's manifest does not match its own digest")
        for entry, read in zip(manifest.files, plan.files):
            if entry.size < 0 or not _BLAKE3_HEX.fullmatch(entry.blake3):
                raise DirectReadFailed(f"adapter {name!r}: {entry.path} has no size or BLAKE3 to check it by")
            try:
                url = urllib3.util.parse_url(read.url)
            except LocationParseError:
                url = None
            if url is None or url.scheme not in ("http", "https") or not url.host:
                raise DirectReadFailed(f"adapter {name!r}: the URL of {entry.path} is not an http(s) URL")
            if any(c in read.if_match for c in "\r\n"):
                raise DirectReadFailed(f"adapter {name!r}: the If-Match of {entry.path} is not a header value")

    def _get(self, plan: ReadPlan, part: _Range, view: memoryview, cancel: threading.Event) -> None:
        """One ranged GET into its place in `view` (on a worker thread)."""
        entry = plan.manifest.files[part.file_index]
        where = f"adapter {plan.manifest.info.name!r}: {entry.path} bytes {part.start}-{part.end - 1}"
        if cancel.is_set():
            raise DirectReadFailed(f"{where}: cancelled")
        headers = {"Range": f"bytes={part.start}-{part.end - 1}"}
        if plan.files[part.file_index].if_match:
            headers["If-Match"] = plan.files[part.file_index].if_match
        try:
            response = self.http.request("GET", plan.files[part.file_index].url, headers=headers,
                                         preload_content=False, decode_content=False, redirect=False)
        except (HTTPError, OSError) as exc:  # its text may hold the URL: only its kind is told
            raise DirectReadFailed(f"{where}: {type(exc).__name__} reaching the object store") from None
        complete = False
        try:
            self._check_response(response, part, entry.size, where)
            target = view[part.start:part.end]
            got, step = 0, self.settings.read_bytes
            while got < len(target):
                if cancel.is_set():
                    raise DirectReadFailed(f"{where}: cancelled")
                n = response.readinto(target[got:got + step])
                if not n:
                    raise DirectReadFailed(f"{where}: the response ended after {got} bytes")
                got += n
            complete = True
        except (HTTPError, OSError) as exc:
            raise DirectReadFailed(f"{where}: {type(exc).__name__} while reading") from None
        finally:
            if complete:
                response.release_conn()  # kept open for the next GET
            else:
                response.close()  # what is left of its body is never read: the connection goes

    @staticmethod
    def _check_response(response: urllib3.BaseHTTPResponse, part: _Range, size: int, where: str) -> None:
        """The response carries exactly the range asked, of an object of the manifest's size."""
        status = response.status
        if status == 206:
            match = _CONTENT_RANGE.fullmatch(response.headers.get("Content-Range", "").strip())
            if match is None or tuple(int(g) for g in match.groups()) != (part.start, part.end - 1, size):
                raise DirectReadFailed(f"{where}: the object store sent Content-Range "
                                       f"{response.headers.get('Content-Range', '')[:80]!r}, expected "
                                       f"'bytes {part.start}-{part.end - 1}/{size}'")
        elif status == 200 and part.start == 0 and part.end == size:
            pass  # the whole object, its range ignored: its length is checked below
        else:
            cause = {403: " (the URL expired or its signature was refused)",
                     412: " (the object changed since the store validated it)",
                     404: " (the object is gone)"}.get(status, "")
            raise DirectReadFailed(f"{where}: HTTP {status}{cause}")
        length = response.headers.get("Content-Length")
        if length is not None and length.strip() != str(part.end - part.start):
            raise DirectReadFailed(f"{where}: the object store sent {length[:20]} bytes, expected "
                                   f"{part.end - part.start}")
