"""S3 access with boto3: listing, streaming ranged downloads that survive outages, uploads.

Downloads go range by range with `If-Match: <ETag>`, so every byte comes from the same
object version; a broken or refused range is retried from the byte reached, with
exponential backoff and jitter, until the caller's deadline. Data is written to the
caller's file as it arrives (one chunk in memory at a time) while sha256 and, for
single-part ETags, MD5 are computed; the MD5 must equal the ETag. A caller that checks the
bytes against a digest it recorded for the object earlier (the catalog's sha256 or BLAKE3)
says so (`caller_checks`), and the hashes that check makes redundant are not computed.
"""
from __future__ import annotations

import hashlib
import logging
import random
import time
from dataclasses import dataclass
from typing import BinaryIO, Callable, Iterator, Literal

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

log = logging.getLogger(__name__)

RANGE_BYTES = 16 << 20
CHUNK_BYTES = 1 << 20
MULTIPART_BYTES = 16 << 20
_THROTTLING = {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
               "TooManyRequests", "RequestThrottled", "ServiceUnavailable", "InternalError",
               "RequestTimeout", "RequestTimeTooSkewed"}

# Called after each chunk written by a download: (key, offset reached, chunk size).
ChunkObserver = Callable[[str, int, int], None]
# What a download's caller checks the bytes against itself, from its own record of them:
# "" nothing (the ETag's MD5 is checked here), "sha256" (computed here, checked by the caller),
# "blake3" (the caller hashes and checks it; neither MD5 nor sha256 is computed here).
CallerCheck = Literal["", "sha256", "blake3"]


class S3Error(Exception):
    """Base of the errors this module raises."""


class S3Unavailable(S3Error):
    """The object store could not be reached (or kept failing) until the deadline."""


class ObjectChanged(S3Error):
    """The object is gone or was replaced since it was listed (ETag no longer matches)."""


class ObjectCorrupt(S3Error):
    """The bytes received do not match the object's ETag."""


class LocalWriteFailed(S3Error):
    """The download's destination could not be written (disk full...): not retried."""


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    etag: str            # without quotes
    last_modified: float  # unix seconds

    @property
    def multipart(self) -> bool:
        return "-" in self.etag


@dataclass(frozen=True)
class Downloaded:
    size: int
    sha256: str      # empty when the caller checks BLAKE3 (caller_checks="blake3")
    md5: str | None  # None when the ETag is not an MD5 (multipart uploads) or the caller checks a digest


def make_client(endpoint_url: str | None = None, region: str | None = None, max_attempts: int = 5,
                connect_timeout: float = 5.0, read_timeout: float = 20.0, path_style: bool = True):
    """A boto3 S3 client; credentials and region come from the standard AWS environment and
    config files. botocore's 'standard' mode retries throttling and 5xx with backoff."""
    config = Config(retries={"max_attempts": max_attempts, "mode": "standard"},
                    connect_timeout=connect_timeout, read_timeout=read_timeout,
                    s3={"addressing_style": "path" if path_style else "auto"},
                    max_pool_connections=32, signature_version="s3v4")  # presigned URLs too (not SigV2)
    return boto3.session.Session().client("s3", endpoint_url=endpoint_url or None,
                                          region_name=region or None, config=config)


def _retryable(exc: BaseException) -> bool:
    if isinstance(exc, ClientError):
        err = exc.response.get("Error", {})
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        return status >= 500 or status == 429 or err.get("Code") in _THROTTLING
    return isinstance(exc, (BotoCoreError, ConnectionError, TimeoutError, OSError))


def _status(exc: ClientError) -> tuple[int, str]:
    return (exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0,
            str(exc.response.get("Error", {}).get("Code", "")))


class Backoff:
    """Exponential backoff with full jitter, bounded by a deadline."""

    def __init__(self, deadline: float | None, base_s: float = 0.1, cap_s: float = 2.0) -> None:
        self.deadline, self.base_s, self.cap_s, self.attempt = deadline, base_s, cap_s, 0

    def sleep(self) -> bool:
        """Sleeps before the next try; False when the deadline leaves no time for one."""
        delay = random.uniform(self.base_s, min(self.cap_s, self.base_s * (2 ** self.attempt)))
        self.attempt += 1
        if self.deadline is not None and time.monotonic() + delay >= self.deadline:
            return False
        time.sleep(delay)
        return True

    def reset(self) -> None:
        self.attempt = 0


class S3Store:
    """One bucket. Thread-safe (boto3 clients are)."""

    def __init__(self, bucket: str, client=None, *, endpoint_url: str | None = None, region: str | None = None,
                 range_bytes: int = RANGE_BYTES, chunk_bytes: int = CHUNK_BYTES,
                 on_chunk: ChunkObserver | None = None,
                 on_retry: Callable[[BaseException], None] | None = None) -> None:
        self.bucket = bucket
        self.client = client or make_client(endpoint_url, region)
        # Downloads retry in download() itself (resuming at the byte reached, bounded by the
        # caller's deadline), so their client does not retry on its own.
        self.data_client = client or make_client(endpoint_url, region, max_attempts=1, read_timeout=10.0)
        self.range_bytes = range_bytes
        self.chunk_bytes = chunk_bytes
        self.on_chunk = on_chunk
        self.on_retry = on_retry

    def describe(self) -> str:
        return f"s3://{self.bucket} at {self.client.meta.endpoint_url}"

    # ------------------------------------------------------------------ reads

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object under the prefix (paged by the server)."""
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
            for item in page.get("Contents", []):
                yield ObjectInfo(item["Key"], int(item["Size"]), item["ETag"].strip('"'),
                                 item["LastModified"].timestamp())

    def head(self, key: str) -> ObjectInfo | None:
        try:
            r = self.client.head_object(Bucket=self.bucket, Key=key)
        except ClientError as exc:
            if _status(exc)[0] == 404:
                return None
            raise
        return ObjectInfo(key, int(r["ContentLength"]), r["ETag"].strip('"'), r["LastModified"].timestamp())

    def read_small(self, obj: ObjectInfo, max_bytes: int, deadline: float | None = None) -> bytes:
        """A small object fully in memory (configs), with the same checks as download()."""
        if obj.size > max_bytes:
            raise ObjectCorrupt(f"{obj.key} is {obj.size} bytes; the limit is {max_bytes}")
        import io

        buffer = io.BytesIO()
        self.download(obj, buffer, deadline)
        return buffer.getvalue()

    def download(self, obj: ObjectInfo, out: BinaryIO, deadline: float | None = None,
                 caller_checks: CallerCheck = "") -> Downloaded:
        """Streams the object into `out`, resuming after failures until `deadline`
        (time.monotonic() seconds; None waits forever). With `caller_checks`, the caller
        compares the bytes with a digest it recorded for this object earlier: a match proves
        every byte and the ETag's MD5 adds nothing to it, so the MD5 is skipped, and with
        "blake3" the sha256 too."""
        sha = None if caller_checks == "blake3" else hashlib.sha256()
        md5 = None if obj.multipart or caller_checks else hashlib.md5(usedforsecurity=False)
        offset = 0
        backoff = Backoff(deadline)
        while offset < obj.size:
            end = min(offset + self.range_bytes, obj.size) - 1
            try:
                response = self.data_client.get_object(Bucket=self.bucket, Key=obj.key, Range=f"bytes={offset}-{end}",
                                                  IfMatch=f'"{obj.etag}"')
                body = response["Body"]
                try:
                    for chunk in body.iter_chunks(self.chunk_bytes):
                        if offset + len(chunk) > end + 1:
                            raise ObjectCorrupt(f"{obj.key}: server sent more than the range asked for")
                        try:
                            out.write(chunk)
                        except OSError as exc:
                            raise LocalWriteFailed(f"writing {obj.key} locally failed: {exc}") from exc
                        if sha is not None:
                            sha.update(chunk)
                        if md5 is not None:
                            md5.update(chunk)
                        offset += len(chunk)
                        if self.on_chunk is not None:
                            self.on_chunk(obj.key, offset, len(chunk))
                finally:
                    body.close()
                if offset != end + 1:
                    raise ConnectionError(f"{obj.key}: range ended at {offset}, expected {end + 1}")
                backoff.reset()
            except ClientError as exc:
                status, code = _status(exc)
                if status in (404, 412) or code in ("NoSuchKey", "PreconditionFailed"):
                    raise ObjectChanged(f"{obj.key} changed or vanished since it was listed "
                                        f"({code or status})") from exc
                if not _retryable(exc):
                    raise
                self._retry_or_give_up(obj, offset, exc, backoff)
            except S3Error:
                raise
            except Exception as exc:  # connection refused/reset, timeouts, truncated bodies
                if not _retryable(exc):
                    raise
                self._retry_or_give_up(obj, offset, exc, backoff)
        if md5 is not None and md5.hexdigest() != obj.etag:
            raise ObjectCorrupt(f"{obj.key}: MD5 of the bytes received is {md5.hexdigest()}, the ETag says {obj.etag}")
        return Downloaded(offset, sha.hexdigest() if sha else "", md5.hexdigest() if md5 else None)

    def _retry_or_give_up(self, obj: ObjectInfo, offset: int, exc: BaseException, backoff: Backoff) -> None:
        if self.on_retry is not None:
            self.on_retry(exc)
        log.warning("s3 GET %s at byte %d failed (%s: %s); retrying", obj.key, offset, type(exc).__name__, exc)
        if not backoff.sleep():
            raise S3Unavailable(f"object store unavailable while reading {obj.key} "
                                f"({offset}/{obj.size} bytes): {type(exc).__name__}: {exc}") from exc

    def presign_get(self, obj: ObjectInfo, expires_s: int, client=None) -> str:
        """A presigned GET of the object as listed, valid for `expires_s`: its If-Match (the
        ETag) is signed into it, so a reader must send it, and a replaced object answers 412.
        `client` presigns instead of this store's own: one configured with the endpoint the
        readers reach (the URL names its host, which the signature covers). Computed
        locally, no request is made. The URL is a credential: callers never log it."""
        return (client or self.client).generate_presigned_url(
            "get_object", Params={"Bucket": self.bucket, "Key": obj.key, "IfMatch": f'"{obj.etag}"'},
            ExpiresIn=int(expires_s))

    # ------------------------------------------------------------------ writes

    def upload_file(self, path: str, key: str, progress: Callable[[int], None] | None = None,
                    multipart_bytes: int = MULTIPART_BYTES, content_type: str | None = None) -> ObjectInfo:
        """Uploads a file (multipart above `multipart_bytes`, streamed from disk); returns
        the object as the store now lists it."""
        config = TransferConfig(multipart_threshold=multipart_bytes, multipart_chunksize=multipart_bytes,
                                max_concurrency=4, use_threads=True)
        extra = {"ContentType": content_type} if content_type else None
        self.client.upload_file(path, self.bucket, key, Config=config, Callback=progress, ExtraArgs=extra)
        info = self.head(key)
        if info is None:
            raise ObjectChanged(f"{key} is missing right after its upload")
        return info

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=key)
