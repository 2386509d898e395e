"""Fixtures of the adapter store tests: one real SeaweedFS per session, a fresh bucket per
test, in-process stores polling fast, and synthetic adapters."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator

import pytest

from adapter_store.s3 import S3Store
from adapter_store.samples import write_adapter
from adapter_store.seaweedfs import SeaweedFS
from adapter_store.server import BackgroundStore
from store_servers import new_bucket, start_store


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedFS]:
    server = SeaweedFS(tmp_path_factory.mktemp("seaweedfs"))
    server.start()
    yield server
    server.close()


@pytest.fixture
def bucket(seaweed: SeaweedFS) -> str:
    return new_bucket(seaweed)


@pytest.fixture
def s3(seaweed: SeaweedFS, bucket: str) -> S3Store:
    return S3Store(bucket, seaweed.boto3_client())


StoreFactory = Callable[..., BackgroundStore]


@pytest.fixture
def make_store(seaweed: SeaweedFS, bucket: str, tmp_path: Path) -> Iterator[StoreFactory]:
    """Starts stores on the test's bucket (or another); all stopped at teardown."""
    started: list[BackgroundStore] = []

    def factory(bucket_name: str | None = None, **overrides: object) -> BackgroundStore:
        cache = tmp_path / f"cache-{len(started)}"
        store = start_store(seaweed, bucket_name or bucket, cache, **overrides)
        started.append(store)
        return store

    yield factory
    for store in started:
        store.stop()


@pytest.fixture
def adapter_dir(tmp_path: Path) -> Callable[..., Path]:
    """adapter_dir("name", rank=..., seed=...) writes a synthetic PEFT adapter folder."""
    def make(name: str, **kwargs: object) -> Path:
        return write_adapter(tmp_path / "adapters" / name, **kwargs)  # type: ignore[arg-type]

    return make
