"""Adapter store fetch benchmark: a ~100 MB adapter from S3 to a gRPC client on loopback.

It starts an embedded SeaweedFS, pushes a synthetic adapter, runs the store in a child
process (so server and client do not share a GIL) and measures, in the same run:
  - boto3 downloading the same object (one GET stream, and boto3's threaded transfer),
  - FetchAdapter cold: the store's disk cache emptied first, so bytes come from S3,
  - FetchAdapter warm: from the store's disk cache,
each a few times, printing the median (and best) throughput in MB/s (10^6 bytes/s).
The client verifies every shard, file and the whole adapter (sha256) as in production.

    python -m bench.store_fetch_bench                # 100 MB, 3 runs each
    python -m bench.store_fetch_bench --mb 20 --runs 2
"""
from __future__ import annotations

import argparse
import io
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from adapter_store.client import AdapterStoreClient
from adapter_store.push import push_adapter
from adapter_store.s3 import S3Store
from adapter_store.samples import sized_adapter
from adapter_store.seaweedfs import SeaweedFS

BUCKET = "bench-adapters"
NAME = "bench-100mb"


def child(args: argparse.Namespace) -> None:
    """The store, in its own process: commands on stdin ('clear', 'quit'), replies on stdout."""
    import logging

    from adapter_store.server import BackgroundStore, StoreSettings

    logging.basicConfig(level=logging.WARNING)
    settings = StoreSettings(bucket=BUCKET, s3_endpoint=args.endpoint, cache_dir=args.cache_dir, port=0,
                             poll_interval_s=60, shard_bytes=args.shard_kb << 10)
    store = BackgroundStore(settings)
    print(json.dumps({"address": store.address}), flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "clear":
            store.cache.clear()
            print(json.dumps({"cleared": True}), flush=True)
        elif command == "quit":
            break
    store.stop()


class StoreProcess:
    def __init__(self, server: SeaweedFS, cache_dir: Path, shard_kb: int) -> None:
        env = {**__import__("os").environ, **server.env()}
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.store_fetch_bench", "--child",
                                      "--endpoint", server.endpoint_url,
                                      "--cache-dir", str(cache_dir), "--shard-kb", str(shard_kb)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.address = self._reply()["address"]

    def _reply(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the store process exited")
        return json.loads(line)

    def clear_cache(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("clear\n")
        self.proc.stdin.flush()
        self._reply()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("quit\n")
        self.proc.stdin.flush()
        self.proc.wait(30)


def measure(run: Callable[[], int], runs: int, before: Callable[[], None] | None = None) -> tuple[float, float, int]:
    """(median MB/s, best MB/s, bytes) over `runs` runs."""
    rates, size = [], 0
    for _ in range(runs):
        if before is not None:
            before()
        started = time.perf_counter()
        size = run()
        rates.append(size / (time.perf_counter() - started) / 1e6)
    return statistics.median(rates), max(rates), size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=100.0, help="adapter size in MB")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--shard-kb", type=int, default=1024, help="the store's shard size")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return

    with tempfile.TemporaryDirectory(prefix="store-bench-") as tmp, SeaweedFS(Path(tmp) / "seaweedfs") as server:
        server.create_bucket(BUCKET)
        folder = sized_adapter(Path(tmp) / NAME, args.mb)
        s3_client = server.boto3_client()
        push_adapter(folder, NAME, S3Store(BUCKET, s3_client), "adapters/", progress=False)
        key = f"adapters/{NAME}/adapter_model.safetensors"
        weights_size = (folder / "adapter_model.safetensors").stat().st_size

        def boto3_get() -> int:
            return len(s3_client.get_object(Bucket=BUCKET, Key=key)["Body"].read())

        def boto3_transfer() -> int:
            buffer = io.BytesIO()
            s3_client.download_fileobj(BUCKET, key, buffer)
            return buffer.getbuffer().nbytes

        store = StoreProcess(server, Path(tmp) / "cache", args.shard_kb)
        try:
            with AdapterStoreClient(store.address) as client:
                def fetch() -> int:
                    fetched = client.fetch(NAME, deadline_s=600)
                    return sum(len(b) for b in fetched.files.values())

                rows = [
                    ("boto3 get_object (one stream)", measure(boto3_get, args.runs)),
                    ("boto3 download_fileobj (threaded)", measure(boto3_transfer, args.runs)),
                    ("gRPC FetchAdapter cold (S3 -> store -> client)", measure(fetch, args.runs, store.clear_cache)),
                    ("gRPC FetchAdapter warm (disk cache -> client)", measure(fetch, args.runs)),
                ]
        finally:
            store.close()

    print(f"\nadapter: {weights_size / 1e6:.1f} MB safetensors; shards of {args.shard_kb} KiB; "
          f"median and best of {args.runs} runs; SeaweedFS and store on loopback\n")
    width = max(len(r[0]) for r in rows)
    print(f"{'path':<{width}}  {'MB':>7}  {'median MB/s':>11}  {'best MB/s':>9}")
    for label, (median, best, size) in rows:
        print(f"{label:<{width}}  {size / 1e6:>7.1f}  {median:>11.1f}  {best:>9.1f}")


if __name__ == "__main__":
    main()
