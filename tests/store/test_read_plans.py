"""Read plans (GetReadPlan) against a real SeaweedFS: the node's direct reads get the very bytes
the stream gives; a store without --direct-reads offers none; names stay untrusted and an
invalid adapter gets no plan; replaced, corrupted and expired objects are refused; the
plan's inputs are checked before any byte is read; the URLs never reach a log."""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from adapter_store.client import AdapterStoreClient, StoreError
from adapter_store.push import push_adapter
from adapter_store.read_plans import DirectReads
from adapter_store.records import FileRead
from adapter_store.s3 import S3Store
from lora_common.ports import free_ports
from tcp_proxy import CorruptingProxy
from inference_node.adapters.direct_reads import DirectReader, DirectReadFailed, DirectReadSettings
from store_corpus import BAD_ADAPTERS

ON = DirectReads(enabled=True)
SMALL_RANGES = DirectReadSettings(connections=3, range_bytes=32 << 10)  # several GETs per file


@pytest.fixture
def reader():
    reader = DirectReader(SMALL_RANGES)
    yield reader
    reader.close()


def push(s3: S3Store, folder: Path, name: str) -> None:
    push_adapter(folder, name, s3, "adapters/", progress=False)


def test_a_plan_reads_the_same_bytes_as_the_stream(s3: S3Store, make_store, adapter_dir, reader, caplog) -> None:
    folder = adapter_dir("alpha", rank=16, layers=8, targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    push(s3, folder, "alpha")
    store = make_store(direct_reads=ON)
    for logger in ("adapter_store", "inference_node"):  # botocore is kept at WARNING by the CLIs
        caplog.set_level(logging.DEBUG, logger=logger)
    with AdapterStoreClient(store.address) as client:
        plan = client.get_read_plan("alpha")
        manifest = client.get_manifest("alpha")
        assert plan.manifest == manifest and len(plan.files) == len(manifest.files) and not plan.reason
        assert all(f.url.startswith("http://127.0.0.1:") and f.if_match.startswith('"') for f in plan.files)
        assert time.time() < plan.expires_at <= time.time() + ON.expiry_s + 1
        assert client.get_read_plan("alpha", manifest.info.version).manifest == manifest
        weights = manifest.files[1].size
        assert weights > 3 * SMALL_RANGES.range_bytes  # several ranged GETs in flight
        direct = reader.read(plan, bytearray, manifest.info.version)
        streamed = client.fetch("alpha")
    assert {k: bytes(v) for k, v in direct.files.items()} == {k: bytes(v) for k, v in streamed.files.items()}
    assert {k: bytes(v) for k, v in direct.files.items()} == {f: (folder / f).read_bytes() for f in direct.files}
    assert direct.offsets == streamed.offsets and direct.manifest == streamed.manifest
    assert store.metrics.value("adapter_store_read_plans_total", outcome="offered") == 2
    # Presigned URLs are credentials: nothing the store or the client logged holds one.
    assert "X-Amz-Signature" not in caplog.text and "X-Amz-Credential" not in caplog.text
    assert "url=" not in repr(plan)


def test_a_store_without_direct_reads_offers_no_plan(s3: S3Store, make_store, adapter_dir) -> None:
    push(s3, adapter_dir("alpha"), "alpha")
    store = make_store()
    with AdapterStoreClient(store.address) as client:
        plan = client.get_read_plan("alpha")
        assert plan.files == () and "--direct-reads" in plan.reason
        assert plan.manifest == client.get_manifest("alpha")
    assert store.metrics.value("adapter_store_read_plans_total", outcome="declined") == 1


def test_no_plan_for_unknown_unsafe_or_invalid_adapters(s3: S3Store, make_store, tmp_path: Path, seaweed) -> None:
    raw = seaweed.boto3_client()
    case, (build, fragment) = next(iter(BAD_ADAPTERS.items()))
    folder = tmp_path / "bad" / case
    build(folder)
    for path in folder.iterdir():
        raw.upload_file(str(path), s3.bucket, f"adapters/{case}/{path.name}")
    store = make_store(direct_reads=ON)
    with AdapterStoreClient(store.address) as client:
        for name, code in ((case, grpc.StatusCode.FAILED_PRECONDITION), ("nobody", grpc.StatusCode.NOT_FOUND),
                           ("../etc/passwd", grpc.StatusCode.INVALID_ARGUMENT),
                           ("x" * 200, grpc.StatusCode.INVALID_ARGUMENT)):
            with pytest.raises(StoreError) as refused:
                client.get_read_plan(name, timeout_s=20)
            assert refused.value.code == code, (name, refused.value)
        assert fragment in _details(client, case)
    assert store.metrics.value("adapter_store_read_plans_total", outcome="offered") == 0


def _details(client: AdapterStoreClient, name: str) -> str:
    with pytest.raises(StoreError) as refused:
        client.get_read_plan(name)
    return refused.value.details


def test_an_object_replaced_after_validation_is_refused_by_its_etag(s3: S3Store, make_store, adapter_dir,
                                                                    reader) -> None:
    push(s3, adapter_dir("alpha", layers=4), "alpha")
    store = make_store(direct_reads=ON)
    with AdapterStoreClient(store.address) as client:
        plan = client.get_read_plan("alpha")
    push(s3, adapter_dir("alpha-v2", layers=4, seed=9), "alpha")  # same sizes, other bytes
    with pytest.raises(DirectReadFailed, match="HTTP 412 .the object changed"):
        reader.read(plan, bytearray)


def test_bytes_that_differ_from_the_catalogs_digest_are_refused(s3: S3Store, make_store, adapter_dir, seaweed,
                                                                 monkeypatch, reader) -> None:
    """The store presigns for an endpoint (a proxy) that changes one byte of each response: the
    ETag still matches, the BLAKE3 does not."""
    push(s3, adapter_dir("alpha", layers=4), "alpha")
    proxy = CorruptingProxy(seaweed.ports["s3"])
    for key, value in seaweed.env().items():  # the presigning client's credentials, as in production
        monkeypatch.setenv(key, value)
    try:
        store = make_store(direct_reads=replace(ON, endpoint=proxy.url))
        with AdapterStoreClient(store.address) as client:
            plan = client.get_read_plan("alpha")
            assert all(f.url.startswith(proxy.url + "/") for f in plan.files)
            with pytest.raises(DirectReadFailed, match="adapter_model.safetensors from the object store has BLAKE3"):
                reader.read(plan, bytearray)
            assert proxy.flipped >= 1
            # The stream still gives the validated bytes.
            assert bytes(client.fetch("alpha").weights) == (adapter_dir("alpha", layers=4) / "adapter_model.safetensors").read_bytes()
    finally:
        proxy.close()


def test_an_expired_plan_is_refused(s3: S3Store, make_store, adapter_dir, reader) -> None:
    push(s3, adapter_dir("alpha"), "alpha")
    store = make_store(direct_reads=replace(ON, expiry_s=1))
    with AdapterStoreClient(store.address) as client:
        plan = client.get_read_plan("alpha")
    time.sleep(max(0.0, plan.expires_at - time.time()) + 1.5)
    with pytest.raises(DirectReadFailed, match="HTTP 403 .the URL expired"):
        reader.read(plan, bytearray)


def test_a_plans_inputs_are_checked_before_any_byte_is_read(s3: S3Store, make_store, adapter_dir, reader) -> None:
    push(s3, adapter_dir("alpha"), "alpha")
    store = make_store(direct_reads=ON)
    with AdapterStoreClient(store.address) as client:
        plan = client.get_read_plan("alpha")
    good = reader.read(plan, bytearray)
    config, weights = plan.files
    files = plan.manifest.files
    allocated = []

    def allocate(n: int) -> bytearray:
        allocated.append(n)
        return bytearray(n)

    bad = {
        "file URL": replace(plan, files=(FileRead("file:///etc/passwd"), weights)),
        "no scheme": replace(plan, files=(config, FileRead("//127.0.0.1/x"))),
        "header injection": replace(plan, files=(config, FileRead(weights.url, '"x"\r\nX-Evil: 1'))),
        "too few URLs": replace(plan, files=(config,)),
        "a size the object does not have": replace(plan, manifest=replace(
            plan.manifest, files=(files[0], replace(files[1], size=files[1].size + 1)))),
        "no BLAKE3": replace(plan, manifest=replace(plan.manifest, files=(files[0], replace(files[1], blake3="")))),
        "another version": plan,
        "a manifest inconsistent with its digest": replace(plan, manifest=replace(
            plan.manifest, files=(files[0], replace(files[1], sha256="0" * 64)))),
    }
    for case, tampered in bad.items():
        allocated.clear()
        with pytest.raises(DirectReadFailed) as failed:
            reader.read(tampered, allocate, "0" * 16 if case == "another version" else "")
        assert "X-Amz" not in str(failed.value), case
        if case != "a size the object does not have":  # refused before allocating
            assert allocated == [], case
        else:  # refused by the object store's Content-Range / length
            assert "expected" in str(failed.value)
    assert bytes(good.weights) == bytes(reader.read(plan, bytearray).weights)


def test_serve_flags(monkeypatch, capsys) -> None:
    from adapter_store.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["serve", "--bucket", "b"])
    assert (args.direct_reads, args.direct_reads_endpoint, args.direct_reads_expiry) == (False, None, 60)
    monkeypatch.setenv("ADAPTER_STORE_DIRECT_READS", "true")
    monkeypatch.setenv("ADAPTER_STORE_DIRECT_READS_ENDPOINT", "http://minio:9000")
    args = build_parser().parse_args(["serve", "--bucket", "b"])
    assert args.direct_reads and args.direct_reads_endpoint == "http://minio:9000"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--bucket", "b", "--direct-reads-endpoint", "file:///etc"])
    assert "not an http(s) URL" in capsys.readouterr().err


def test_an_unreachable_endpoint_fails_without_telling_the_url(s3: S3Store, make_store, adapter_dir, seaweed,
                                                               monkeypatch, reader) -> None:
    push(s3, adapter_dir("alpha"), "alpha")
    for key, value in seaweed.env().items():
        monkeypatch.setenv(key, value)
    dead = f"http://127.0.0.1:{free_ports(1)[0]}"
    store = make_store(direct_reads=replace(ON, endpoint=dead))
    with AdapterStoreClient(store.address) as client:
        plan = client.get_read_plan("alpha")
    assert all(f.url.startswith(dead + "/") for f in plan.files)
    with pytest.raises(DirectReadFailed, match="reaching the object store") as failed:
        reader.read(plan, bytearray)
    assert "X-Amz" not in str(failed.value) and dead not in str(failed.value)
