"""Plain helpers of the adapter store tests (buckets, in-process stores), importable by name:
test modules import them from here, never from a conftest, since every test folder's
conftest.py is a module named `conftest` and which one that name finds depends on the order
pytest collected the folders in."""
from __future__ import annotations

import itertools
import os
import uuid
from pathlib import Path

from adapter_store.s3 import S3Store
from adapter_store.seaweedfs import SeaweedFS
from adapter_store.server import BackgroundStore, StoreSettings

POLL_S = 0.3
SETTLE_S = 0.2
_counter = itertools.count()


def new_bucket(server: SeaweedFS) -> str:
    return server.create_bucket(f"store-{os.getpid()}-{next(_counter)}-{uuid.uuid4().hex[:6]}")


def start_store(server: SeaweedFS, bucket: str, cache_dir: Path, s3: S3Store | None = None,
                **overrides: object) -> BackgroundStore:
    settings = StoreSettings(bucket=bucket, s3_endpoint=server.endpoint_url, region=server.region,
                             cache_dir=str(cache_dir), port=0, poll_interval_s=POLL_S, settle_s=SETTLE_S)
    for key, value in overrides.items():
        setattr(settings, key, value)
    client_s3 = s3 or S3Store(bucket, server.boto3_client(retries={"max_attempts": 1}, read_timeout=5))
    return BackgroundStore(settings, s3=client_s3)
