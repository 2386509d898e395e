"""Faults: the object store dies mid-fetch (and comes back, or not), the client's stream is
cut, a cached blob rots, shards lie. These tests own a SeaweedFS they may kill."""
from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
from pathlib import Path
from typing import Iterator

import blake3
import grpc
import pytest

from adapter_store.client import AdapterStoreClient, StoreError, _FetchState
from adapter_store.push import push_adapter
from adapter_store.records import FileEntry, Manifest, AdapterInfo, adapter_digest
from adapter_store.s3 import S3Store
from adapter_store.samples import sized_adapter
from adapter_store.seaweedfs import SeaweedFS
from adapter_store.server import BackgroundStore
from adapter_store.shard_wire import decode_shard
from google.protobuf.message import DecodeError
from store_servers import new_bucket, start_store
from lora.v1 import adapter_store_pb2 as pb
from tcp_proxy import CuttingProxy

WEIGHTS = "adapter_model.safetensors"


@pytest.fixture(scope="module")
def fragile(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedFS]:
    server = SeaweedFS(tmp_path_factory.mktemp("fragile-seaweedfs"))
    server.start()
    yield server
    server.close()


@pytest.fixture(scope="module")
def big_adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sized_adapter(tmp_path_factory.mktemp("big") / "big", 8)


class Outage:
    """S3 chunk observer: kills SeaweedFS once a download of the weights passes a byte
    count, and optionally starts it again after a pause."""

    def __init__(self, server: SeaweedFS, after_bytes: int, restart_after_s: float | None) -> None:
        self.server, self.after_bytes, self.restart_after_s = server, after_bytes, restart_after_s
        self.armed = False
        self.killed_at = -1
        self.restarted = threading.Event()

    def __call__(self, key: str, offset: int, size: int) -> None:
        if self.armed and key.endswith(WEIGHTS) and offset >= self.after_bytes:
            self.armed = False
            self.killed_at = offset
            self.server.kill()
            if self.restart_after_s is not None:
                threading.Timer(self.restart_after_s, self._restart).start()

    def _restart(self) -> None:
        self.server.start()
        self.restarted.set()


def fragile_store(server: SeaweedFS, folder: Path, tmp_path: Path, outage: Outage | None = None) -> BackgroundStore:
    bucket = new_bucket(server)
    client = server.boto3_client(retries={"max_attempts": 1}, connect_timeout=1, read_timeout=3)
    push_adapter(folder, "big", S3Store(bucket, client), "adapters/", progress=False)
    s3 = S3Store(bucket, client, range_bytes=1 << 20, chunk_bytes=256 << 10, on_chunk=outage)
    return start_store(server, bucket, tmp_path / "cache", s3=s3)


def test_s3_outage_mid_fetch_then_restart_completes(fragile: SeaweedFS, big_adapter: Path, tmp_path: Path) -> None:
    outage = Outage(fragile, after_bytes=2 << 20, restart_after_s=1.0)
    store = fragile_store(fragile, big_adapter, tmp_path, outage)
    try:
        store.cache.clear()
        outage.armed = True
        with AdapterStoreClient(store.address) as client:
            fetched = client.fetch("big", deadline_s=60)
        weights = (big_adapter / WEIGHTS).read_bytes()
        # The fetch can finish as soon as S3 answers again, before SeaweedFS.start() (which
        # waits for every component) has returned in the restart thread: wait for it.
        assert 0 < outage.killed_at < len(weights) and outage.restarted.wait(30)
        assert bytes(fetched.weights) == weights
        assert store.metrics.value("adapter_store_s3_retries_total") > 0
        assert store.cache.wait_idle(10)  # the stream ends once the bytes are verified; storing follows
        assert store.cache.partial_files() == []
        assert store.cache.contains(hashlib.sha256(weights).hexdigest())
    finally:
        store.stop()
        outage.restarted.wait(30)


def test_s3_outage_past_deadline_is_unavailable_and_leaves_no_partial(fragile: SeaweedFS, big_adapter: Path,
                                                                      tmp_path: Path) -> None:
    outage = Outage(fragile, after_bytes=1 << 20, restart_after_s=None)
    store = fragile_store(fragile, big_adapter, tmp_path, outage)
    weights = (big_adapter / WEIGHTS).read_bytes()
    weights_sha = hashlib.sha256(weights).hexdigest()
    try:
        store.cache.clear()
        outage.armed = True
        started = time.monotonic()
        with AdapterStoreClient(store.address) as client:
            with pytest.raises(StoreError) as info:
                client.fetch("big", deadline_s=4)
            elapsed = time.monotonic() - started
            assert info.value.code == grpc.StatusCode.UNAVAILABLE
            assert 2.5 < elapsed < 8, elapsed
            assert outage.killed_at > 0
            # nothing half-written is in the cache, and nothing partial will be served
            wait_until = time.monotonic() + 10
            while store.cache.partial_files() and time.monotonic() < wait_until:
                time.sleep(0.1)
            assert store.cache.partial_files() == []
            assert not store.cache.contains(weights_sha)
            assert store.catalog.get("big").info.valid  # the catalog kept it through the outage
            fragile.start()
            fetched = client.fetch("big", deadline_s=60)
            assert bytes(fetched.weights) == weights
            assert store.cache.wait_idle(10)  # the stream ends once the bytes are verified; storing follows
            assert store.cache.contains(weights_sha)
    finally:
        store.stop()
        fragile.start()


def test_client_resumes_a_cut_stream_from_its_offset(fragile: SeaweedFS, big_adapter: Path, tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    store = fragile_store(fragile, big_adapter, tmp_path)
    proxy = CuttingProxy(int(store.address.rsplit(":", 1)[1]), cut_after_bytes=6 << 20)  # 4 MiB shards
    caplog.set_level(logging.INFO, logger="adapter_store")
    try:
        with AdapterStoreClient(proxy.address) as client:
            fetched = client.fetch("big", deadline_s=60)
        assert bytes(fetched.weights) == (big_adapter / WEIGHTS).read_bytes()
        assert proxy.cuts == 1
        resumed = [m for m in caplog.messages if re.search(r"fetch big@\w+: \d+ bytes from file 1 offset [1-9]", m)]
        assert resumed, caplog.messages  # resumed mid-file, not restarted from zero
    finally:
        proxy.close()
        store.stop()


def test_rotten_cache_blob_is_detected_and_healed_within_the_fetch(fragile: SeaweedFS, big_adapter: Path,
                                                                  tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    store = fragile_store(fragile, big_adapter, tmp_path)
    weights = (big_adapter / WEIGHTS).read_bytes()
    caplog.set_level(logging.INFO)
    try:
        with AdapterStoreClient(store.address) as client:
            assert bytes(client.fetch("big", deadline_s=60).weights) == weights  # shard digests recorded
        assert store.cache.wait_idle(10)
        digest = hashlib.sha256(weights).hexdigest()
        blob = store.cache.root / "blobs" / digest[:2] / digest
        with open(blob, "r+b") as f:  # flip one byte in place, as a bad disk would
            f.seek(len(weights) // 2)
            byte = f.read(1)
            f.seek(len(weights) // 2)
            f.write(bytes([byte[0] ^ 0xFF]))
        misses = store.metrics.value("adapter_store_cache_misses_total")
        with AdapterStoreClient(store.address) as client:
            assert bytes(client.fetch("big", deadline_s=60).weights) == weights
        # The client caught the bad file, asked again with verify; the store re-hashed its
        # copy, dropped it and downloaded it again from S3.
        assert any("fetching file 1 again, verified by the store" in m for m in caplog.messages), caplog.messages
        assert any("rotted in the disk cache" in m for m in caplog.messages), caplog.messages
        assert store.metrics.value("adapter_store_cache_misses_total") == misses + 1
        assert store.cache.wait_idle(10)  # the healed copy is stored after the stream ends
        assert hashlib.sha256(blob.read_bytes()).hexdigest() == digest
    finally:
        store.stop()


def test_a_store_that_keeps_sending_bad_bytes_is_data_loss(fragile: SeaweedFS, big_adapter: Path,
                                                          tmp_path: Path) -> None:
    store = fragile_store(fragile, big_adapter, tmp_path)
    real_send = store.store.service._send_file

    async def corrupting(context, entry, index, reader, offset, shard_bytes, manifest, **kw):
        original = reader.read
        reader.read = lambda at, n: bytes(b ^ 0xFF for b in original(at, n)[:1]) + original(at, n)[1:]
        try:
            return await real_send(context, entry, index, reader, offset, shard_bytes, manifest, **kw)
        finally:
            reader.read = original

    store.store.service._send_file = corrupting  # bytes go bad after the store hashed its copy
    try:
        with AdapterStoreClient(store.address) as client:
            with pytest.raises(StoreError) as info:
                client.fetch("big", deadline_s=30)
        assert info.value.code == grpc.StatusCode.DATA_LOSS and "the manifest says" in info.value.details
    finally:
        store.stop()


def _manifest(data: bytes) -> Manifest:
    files = (FileEntry("adapter_config.json", 2, hashlib.sha256(b"{}").hexdigest()),
             FileEntry(WEIGHTS, len(data), hashlib.sha256(data).hexdigest()))
    digest = adapter_digest(f.sha256 for f in files)
    return Manifest(AdapterInfo("x", digest[:16], valid=True), "{}", files, digest)


def _shard(m: Manifest, index: int, offset: int, data: bytes, **kw) -> pb.AdapterShard:
    f = m.files[index]
    return pb.AdapterShard(file_index=index, path=f.path, offset=offset, data=data, file_size=f.size,
                           sha256=kw.pop("sha256", hashlib.sha256(data).hexdigest()), **kw)


def test_client_verifies_shards_files_and_adapter() -> None:
    data = bytes(range(256)) * 8
    manifest = _manifest(data)
    good = [_shard(manifest, 0, 0, b"{}", manifest=manifest.to_proto()), _shard(manifest, 1, 0, data[:1000]),
            _shard(manifest, 1, 1000, data[1000:], last=True, adapter_sha256=manifest.adapter_sha256)]
    state = _FetchState("x", "")
    for s in good:
        state.accept(s)
    assert state.done and bytes(state.result().weights) == data

    def lying(shards) -> StoreError:
        state = _FetchState("x", "")
        with pytest.raises(StoreError) as info:
            for s in shards:
                state.accept(s)
            state.settle()  # digests are checked on worker threads: wait for their verdict
        state.close()
        assert info.value.code == grpc.StatusCode.DATA_LOSS
        return info.value

    assert "sha256 mismatch" in str(lying([good[0], _shard(manifest, 1, 0, data[:1000], sha256="0" * 64)]))
    corrupt = bytearray(data[1000:])
    corrupt[5] ^= 1  # consistent shard checksum, wrong file content
    assert "manifest says" in str(lying(good[:2] + [_shard(manifest, 1, 1000, bytes(corrupt), last=True,
                                                            adapter_sha256=manifest.adapter_sha256)]))
    assert "offset" in str(lying([good[0], good[2]]))  # a gap
    assert "adapter sha256" in str(lying(good[:2] + [_shard(manifest, 1, 1000, data[1000:], last=True,
                                                              adapter_sha256="f" * 64)]))


def test_client_checks_files_by_blake3_when_the_manifest_lists_it() -> None:
    """With BLAKE3 in the manifest, files are checked by it (a wrong BLAKE3 fails bytes whose
    sha256 matches); without one (an older store's manifest), by sha256."""
    data = bytes(range(256)) * 8
    plain = _manifest(data)
    files = tuple(FileEntry(f.path, f.size, f.sha256, blake3.blake3(b).hexdigest())
                  for f, b in zip(plain.files, (b"{}", data)))
    manifest = Manifest(plain.info, plain.config_json, files, plain.adapter_sha256)

    def fetch(m: Manifest, weights: bytes) -> StoreError | None:
        state = _FetchState("x", "")
        shards = [_shard(m, 0, 0, b"{}", manifest=m.to_proto()),
                  _shard(m, 1, 0, weights, last=True, adapter_sha256=m.adapter_sha256)]
        try:
            for s in shards:
                state.accept(s)
            state.settle()
            return None if bytes(state.result().weights) == data else StoreError(grpc.StatusCode.DATA_LOSS, "bytes")
        except StoreError as exc:
            return exc
        finally:
            state.close()

    corrupt = bytearray(data)
    corrupt[100] ^= 1
    assert fetch(manifest, data) is None and fetch(plain, data) is None
    error = fetch(manifest, bytes(corrupt))
    assert error is not None and error.code == grpc.StatusCode.DATA_LOSS and "has blake3" in error.details
    error = fetch(plain, bytes(corrupt))
    assert error is not None and "has sha256" in error.details
    wrong_blake3 = Manifest(plain.info, plain.config_json,
                            (files[0], FileEntry(WEIGHTS, len(data), files[1].sha256, "0" * 64)), plain.adapter_sha256)
    assert "has blake3" in fetch(wrong_blake3, data).details


@pytest.mark.parametrize("size", [0, 1, 127, 128, 16383, 16384, (4 << 20) + 7])
def test_encoded_shards_parse_as_protobuf_writes_them(size: int) -> None:
    from adapter_store.server import encode_shard

    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    fields = dict(file_index=1, path=WEIGHTS, offset=size, sha256=hashlib.sha256(data).hexdigest(), file_size=size,
                  last=True, adapter_sha256="f" * 64)
    wire = encode_shard(pb.AdapterShard(**fields), data)
    assert pb.AdapterShard.FromString(wire) == pb.AdapterShard(data=data, **fields)
    header, view = decode_shard(wire)
    assert header == pb.AdapterShard(**fields) and bytes(view) == data


def test_decoded_shards_match_protobuf_in_any_field_order() -> None:
    """The node reads shards with decode_shard: whatever protobuf itself writes (data in
    the middle, a manifest, a repeated data field: the last wins) decodes to the same
    message, and bytes protobuf rejects are rejected."""
    data = bytes(range(256)) * 40
    manifest = _manifest(data)
    full = pb.AdapterShard(file_index=1, path=WEIGHTS, offset=7, data=data, sha256="a" * 64, file_size=-1,
                           manifest=manifest.to_proto(), last=True)
    wire = full.SerializeToString()
    repeated = pb.AdapterShard(data=b"first").SerializeToString() + wire
    for raw in (wire, repeated, pb.AdapterShard(path="p").SerializeToString(), b""):
        header, view = decode_shard(raw)
        expected = pb.AdapterShard.FromString(raw)
        assert bytes(view) == expected.data
        expected.ClearField("data")
        assert header == expected
    for broken in (wire[:-1], wire[:3], b"\x22\xff"):
        with pytest.raises(DecodeError):
            pb.AdapterShard.FromString(broken)
        with pytest.raises(DecodeError):
            decode_shard(broken)


def test_client_checks_shards_by_blake3_when_the_store_sends_it() -> None:
    """A shard's BLAKE3 (the store answering blake3_shards) is what a resume checks the
    bytes before it by; a shard from an older store carries only its sha256, checked instead."""
    data = bytes(range(256)) * 8
    manifest = _manifest(data)
    first = _shard(manifest, 0, 0, b"{}", manifest=manifest.to_proto())

    def settle(shard: pb.AdapterShard) -> StoreError | None:
        state = _FetchState("x", "")
        try:
            state.accept(first)
            state.accept(shard)
            state.settle()  # a stream that broke here: the bytes so far must prove out
            return None
        except StoreError as exc:
            return exc
        finally:
            state.close()

    head = data[:1000]
    assert settle(_shard(manifest, 1, 0, head, sha256="", blake3=blake3.blake3(head).hexdigest())) is None
    error = settle(_shard(manifest, 1, 0, head, sha256="", blake3="0" * 64))
    assert error is not None and error.code == grpc.StatusCode.DATA_LOSS and "blake3 mismatch" in error.details
    # BLAKE3 wins when both are set: a right sha256 does not save a wrong BLAKE3
    assert "blake3 mismatch" in settle(_shard(manifest, 1, 0, head, blake3="0" * 64)).details
    assert settle(_shard(manifest, 1, 0, head)) is None  # an older store: sha256 only
    assert "sha256 mismatch" in settle(_shard(manifest, 1, 0, head, sha256="0" * 64)).details


def test_client_asks_for_blake3_shards() -> None:
    """The request the client sends sets blake3_shards (an older store ignores it)."""
    sent: list[pb.FetchAdapterRequest] = []
    data = b"{}"
    files = (FileEntry("adapter_config.json", 2, hashlib.sha256(data).hexdigest()),)
    digest = adapter_digest(f.sha256 for f in files)
    manifest = Manifest(AdapterInfo("x", digest[:16], valid=True), "{}", files, digest)

    class Call:
        def __init__(self, request: pb.FetchAdapterRequest) -> None:
            sent.append(request)

        def __iter__(self):
            shard = pb.AdapterShard(file_index=0, path=files[0].path, offset=0, file_size=2, last=True,
                                    sha256=files[0].sha256, manifest=manifest.to_proto(), adapter_sha256=digest)
            yield shard, memoryview(data)

        def cancel(self) -> None:
            pass

    client = AdapterStoreClient("127.0.0.1:1")
    client._fetch_stream = lambda request, **kw: Call(request)
    try:
        assert bytes(client.fetch("x", deadline_s=5).files["adapter_config.json"]) == data
    finally:
        client.close()
    assert len(sent) == 1 and sent[0].blake3_shards
