"""Fixtures of the node-with-store integration tests: per module, one real SeaweedFS, a
bucket on it, the store's S3Store over that bucket, and in-process adapter stores serving it.

Everything here is module-scoped, as each module's own set-up was: a module's pushes,
deletions and stopped stores never reach another module, and one SeaweedFS start (the
slow part) serves all of a module's tests."""
from __future__ import annotations

import uuid
from typing import Callable, Iterator

import pytest

from adapter_store.s3 import S3Store
from adapter_store.seaweedfs import SeaweedFS
from adapter_store.server import BackgroundStore, StoreSettings

StoreFactory = Callable[..., BackgroundStore]


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedFS]:
    """A real S3 endpoint for the module; module scope so its state stays the module's own."""
    with SeaweedFS(tmp_path_factory.mktemp("seaweedfs")) as server:  # started here, closed at teardown
        yield server


@pytest.fixture(scope="module")
def bucket(seaweed: SeaweedFS) -> str:
    """The module's bucket; module scope because the module's adapters are pushed once."""
    return seaweed.create_bucket(f"integration-{uuid.uuid4().hex[:8]}")


@pytest.fixture(scope="module")
def s3(seaweed: SeaweedFS, bucket: str) -> S3Store:
    """The store's S3 access to the module's bucket: what pushes adapters and what stores read."""
    return S3Store(bucket, seaweed.boto3_client())


@pytest.fixture(scope="module")
def make_store(seaweed: SeaweedFS, bucket: str, s3: S3Store,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[StoreFactory]:
    """make_store(**settings) starts an adapter store on the module's bucket with a fresh cache,
    polling every 0.3 s so the node sees changes quickly. Module scope because module fixtures
    start stores for all their tests; those a test has not stopped itself are stopped at the end."""
    started: list[BackgroundStore] = []

    def start(**settings: object) -> BackgroundStore:
        cache = tmp_path_factory.mktemp("store-cache")
        started.append(BackgroundStore(StoreSettings(
            bucket=bucket, s3_endpoint=seaweed.endpoint_url, region=seaweed.region, cache_dir=str(cache), port=0,
            poll_interval_s=0.3, **settings), s3=s3))  # type: ignore[arg-type]
        return started[-1]

    yield start
    for store in started:
        if store.thread.is_alive():  # stopping twice would wait on a loop that has ended
            store.stop()
