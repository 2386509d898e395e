"""S3Store.download's retry and resume logic, against a scripted boto3-like client (a unit
test of the loop itself; the integration and fault tests use a real SeaweedFS)."""
from __future__ import annotations

import hashlib
import io
import time

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError, ResponseStreamingError

from adapter_store.s3 import ObjectChanged, ObjectCorrupt, ObjectInfo, S3Store, S3Unavailable

DATA = bytes(range(256)) * 40  # 10 240 bytes


class Body:
    def __init__(self, data: bytes, break_after: int | None = None) -> None:
        self.data, self.break_after = data, break_after

    def iter_chunks(self, size: int):
        for i in range(0, len(self.data), 1000):
            if self.break_after is not None and i >= self.break_after:
                raise ResponseStreamingError(error="connection reset")
            yield self.data[i:i + 1000]

    def close(self) -> None:
        pass


def client_error(status: int, code: str) -> ClientError:
    return ClientError({"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")


class ScriptedClient:
    """Answers get_object from DATA, first playing a script of failures."""

    def __init__(self, script: list, data: bytes = DATA) -> None:
        self.script, self.data, self.ranges = list(script), data, []

    def get_object(self, Bucket: str, Key: str, Range: str, IfMatch: str):
        start, end = (int(x) for x in Range.removeprefix("bytes=").split("-"))
        self.ranges.append((start, end, IfMatch))
        step = self.script.pop(0) if self.script else None
        if isinstance(step, Exception):
            raise step
        return {"Body": Body(self.data[start:end + 1], break_after=step)}


def store(client: ScriptedClient) -> S3Store:
    s3 = S3Store("bucket", client, range_bytes=4096, chunk_bytes=1000)
    return s3


def obj(data: bytes = DATA, etag: str | None = None) -> ObjectInfo:
    return ObjectInfo("adapters/a/adapter_model.safetensors", len(data), etag or hashlib.md5(data).hexdigest(), 0.0)


def test_throttling_5xx_and_broken_bodies_are_retried_from_the_byte_reached() -> None:
    client = ScriptedClient([client_error(503, "SlowDown"), None, 2000,
                             client_error(500, "InternalError"), EndpointConnectionError(endpoint_url="x")])
    out = io.BytesIO()
    result = store(client).download(obj(), out, time.monotonic() + 30)
    assert out.getvalue() == DATA and result.sha256 == hashlib.sha256(DATA).hexdigest()
    starts = [r[0] for r in client.ranges]
    # 503 at 0, range 0-4095 ok, body broken after 2000 bytes of range 4096-, then resumed at 6096
    assert starts == [0, 0, 4096, 6096, 6096, 6096, 10192]
    assert all(r[2] == f'"{obj().etag}"' for r in client.ranges)  # every range pinned to the ETag


def test_gives_up_at_the_deadline() -> None:
    client = ScriptedClient([EndpointConnectionError(endpoint_url="x")] * 1000)
    started = time.monotonic()
    with pytest.raises(S3Unavailable):
        store(client).download(obj(), io.BytesIO(), time.monotonic() + 1.0)
    assert time.monotonic() - started < 1.5


def test_changed_object_and_md5_mismatch_are_not_retried() -> None:
    with pytest.raises(ObjectChanged):
        store(ScriptedClient([client_error(412, "PreconditionFailed")])).download(obj(), io.BytesIO())
    with pytest.raises(ObjectCorrupt, match="MD5"):
        store(ScriptedClient([])).download(obj(etag="0" * 32), io.BytesIO())
    # a multipart ETag is not an MD5 of the bytes: not compared
    assert store(ScriptedClient([])).download(obj(etag="abc-3"), io.BytesIO()).md5 is None


def test_access_denied_is_final() -> None:
    client = ScriptedClient([client_error(403, "AccessDenied")])
    with pytest.raises(ClientError):
        store(client).download(obj(), io.BytesIO(), time.monotonic() + 30)
    assert len(client.ranges) == 1


class CountingHashes:
    """Counts the md5 and sha256 objects hashlib makes while installed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import adapter_store.s3 as s3_module

        self.made: list[str] = []
        real = hashlib

        class Counting:
            def md5(inner, *a, **kw):
                self.made.append("md5")
                return real.md5(*a, **kw)

            def sha256(inner, *a, **kw):
                self.made.append("sha256")
                return real.sha256(*a, **kw)

        monkeypatch.setattr(s3_module, "hashlib", Counting())


def test_md5_is_skipped_only_where_the_caller_checks_a_recorded_digest(monkeypatch: pytest.MonkeyPatch) -> None:
    """With caller_checks the ETag is not compared (even a wrong one passes here: the caller's
    digest is the check); without it, it still is. "blake3" leaves sha256 to nobody here."""
    hashes = CountingHashes(monkeypatch)
    wrong_etag = obj(etag="0" * 32)
    with pytest.raises(ObjectCorrupt, match="MD5"):
        store(ScriptedClient([])).download(wrong_etag, io.BytesIO())
    assert sorted(hashes.made) == ["md5", "sha256"]
    hashes.made.clear()
    out = io.BytesIO()
    result = store(ScriptedClient([])).download(wrong_etag, out, caller_checks="sha256")
    assert hashes.made == ["sha256"] and result.md5 is None
    assert out.getvalue() == DATA and result.sha256 == hashlib.sha256(DATA).hexdigest()
    hashes.made.clear()
    result = store(ScriptedClient([])).download(wrong_etag, io.BytesIO(), caller_checks="blake3")
    assert hashes.made == [] and result.sha256 == "" and result.size == len(DATA)
