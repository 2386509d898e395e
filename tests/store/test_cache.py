"""The disk cache on its own: single flight, atomic fills, LRU bound, recovery."""
from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from pathlib import Path

import blake3
import pytest

from adapter_store.cache import Blob, BlobReader, CacheCorrupt, DiskCache, _Download


def filler(data: bytes, calls: list[int], delay: float = 0.0):
    def fill(out) -> tuple[str, int]:
        calls.append(1)
        time.sleep(delay)
        for i in range(0, len(data), 1000):
            out.write(data[i:i + 1000])
        return hashlib.sha256(data).hexdigest(), len(data)
    return fill


def test_concurrent_gets_share_one_download(tmp_path: Path) -> None:
    cache = DiskCache(tmp_path, 1 << 20)
    data, calls, results = os.urandom(50_000), [], []
    threads = [threading.Thread(target=lambda: results.append(cache.get("b/k#e", filler(data, calls, 0.3))))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert len({r.path for r in results}) == 1 and results[0].path.read_bytes() == data
    assert cache.get("b/k#e", filler(data, calls)).sha256 == hashlib.sha256(data).hexdigest()
    assert len(calls) == 1  # a hit


def test_a_download_that_ends_during_a_lookup_is_not_started_again(tmp_path: Path) -> None:
    """The race a small file hits: one caller's lookup misses, and before it can start the
    download another caller's whole download of the same ref starts and ends. The first
    caller must then find the blob, not download it a second time."""
    cache = DiskCache(tmp_path, 1 << 20)
    data, calls = os.urandom(500), []
    lookup, raced = cache.lookup, []

    def lookup_raced_by_another_caller(ref: str):
        blob = lookup(ref)
        if not raced:
            raced.append(1)
            cache.get(ref, filler(data, calls))  # starts and finishes in between
        return blob

    cache.lookup = lookup_raced_by_another_caller
    blob = cache.get("b/config#e", filler(data, calls))
    assert raced and len(calls) == 1
    assert blob.path.read_bytes() == data


def test_failed_fill_leaves_nothing_and_reaches_every_waiter(tmp_path: Path) -> None:
    cache = DiskCache(tmp_path, 1 << 20)
    errors: list[BaseException] = []

    def broken(out) -> tuple[str, int]:
        out.write(b"half of it")
        time.sleep(0.2)
        raise ConnectionError("store went away")

    def get() -> None:
        try:
            cache.get("b/k#e", broken)
        except ConnectionError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=get) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == 4
    assert cache.lookup("b/k#e") is None and cache.partial_files() == []
    assert list((tmp_path / "blobs").rglob("*")) == []


def test_expected_sha_mismatch_is_not_cached(tmp_path: Path) -> None:
    cache = DiskCache(tmp_path, 1 << 20)
    with pytest.raises(CacheCorrupt):
        cache.get("b/k#e", filler(b"abc", []), expected_sha256="0" * 64)
    assert cache.lookup("b/k#e") is None and cache.total_bytes == 0


def test_lru_bound(tmp_path: Path) -> None:
    cache = DiskCache(tmp_path, 25_000)
    blobs = {}
    for i in range(3):
        blobs[i] = cache.get(f"b/{i}#e", filler(os.urandom(10_000), []))
        time.sleep(0.01)
    # 30 kB > 25 kB: the oldest went
    assert not blobs[0].path.exists() and blobs[1].path.exists() and blobs[2].path.exists()
    cache.get("b/1#e", filler(b"", []))  # use 1, so 2 is now the oldest
    cache.get("b/3#e", filler(os.urandom(10_000), []))
    assert blobs[1].path.exists() and not blobs[2].path.exists()
    assert cache.total_bytes <= 25_000


def test_restart_drops_partials_and_rehashes(tmp_path: Path) -> None:
    cache = DiskCache(tmp_path, 1 << 20)
    good = cache.get("b/good#e", filler(b"good bytes", []))
    bad = cache.get("b/bad#e", filler(b"will rot", []))
    (tmp_path / "tmp" / "crashed.part").write_bytes(b"partial")
    bad.path.write_bytes(b"rotten!!")  # same size, other bytes
    again = DiskCache(tmp_path, 1 << 20)
    assert again.partial_files() == []
    assert again.lookup("b/good#e") == good
    assert again.lookup("b/bad#e") is None and not bad.path.exists()


def test_blobs_carry_their_blake3_also_from_refs_written_without_it(tmp_path: Path) -> None:
    """The BLAKE3 the manifests carry: computed as a blob is written, kept in its ref, and
    computed when a blob whose ref predates it is re-hashed at first use (the ref rewritten)."""
    data = os.urandom(30_000)
    blob = DiskCache(tmp_path, 1 << 20).get("b/k#e", filler(data, []))
    assert blob.blake3 == blake3.blake3(data).hexdigest() and blob.sha256 == hashlib.sha256(data).hexdigest()
    assert DiskCache(tmp_path, 1 << 20).lookup("b/k#e") == blob
    ref = next((tmp_path / "refs").glob("*/*.json"))
    doc = json.loads(ref.read_text())
    del doc["blake3"]
    ref.write_text(json.dumps(doc))
    assert DiskCache(tmp_path, 1 << 20).lookup("b/k#e") == blob
    assert json.loads(ref.read_text())["blake3"] == blob.blake3


def unhashed_filler(data: bytes):
    """A filler that leaves the proof to the cache's expected BLAKE3 (as S3 downloads of
    cataloged files do)."""
    def fill(out) -> tuple[str, int]:
        out.write(data)
        return "", len(data)
    return fill


def test_an_expected_blake3_proves_an_unhashed_download(tmp_path: Path) -> None:
    cache = DiskCache(tmp_path, 1 << 20)
    data = os.urandom(20_000)
    sha, b3 = hashlib.sha256(data).hexdigest(), blake3.blake3(data).hexdigest()
    blob = cache.get("b/k#e", unhashed_filler(data), expected_sha256=sha, expected_blake3=b3)
    assert blob.sha256 == sha and blob.blake3 == b3 and blob.path.read_bytes() == data
    assert DiskCache(tmp_path, 1 << 20).lookup("b/k#e") == blob  # re-hashed at restart: it holds


def test_a_download_that_misses_its_expected_blake3_is_refused_and_not_cached(tmp_path: Path) -> None:
    cache = DiskCache(tmp_path, 1 << 20)
    data = os.urandom(20_000)
    sha, b3 = hashlib.sha256(data).hexdigest(), blake3.blake3(data).hexdigest()
    rotten = bytearray(data)
    rotten[777] ^= 1
    with pytest.raises(CacheCorrupt, match="BLAKE3"):
        cache.get("b/k#e", unhashed_filler(bytes(rotten)), expected_sha256=sha, expected_blake3=b3)
    # a filler's sha256, when it computes one, is checked as well
    with pytest.raises(CacheCorrupt, match="sha256"):
        cache.get("b/k2#e", filler(data, []), expected_sha256="0" * 64, expected_blake3=b3)
    # nothing hashed and nothing to check it by: refused, never named by a guess
    with pytest.raises(ValueError, match="hashed nothing"):
        cache.get("b/k3#e", unhashed_filler(data), expected_sha256=sha)
    assert cache.wait_idle(10)
    assert all(cache.lookup(f"b/{k}#e") is None for k in ("k", "k2", "k3"))
    assert cache.total_bytes == 0 and cache.partial_files() == []


def test_a_reader_joining_a_failing_download_gets_its_error(tmp_path: Path) -> None:
    """A download that fails removes its partial file, then reports: a caller that joins it
    in between hears the download's error, never FileNotFoundError of the removed file."""
    cache = DiskCache(tmp_path, 1 << 20)
    seen: list[str] = []

    def broken(out) -> tuple[str, int]:
        out.write(b"x")
        raise ConnectionError("store went away")

    def get_many() -> None:
        for _ in range(200):
            try:
                cache.get("b/k#e", broken)
            except Exception as exc:
                seen.append(type(exc).__name__)

    threads = [threading.Thread(target=get_many) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == ["ConnectionError"] * 600
    assert cache.partial_files() == []


def test_a_reader_joining_a_download_just_renamed_opens_the_blob(tmp_path: Path) -> None:
    """Between the rename of a download's file into blobs/ and its end, a joining reader opens
    the blob by its new name (the partial file no longer exists), and reads it whole."""
    download = _Download(tmp_path / "gone.part")
    final = tmp_path / "blob"
    final.write_bytes(b"weights")
    download.blob = Blob(hashlib.sha256(b"weights").hexdigest(), 7, final, "")  # renamed, not done
    with BlobReader.of_download(download, timeout_s=1) as reader:
        download.finish(download.blob, None)
        assert reader.read(0, 7) == b"weights"
