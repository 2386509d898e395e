"""The node's disk tier on its own: verified reads, LRU bound that survives restarts, atomic
writes, one version per name, names and manifests treated as untrusted, and every chunk of a
read checked against the digests written with the entry (or an older entry checked whole)."""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pytest

from adapter_store.records import FILE_ALIGN, AdapterInfo, FileEntry, Manifest, adapter_digest, file_offsets
from inference_node.adapters import disk_tier
from inference_node.adapters.disk_tier import CHUNKS_FILE, MANIFEST_FILE, DiskCorrupt, DiskTier, DiskTierInUse
from lora_common.names import InvalidName


def adapter(name: str, weights: bytes, updated_at: int = 1, config: bytes = b'{"r": 4}') -> tuple[Manifest, list[bytes]]:
    files = (FileEntry("adapter_config.json", len(config), hashlib.sha256(config).hexdigest()),
             FileEntry("adapter_model.safetensors", len(weights), hashlib.sha256(weights).hexdigest()))
    digest = adapter_digest(f.sha256 for f in files)
    info = AdapterInfo(name, digest[:16], rank=4, valid=True, size_bytes=len(config) + len(weights),
                       updated_at=updated_at)
    return Manifest(info, config.decode(), files, digest), [config, weights]


def read_back(tier: DiskTier, name: str, version: str = "") -> list[bytes]:
    entry = tier.lookup(name, version)
    assert entry is not None
    buffer, offsets = tier.read(entry, bytearray)
    assert all(o % FILE_ALIGN == 0 for o in offsets)
    return [bytes(buffer[o:o + f.size]) for o, f in zip(offsets, entry.manifest.files)]


def test_roundtrip_and_restart(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 20)
    manifest, files = adapter("alpha", os.urandom(5000))
    assert tier.put(manifest, files)
    assert read_back(tier, "alpha") == files == read_back(tier, "alpha", manifest.info.version)
    assert tier.lookup("alpha", "0" * 16) is None and tier.lookup("beta") is None
    tier.close()
    restarted = DiskTier(tmp_path, 1 << 20)
    assert [(e.name, e.version) for e in restarted.entries()] == [("alpha", manifest.info.version)]
    assert read_back(restarted, "alpha") == files
    # Neither the name nor the manifest's paths become paths: the entry is its sha256, files their index.
    folder = tmp_path / manifest.adapter_sha256
    assert sorted(p.name for p in folder.iterdir()) == ["0", "1", CHUNKS_FILE, MANIFEST_FILE]


def test_lru_bound_and_its_order_survive_a_restart(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 10_000)
    put = {}
    for name in ("a", "b", "c"):
        put[name] = adapter(name, os.urandom(3000))
        assert tier.put(*put[name])
        time.sleep(0.02)  # distinct mtimes
    read_back(tier, "a")  # a is now the most recently used
    assert tier.total_bytes <= 10_000
    tier.close()
    restarted = DiskTier(tmp_path, 10_000)
    assert restarted.put(*adapter("d", os.urandom(3000)))  # one must go: b, the least recently used
    assert {e.name for e in restarted.entries()} == {"a", "c", "d"}
    assert not (tmp_path / put["b"][0].adapter_sha256).exists()
    restarted.close()
    smaller = DiskTier(tmp_path, 7_000)  # a smaller bound applies at start
    assert {e.name for e in smaller.entries()} == {"a", "d"} and smaller.total_bytes <= 7_000
    assert not smaller.put(*adapter("huge", os.urandom(8000)))  # larger than the whole tier: not kept
    assert smaller.lookup("huge") is None


def test_a_new_version_replaces_the_old(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 20)
    old, old_files = adapter("alpha", b"one" * 100, updated_at=1)
    new, new_files = adapter("alpha", b"two" * 100, updated_at=2)
    tier.put(old, old_files)
    tier.put(new, new_files)
    assert [e.version for e in tier.entries()] == [new.info.version]
    assert read_back(tier, "alpha") == new_files
    assert not (tmp_path / old.adapter_sha256).exists()


def test_rot_is_detected_and_the_entry_deleted(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 20)
    manifest, files = adapter("alpha", os.urandom(4000))
    tier.put(manifest, files)
    path = tmp_path / manifest.adapter_sha256 / "1"
    data = bytearray(path.read_bytes())
    data[1234] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(DiskCorrupt, match="does not match its sha256"):
        tier.read(tier.lookup("alpha"), bytearray)
    assert tier.lookup("alpha") is None and not path.parent.exists()
    # A truncated file is dropped when the tier starts.
    tier.put(manifest, files)
    with open(path, "r+b") as f:
        f.truncate(100)
    tier.close()
    assert DiskTier(tmp_path, 1 << 20).entries() == []


def test_writes_are_atomic_and_leftovers_are_cleared(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 20)
    manifest, files = adapter("alpha", os.urandom(4000))
    (tmp_path / "tmp" / "half-written").mkdir()  # a crash in the middle of a write
    (tmp_path / "tmp" / "half-written" / "1").write_bytes(b"partial")
    tier.put_later(manifest, files)
    tier.close()  # after the queued write
    restarted = DiskTier(tmp_path, 1 << 20)
    assert list((tmp_path / "tmp").iterdir()) == []
    assert read_back(restarted, "alpha") == files


def test_names_and_manifests_are_untrusted(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 20)
    for bad_name in ("../escape", "a/b", ".."):
        manifest, files = adapter("x", b"w" * 10)
        info = AdapterInfo(bad_name, manifest.info.version, valid=True)
        with pytest.raises(InvalidName):
            tier.put(Manifest(info, manifest.config_json, manifest.files, manifest.adapter_sha256), files)
    manifest, files = adapter("alpha", b"w" * 10)
    lying = Manifest(manifest.info, manifest.config_json, manifest.files, "f" * 64)  # digests don't add up
    with pytest.raises(ValueError):
        tier.put(lying, files)
    assert list(tmp_path.iterdir()) == [tmp_path / "tmp"]

    # On disk: foreign files and folders, a symlink, a manifest under another entry's name,
    # and one whose name is unsafe are all dropped when the tier starts.
    good, good_files = adapter("good", b"g" * 10)
    tier.put(good, good_files)
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "..evil").mkdir()
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    (outside / "keep").write_text("must survive")
    os.symlink(outside, tmp_path / ("a" * 64))
    moved = tmp_path / ("b" * 64)
    os.rename(tmp_path / good.adapter_sha256, moved)  # a manifest under a name not its own
    evil, evil_files = adapter("x", b"e" * 10)
    message = evil.to_proto()
    message.info.name = "../../etc"
    folder = tmp_path / evil.adapter_sha256
    folder.mkdir()
    (folder / MANIFEST_FILE).write_bytes(message.SerializeToString())
    for i, data in enumerate(evil_files):
        (folder / str(i)).write_bytes(data)
    garbage, garbage_files = adapter("garbage", b"x" * 10)  # a manifest that is not protobuf
    (tmp_path / garbage.adapter_sha256).mkdir()
    (tmp_path / garbage.adapter_sha256 / MANIFEST_FILE).write_bytes(b"\xff" * 64)
    linked, linked_files = adapter("linked", b"l" * 10)  # an entry file that is a link elsewhere
    tier.put(linked, linked_files)
    os.remove(tmp_path / linked.adapter_sha256 / "1")
    os.symlink(outside / "keep", tmp_path / linked.adapter_sha256 / "1")
    os.rmdir(tmp_path / "tmp")
    os.symlink(outside, tmp_path / "tmp")  # staging must never be another directory
    tier.close()
    restarted = DiskTier(tmp_path, 1 << 20)
    assert restarted.entries() == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tmp"] and not (tmp_path / "tmp").is_symlink()
    assert sorted(p.name for p in outside.iterdir()) == ["keep"] and (outside / "keep").read_text() == "must survive"


def test_a_deletion_in_the_catalog_deletes_the_disk_copy(tmp_path: Path) -> None:
    import threading
    from types import SimpleNamespace

    from adapter_store.records import DELETED
    from inference_node.adapters.store_source import CatalogWatcher

    tier = DiskTier(tmp_path, 1 << 20)
    for name in ("gone", "kept"):
        tier.put(*adapter(name, name.encode() * 100))

    class Catalog:
        def watch(self, reconnect: bool, stop: threading.Event):
            yield SimpleNamespace(kind=DELETED, adapter=SimpleNamespace(name="gone", version=""))
            stop.wait()

    deleted = threading.Event()
    watcher = CatalogWatcher(Catalog(), post=lambda fn: fn(), on_update=lambda name, version: None,
                             on_delete=lambda name: deleted.set(), disk=tier)
    watcher.start()
    try:
        assert deleted.wait(10)
    finally:
        watcher.stop()
        watcher.thread.join(5)
    assert [e.name for e in tier.entries()] == ["kept"]
    assert [p.name for p in tmp_path.iterdir() if p.name != "tmp"] == [tier.lookup("kept").sha256]


# -- chunk digests: parallel reads, each chunk checked ---------------------------------------------
SMALL_CHUNK = 64 << 10  # the smallest a chunk digest file may claim: several chunks from small files


@pytest.fixture
def small_chunks(monkeypatch) -> None:
    monkeypatch.setattr(disk_tier, "CHUNK_BYTES", SMALL_CHUNK)


def chunked(tmp_path: Path, read_threads: int = 3) -> tuple[DiskTier, Manifest, list[bytes], Path]:
    """A tier holding an adapter whose weights span 3 full chunks and a short last one."""
    tier = DiskTier(tmp_path, 8 << 20, read_threads=read_threads)
    manifest, files = adapter("alpha", os.urandom(3 * SMALL_CHUNK + 1000))
    assert tier.put(manifest, files)
    return tier, manifest, files, tmp_path / manifest.adapter_sha256


def assert_corrupt_and_deleted(tier: DiskTier, folder: Path, match: str) -> None:
    with pytest.raises(DiskCorrupt, match=match):
        tier.read(tier.lookup("alpha"), bytearray)
    assert tier.lookup("alpha") is None and not folder.exists() and tier.total_bytes == 0


def test_chunk_digests_are_written_with_the_entry_and_reads_are_exact(tmp_path: Path, small_chunks) -> None:
    tier, manifest, files, folder = chunked(tmp_path)
    record = json.loads((folder / CHUNKS_FILE).read_text())
    weights = files[1]
    assert record["chunk_bytes"] == SMALL_CHUNK and record["adapter_sha256"] == manifest.adapter_sha256
    assert record["files"][1] == [hashlib.sha256(weights[at:at + SMALL_CHUNK]).hexdigest()
                                  for at in range(0, len(weights), SMALL_CHUNK)]
    assert len(record["files"][1]) == 4 and len(record["files"][0]) == 1
    tier.close()
    for threads in (1, 3, 8):
        again = DiskTier(tmp_path, 8 << 20, read_threads=threads)
        assert read_back(again, "alpha") == files
        again.close()


@pytest.mark.parametrize("with_digests", [True, False], ids=["chunk-digests", "older-entry"])
@pytest.mark.parametrize("damage", ["first", "middle", "last", "config", "short", "extra"])
def test_damage_anywhere_is_caught_and_the_entry_deleted(tmp_path: Path, small_chunks, damage: str,
                                                         with_digests: bool) -> None:
    tier, manifest, files, folder = chunked(tmp_path)
    if not with_digests:
        (folder / CHUNKS_FILE).unlink()
    path = folder / ("0" if damage == "config" else "1")
    data = bytearray(path.read_bytes())
    if damage == "short":
        del data[-1]
    elif damage == "extra":
        data.append(0)
    else:
        data[{"first": 5, "middle": 2 * SMALL_CHUNK + 77, "last": len(data) - 1, "config": 3}[damage]] ^= 0x01
    path.write_bytes(bytes(data))
    match = "has the wrong size" if damage in ("short", "extra") else "does not match its sha256"
    assert_corrupt_and_deleted(tier, folder, match)
    tier.flush()
    assert not folder.exists()  # no chunk digests were written for it either


@pytest.mark.parametrize("with_digests", [True, False], ids=["chunk-digests", "older-entry"])
def test_a_file_cut_short_during_the_read_is_caught(tmp_path: Path, small_chunks, monkeypatch,
                                                    with_digests: bool) -> None:
    tier, manifest, files, folder = chunked(tmp_path)
    if not with_digests:
        (folder / CHUNKS_FILE).unlink()
    real_fstat = os.fstat

    def fstat_then_truncate(fd: int):  # the size looked right, then the file shrank
        st = real_fstat(fd)
        if st.st_size == len(files[1]):
            os.truncate(folder / "1", 2 * SMALL_CHUNK + 10)
        return st

    def holding_the_right_bytes(n: int) -> bytearray:  # what a short read leaves is not taken as read
        entry_bytes = bytearray(n)
        for offset, data in zip(file_offsets(manifest), files):
            entry_bytes[offset:offset + len(data)] = data
        return entry_bytes
    monkeypatch.setattr(disk_tier.os, "fstat", fstat_then_truncate)
    with pytest.raises(DiskCorrupt, match="does not match its sha256"):
        tier.read(tier.lookup("alpha"), holding_the_right_bytes)
    assert tier.lookup("alpha") is None and not folder.exists()


def test_digests_that_do_not_match_are_caught(tmp_path: Path, small_chunks) -> None:
    tier, manifest, files, folder = chunked(tmp_path)
    record = json.loads((folder / CHUNKS_FILE).read_text())
    record["files"][1][2] = hashlib.sha256(b"something else").hexdigest()  # the data is fine, its digest not
    (folder / CHUNKS_FILE).write_text(json.dumps(record))
    assert_corrupt_and_deleted(tier, folder, "does not match its sha256")


def malformed(record: dict, how: str) -> bytes:
    if how == "not-json":
        return b"\xff{not json"
    if how == "not-an-object":
        return b"[1, 2]"
    if how == "extra-key":
        return json.dumps({**record, "trust_me": True}).encode()
    if how == "other-entry":
        return json.dumps({**record, "adapter_sha256": "e" * 64}).encode()
    if how in ("chunk-too-small", "chunk-a-bool", "chunk-a-string"):
        value = {"chunk-too-small": 4096, "chunk-a-bool": True, "chunk-a-string": "65536"}[how]
        return json.dumps({**record, "chunk_bytes": value}).encode()
    if how == "other-chunk-size":  # well formed, but not one digest per chunk of this size
        return json.dumps({**record, "chunk_bytes": 2 * SMALL_CHUNK}).encode()
    if how == "digest-missing":
        return json.dumps({**record, "files": [record["files"][0], record["files"][1][:-1]]}).encode()
    if how == "file-missing":
        return json.dumps({**record, "files": record["files"][1:]}).encode()
    if how == "not-hex":
        return json.dumps({**record, "files": [record["files"][0], ["zz" * 32] * 4]}).encode()
    if how == "empty":
        return b""
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["not-json", "not-an-object", "extra-key", "other-entry", "chunk-too-small",
                                 "chunk-a-bool", "chunk-a-string", "other-chunk-size", "digest-missing",
                                 "file-missing", "not-hex", "empty", "symlink", "folder"])
def test_unreadable_chunk_digests_are_caught(tmp_path: Path, small_chunks, how: str) -> None:
    tier, manifest, files, folder = chunked(tmp_path)
    sidecar = folder / CHUNKS_FILE
    record = json.loads(sidecar.read_text())
    if how == "symlink":  # a good record, but elsewhere: the tier reads only files it wrote
        elsewhere = tmp_path.parent / f"{tmp_path.name}-record"
        elsewhere.write_bytes(sidecar.read_bytes())
        sidecar.unlink()
        os.symlink(elsewhere, sidecar)
    elif how == "folder":
        sidecar.unlink()
        sidecar.mkdir()
    else:
        sidecar.write_bytes(malformed(record, how))
    assert_corrupt_and_deleted(tier, folder, "chunk digests on the node's disk are unreadable")


def test_an_older_entry_is_checked_whole_and_gains_its_chunk_digests(tmp_path: Path, small_chunks) -> None:
    tier, manifest, files, folder = chunked(tmp_path)
    written = (folder / CHUNKS_FILE).read_bytes()
    (folder / CHUNKS_FILE).unlink()  # as an older node left it
    tier.close()
    restarted = DiskTier(tmp_path, 8 << 20, read_threads=2)
    assert [e.name for e in restarted.entries()] == ["alpha"]
    assert read_back(restarted, "alpha") == files
    restarted.flush()
    assert (folder / CHUNKS_FILE).read_bytes() == written
    assert list((tmp_path / "tmp").iterdir()) == []
    # From now on reads check the chunks: a bad digest in the new record is caught.
    record = json.loads(written)
    record["files"][1][0] = "0" * 64
    (folder / CHUNKS_FILE).write_text(json.dumps(record))
    assert_corrupt_and_deleted(restarted, folder, "does not match its sha256")


def test_chunk_digests_are_not_added_to_an_entry_deleted_meanwhile(tmp_path: Path, small_chunks) -> None:
    tier, manifest, files, folder = chunked(tmp_path)
    (folder / CHUNKS_FILE).unlink()
    tier._writes.put(("hold the writer", lambda: time.sleep(0.3)))  # the digests queue behind this
    assert read_back(tier, "alpha") == files
    tier.remove(manifest.adapter_sha256)
    tier.flush()
    assert not folder.exists() and list((tmp_path / "tmp").iterdir()) == []


def test_put_refuses_bytes_that_are_not_the_manifests(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 20)
    manifest, files = adapter("alpha", os.urandom(4000))
    for wrong in ([files[0], files[1][:-1]], [files[0], bytes([files[1][0] ^ 1]) + files[1][1:]]):
        with pytest.raises(ValueError, match="does not match the manifest"):
            tier.put(manifest, wrong)
    assert tier.entries() == [] and sorted(p.name for p in tmp_path.iterdir()) == ["tmp"]
    assert list((tmp_path / "tmp").iterdir()) == []


def test_one_node_a_directory_and_first_free_gives_each_node_a_slot_of_its_own(tmp_path: Path) -> None:
    """A second tier on a directory in use is refused (it would wipe the first's writes in
    progress and evict by another index); nodes sharing a parent folder take a slot each,
    and a restarted node its old slot, with the adapters it kept there."""
    tier = DiskTier(tmp_path / "node", 1 << 20)
    with pytest.raises(DiskTierInUse, match="in use by another node"):
        DiskTier(tmp_path / "node", 1 << 20)
    tier.close()
    DiskTier(tmp_path / "node", 1 << 20).close()  # free again once closed

    parent = tmp_path / "default"
    first = DiskTier.first_free(parent, 1 << 20)
    second = DiskTier.first_free(parent, 1 << 20)
    assert (first.root, second.root) == (parent / "0", parent / "1")
    manifest, files = adapter("alpha", os.urandom(3000))
    first.put_later(manifest, files)
    first.close()  # the queued write lands before the folder is let go
    first.put_later(*adapter("late", b"x" * 10))  # a closed tier keeps nothing more
    restarted = DiskTier.first_free(parent, 1 << 20)
    assert restarted.root == parent / "0"
    assert [e.name for e in restarted.entries()] == ["alpha"] and read_back(restarted, "alpha") == files
    restarted.close()
    second.close()
