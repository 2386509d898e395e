"""The store against a real SeaweedFS: push, list, fetch, resume, versions, events, refusals."""
from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path
from typing import Callable

import blake3
import grpc
import pytest

from adapter_store.client import AdapterStoreClient, StoreError
from adapter_store.push import push_adapter
from adapter_store.records import ADDED, DELETED, SYNCED, UPDATED, CatalogEvent, adapter_digest
from adapter_store.s3 import S3Store
from adapter_store.samples import sized_adapter
from lora.v1 import adapter_store_pb2 as pb
from lora.v1 import adapter_store_pb2_grpc as pb_grpc
from store_corpus import BAD_ADAPTERS

FILES = ("adapter_config.json", "adapter_model.safetensors")


def push(s3: S3Store, folder: Path, name: str) -> None:
    push_adapter(folder, name, s3, "adapters/", progress=False)


def wait_for(predicate: Callable[[], object], timeout: float = 10.0, what: str = "condition") -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Watcher:
    """Collects client.watch() events on a thread."""

    def __init__(self, client: AdapterStoreClient) -> None:
        self.events: list[CatalogEvent] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(client,), daemon=True)
        self.thread.start()

    def _run(self, client: AdapterStoreClient) -> None:
        for event in client.watch(stop=self.stop):
            self.events.append(event)

    def wait(self, kind: str, name: str | None = None, timeout: float = 10.0) -> CatalogEvent:
        def found():
            return next((e for e in self.events if e.kind == kind and
                         (name is None or (e.adapter and e.adapter.name == name))), None)
        return wait_for(found, timeout, f"{kind} {name}")  # type: ignore[return-value]

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)


def test_push_list_fetch_roundtrip(s3: S3Store, make_store, adapter_dir, seaweed) -> None:
    alpha = adapter_dir("alpha", rank=8, layers=3, targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    beta = adapter_dir("beta", rank=4, targets=("gate_proj", "up_proj", "down_proj"), seed=1,
                       config_overrides={"use_rslora": True})
    push(s3, alpha, "alpha")
    # An adapter written by another tool (plain boto3, as the aws cli or a training job would)
    raw = seaweed.boto3_client()
    for f in FILES:
        raw.upload_file(str(beta / f), s3.bucket, f"adapters/beta/{f}")
    store = make_store()
    with AdapterStoreClient(store.address) as client:
        infos = {i.name: i for i in client.list_adapters()}
        assert sorted(infos) == ["alpha", "beta"]
        a = infos["alpha"]
        assert a.valid and a.invalid_reason == "" and a.rank == 8 and a.lora_alpha == 16.0
        assert a.target_modules == ("q_proj", "k_proj", "v_proj", "o_proj")
        assert a.base_model == "HuggingFaceTB/SmolLM2-135M"
        assert a.size_bytes == sum((alpha / f).stat().st_size for f in FILES) and a.updated_at > 1e9
        assert infos["beta"].use_rslora and infos["beta"].target_modules == ("gate_proj", "up_proj", "down_proj")

        manifest = client.get_manifest("alpha")
        local = {f: (alpha / f).read_bytes() for f in FILES}
        expected = [(f, len(local[f]), sha(local[f])) for f in FILES]
        assert [(f.path, f.size, f.sha256) for f in manifest.files] == expected
        assert [f.blake3 for f in manifest.files] == [blake3.blake3(local[f]).hexdigest() for f in FILES]
        assert manifest.adapter_sha256 == adapter_digest(sha(local[f]) for f in FILES)
        assert manifest.info.version == manifest.adapter_sha256[:16] == a.version
        assert manifest.config_json == local["adapter_config.json"].decode()
        assert client.get_manifest("alpha", a.version) == manifest

        fetched = client.fetch("alpha")
        assert {k: bytes(v) for k, v in fetched.files.items()} == local
        assert fetched.manifest == manifest and fetched.version == a.version
        beta_fetched = client.fetch("beta")
        assert bytes(beta_fetched.weights) == (beta / FILES[1]).read_bytes()

    # small shards: same bytes, many shards
    with AdapterStoreClient(store.address, max_shard_bytes=4096) as client:
        assert {k: bytes(v) for k, v in client.fetch("alpha").files.items()} == local


def test_fetch_resumes_from_file_and_offset(s3: S3Store, make_store, adapter_dir) -> None:
    folder = adapter_dir("resumable", rank=16, layers=4)
    push(s3, folder, "resumable")
    config, weights = ((folder / f).read_bytes() for f in FILES)
    store = make_store()
    stub = pb_grpc.AdapterStoreStub(grpc.insecure_channel(store.address))

    def shards(**kw) -> list[pb.AdapterShard]:
        return list(stub.FetchAdapter(pb.FetchAdapterRequest(name="resumable", max_shard_bytes=4096, **kw), timeout=10))

    tail = shards(start_file=1, start_offset=10_000)
    assert tail[0].HasField("manifest") and not any(s.HasField("manifest") for s in tail[1:])
    assert [s.file_index for s in tail] == [1] * len(tail) and len(tail) > 3
    assert tail[0].offset == 10_000 and b"".join(s.data for s in tail) == weights[10_000:]
    assert all(sha(s.data) == s.sha256 and s.file_size == len(weights) for s in tail)
    assert tail[-1].last and not any(s.last for s in tail[:-1])
    assert tail[-1].adapter_sha256 == tail[0].manifest.adapter_sha256 != ""

    mid_config = shards(start_file=0, start_offset=100)
    assert mid_config[0].offset == 100
    assert b"".join(s.data for s in mid_config if s.file_index == 0) == config[100:]
    assert b"".join(s.data for s in mid_config if s.file_index == 1) == weights

    end = shards(start_file=1, start_offset=len(weights))
    assert len(end) == 1 and end[0].last and end[0].data == b"" and end[0].adapter_sha256

    for bad, code in [(dict(start_file=2), grpc.StatusCode.OUT_OF_RANGE),
                      (dict(start_file=1, start_offset=len(weights) + 1), grpc.StatusCode.OUT_OF_RANGE),
                      (dict(start_offset=-1), grpc.StatusCode.OUT_OF_RANGE),
                      (dict(version="0123456789abcdef"), grpc.StatusCode.NOT_FOUND)]:
        with pytest.raises(grpc.RpcError) as info:
            shards(**bad)
        assert info.value.code() == code, bad


def test_reupload_is_a_new_version_and_watchers_hear_every_change(s3: S3Store, make_store, adapter_dir) -> None:
    push(s3, adapter_dir("chat", seed=1), "chat")
    store = make_store()
    with AdapterStoreClient(store.address) as client:
        watcher = Watcher(client)
        try:
            first = watcher.wait(ADDED, "chat").adapter
            watcher.wait(SYNCED)
            assert first is not None and first.valid

            started = time.monotonic()
            v2 = adapter_dir("chat-v2", seed=2)
            push(s3, v2, "chat")
            updated = watcher.wait(UPDATED, "chat")
            assert time.monotonic() - started < 5  # within the poll interval (0.3 s) plus validation
            assert updated.previous_version == first.version
            assert updated.adapter is not None and updated.adapter.version != first.version
            with pytest.raises(StoreError) as stale:
                client.fetch("chat", version=first.version, deadline_s=5)
            assert stale.value.code == grpc.StatusCode.NOT_FOUND
            assert bytes(client.fetch("chat").weights) == (v2 / FILES[1]).read_bytes()

            push(s3, adapter_dir("other"), "other")
            assert watcher.wait(ADDED, "other").adapter.valid

            for f in FILES:
                s3.delete(f"adapters/chat/{f}")
            deleted = watcher.wait(DELETED, "chat")
            assert deleted.previous_version == updated.adapter.version
            assert [i.name for i in client.list_adapters()] == ["other"]
            with pytest.raises(StoreError) as gone:
                client.get_manifest("chat")
            assert gone.value.code == grpc.StatusCode.NOT_FOUND
            # each change was reported exactly once
            kinds = [(e.kind, e.adapter.name if e.adapter else "") for e in watcher.events]
            assert kinds == [(ADDED, "chat"), (SYNCED, ""), (UPDATED, "chat"), (ADDED, "other"), (DELETED, "chat")]
        finally:
            watcher.close()


def test_bad_adapters_are_listed_invalid_and_never_streamed(s3: S3Store, make_store, tmp_path: Path,
                                                            adapter_dir, seaweed) -> None:
    raw = seaweed.boto3_client()
    pickle_bytes = b""
    for case, (build, _) in BAD_ADAPTERS.items():
        folder = tmp_path / "bad" / case
        build(folder)
        for path in folder.iterdir():
            raw.upload_file(str(path), s3.bucket, f"adapters/{case}/{path.name}")
            if path.suffix == ".bin":
                pickle_bytes = path.read_bytes()
    push(s3, adapter_dir("fine"), "fine")
    # keys that do not fit the layout or carry unsafe names are not adapters
    raw.put_object(Bucket=s3.bucket, Key="adapters/bad name!/adapter_config.json", Body=b"{}")
    raw.put_object(Bucket=s3.bucket, Key="adapters/.hidden/adapter_config.json", Body=b"{}")
    raw.put_object(Bucket=s3.bucket, Key="adapters/deep/er/adapter_config.json", Body=b"{}")
    store = make_store()
    with AdapterStoreClient(store.address) as client:
        infos = {i.name: i for i in client.list_adapters(page_size=5)}
        assert set(infos) == set(BAD_ADAPTERS) | {"fine"}
        assert infos["fine"].valid
        for case, (_, fragment) in BAD_ADAPTERS.items():
            info = infos[case]
            assert not info.valid and fragment in info.invalid_reason, (case, info.invalid_reason)
            for call in (lambda: client.fetch(case, deadline_s=5), lambda: client.get_manifest(case)):
                with pytest.raises(StoreError) as refused:
                    call()
                assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
                assert fragment in refused.value.details
    # the pickle was never downloaded
    assert not store.cache.contains(sha(pickle_bytes))
    assert store.metrics.value("adapter_store_catalog_adapters", valid="false") == len(BAD_ADAPTERS)


@pytest.mark.parametrize("name", ["../etc/passwd", "a/../../b", "/abs", "x" * 200, "ctl\x01", "..", ""])
def test_unsafe_names_are_invalid_argument(name: str, s3: S3Store, make_store) -> None:
    store = make_store()
    stub = pb_grpc.AdapterStoreStub(grpc.insecure_channel(store.address))
    for call in (lambda: stub.GetManifest(pb.GetManifestRequest(name=name), timeout=5),
                 lambda: list(stub.FetchAdapter(pb.FetchAdapterRequest(name=name), timeout=5))):
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_watch_survives_a_store_restart(seaweed, bucket: str, s3: S3Store, adapter_dir, tmp_path: Path) -> None:
    from lora_common.ports import free_ports
    from store_servers import start_store

    push(s3, adapter_dir("kept"), "kept")
    push(s3, adapter_dir("dropped", seed=3), "dropped")
    port = free_ports(1)[0]
    store = start_store(seaweed, bucket, tmp_path / "cache", port=port)
    client = AdapterStoreClient(f"127.0.0.1:{port}")
    watcher = Watcher(client)
    try:
        watcher.wait(SYNCED)
        store.stop()
        # while the store is down, the bucket changes
        push(s3, adapter_dir("arrived", seed=4), "arrived")
        for f in FILES:
            s3.delete(f"adapters/dropped/{f}")
        store = start_store(seaweed, bucket, tmp_path / "cache", port=port)
        watcher.wait(ADDED, "arrived", timeout=20)
        watcher.wait(DELETED, "dropped", timeout=5)
        kinds = [(e.kind, e.adapter.name if e.adapter else "") for e in watcher.events]
        # the resync reports only the differences; "kept" is not announced twice
        assert kinds == [(ADDED, "dropped"), (ADDED, "kept"), (SYNCED, ""), (DELETED, "dropped"),
                         (ADDED, "arrived"), (SYNCED, "")]
    finally:
        watcher.close()
        client.close()
        store.stop()


def test_paging(s3: S3Store, make_store, adapter_dir, seaweed) -> None:
    folder = adapter_dir("tiny", rank=2, layers=1, targets=("q_proj",))
    raw = seaweed.boto3_client()
    names = [f"n{i:02d}" for i in range(7)]
    for n in names:
        for f in FILES:
            raw.upload_file(str(folder / f), s3.bucket, f"adapters/{n}/{f}")
    store = make_store()
    stub = pb_grpc.AdapterStoreStub(grpc.insecure_channel(store.address))
    seen, token, pages = [], "", 0
    while True:
        page = stub.ListAdapters(pb.ListStoreAdaptersRequest(page_size=3, page_token=token), timeout=5)
        seen += [a.name for a in page.adapters]
        pages += 1
        token = page.next_page_token
        if not token:
            break
    assert seen == names and pages == 3
    # same content under seven names: one version, and one blob per file in the cache
    assert len({i.version for i in AdapterStoreClient(store.address).list_adapters()}) == 1
    with pytest.raises(grpc.RpcError) as info:
        stub.ListAdapters(pb.ListStoreAdaptersRequest(page_token="not-a-token!"), timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_concurrent_cold_fetches_download_once(s3: S3Store, make_store, tmp_path: Path) -> None:
    folder = sized_adapter(tmp_path / "big", 12)
    pushed = push_adapter(folder, "big", s3, "adapters/", progress=False, multipart_bytes=5 << 20)
    assert pushed.objects[0].multipart  # the weights went up in parts (their ETag is not an MD5)
    store = make_store()
    store.cache.clear()  # cold: the next fetch goes to S3
    before = store.metrics.value("adapter_store_s3_download_bytes_total")
    misses = store.metrics.value("adapter_store_cache_misses_total")
    results: list[bytes] = []

    def fetch() -> None:
        with AdapterStoreClient(store.address) as client:
            results.append(bytes(client.fetch("big", deadline_s=60).weights))

    threads = [threading.Thread(target=fetch) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    expected = (folder / FILES[1]).read_bytes()
    assert results == [expected] * 4
    size = sum((folder / f).stat().st_size for f in FILES)
    assert store.metrics.value("adapter_store_s3_download_bytes_total") - before == size
    assert store.metrics.value("adapter_store_cache_misses_total") - misses == 2  # one per file
    assert store.metrics.value("adapter_store_fetch_bytes_total") >= 4 * size


def test_an_adapter_pushed_a_moment_ago_is_found_without_waiting_for_the_poll(s3: S3Store, make_store,
                                                                              adapter_dir) -> None:
    store = make_store(poll_interval_s=3600.0)
    with AdapterStoreClient(store.address) as client:
        wait_for(lambda: store.store.catalog.ready.is_set(), 10, "the first listing")
        assert list(client.list_adapters()) == []
        push(s3, adapter_dir("late", rank=4), "late")
        assert client.get_manifest("late").info.name == "late"  # found by a fresh listing on the miss
        with pytest.raises(StoreError) as err:
            client.get_manifest("never-pushed")
        assert err.value.code == grpc.StatusCode.NOT_FOUND


def test_a_second_store_on_a_taken_port_fails_instead_of_sharing_it(make_store) -> None:
    """Without an exclusive listen, gRPC's default SO_REUSEPORT lets a second store (or any
    gRPC server) bind the same port and the kernel splits connections between them."""
    first = make_store()
    port = int(first.address.rsplit(":", 1)[1])
    with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}: the port is in use"):
        make_store(port=port, host="127.0.0.1")


def test_shards_carry_blake3_for_clients_that_ask_and_sha256_for_older_ones(s3: S3Store, make_store,
                                                                           adapter_dir) -> None:
    """A client that sets blake3_shards gets each shard's BLAKE3 (and no sha256); one that
    does not (older clients) gets the sha256 as before: cold (hashed as the bytes stream from
    S3) and again warm (from the digests the cache recorded)."""
    folder = adapter_dir("digests", rank=16, layers=4)
    push(s3, folder, "digests")
    weights = (folder / FILES[1]).read_bytes()
    store = make_store()
    stub = pb_grpc.AdapterStoreStub(grpc.insecure_channel(store.address))

    def shards(**kw) -> list[pb.AdapterShard]:
        request = pb.FetchAdapterRequest(name="digests", start_file=1, max_shard_bytes=4096, **kw)
        return list(stub.FetchAdapter(request, timeout=10))

    for blake3_shards in (True, False, True, False):
        if blake3_shards:
            store.cache.clear()  # the first of each kind streams from S3
            assert store.cache.wait_idle(10)
        got = shards(blake3_shards=blake3_shards)
        assert b"".join(s.data for s in got) == weights and len(got) > 3
        if blake3_shards:
            assert all(s.blake3 == blake3.blake3(s.data).hexdigest() and s.sha256 == "" for s in got)
        else:
            assert all(s.sha256 == sha(s.data) and s.blake3 == "" for s in got)
        assert store.cache.wait_idle(10)


class CorruptingWriter:
    """The cache's file, with one byte of what S3 sends flipped on its way in."""

    def __init__(self, out, at: int) -> None:
        self.out, self.at, self.seen = out, at, 0

    def write(self, data: bytes) -> int:
        if self.seen <= self.at < self.seen + len(data):
            flipped = bytearray(data)
            flipped[self.at - self.seen] ^= 0x01
            data = bytes(flipped)
        self.seen += len(data)
        return self.out.write(data)


def test_a_cold_download_that_misses_the_catalogs_blake3_is_refused(s3: S3Store, make_store, adapter_dir,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """Cold fetches skip the ETag's MD5: what proves the bytes is the BLAKE3 the catalog
    recorded. Bytes that go bad between S3 and the cache are refused (UNAVAILABLE, retried
    by the client until its deadline), never cached, and the next clean download serves."""
    folder = adapter_dir("rotting", rank=16, layers=4)
    push(s3, folder, "rotting")
    weights = (folder / FILES[1]).read_bytes()
    store = make_store()
    store.cache.clear()
    s3_store = store.catalog.s3
    real_download = s3_store.download
    calls: list[str] = []

    def corrupted(obj, out, deadline=None, caller_checks=""):
        calls.append(caller_checks)
        return real_download(obj, CorruptingWriter(out, obj.size // 2), deadline, caller_checks)

    s3_store.download = corrupted
    try:
        with AdapterStoreClient(store.address) as client:
            with pytest.raises(StoreError) as info:
                client.fetch("rotting", deadline_s=2)
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        heard = caplog.messages + [info.value.details]  # each refusal, as the client logged it
        assert any("download failed its checksum" in m and "downloaded BLAKE3" in m for m in heard), heard
        assert calls and set(calls) == {"blake3"}
        assert store.cache.wait_idle(10) and not store.cache.contains(sha(weights))
    finally:
        s3_store.download = real_download
    with AdapterStoreClient(store.address) as client:
        assert bytes(client.fetch("rotting", deadline_s=30).weights) == weights
