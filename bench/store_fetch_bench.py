"""Adapter transfer benchmark: a ~100 MB adapter from S3 through the store into the node's
host memory and on into a slot, on loopback, next to boto3 reading the same object.

It starts an embedded SeaweedFS, pushes a synthetic adapter, runs the store in a child
process (so store and node do not share a GIL) and measures, in the same run:
  - boto3 GET of the same object from the same SeaweedFS (one stream, and boto3's threaded transfer),
  - gRPC alone: as many bytes as bare messages of the shard size from the store's process,
    nothing read, hashed, encoded or copied (the transport's own ceiling here),
  - store -> node cold: the store's disk cache emptied first, so the bytes come from S3,
  - store -> node cold, direct reads: the node asks the store for a read plan (GetReadPlan) and
    reads the object itself with parallel ranged GETs of the presigned URLs, checking BLAKE3
    (the store's CPU is off the data path),
  - store -> node warm: from the store's disk cache,
    each received the way the node does it: one host buffer sized from the manifest
    (page-locked on CUDA), every shard copied into place, every file and the adapter
    checked against their sha256; once into fresh host memory per load (the node's
    allocator; on CPU each load faults its pages in) and once into one reused buffer,
  - the node's whole load from the store (fetch + validation + tensor views, StoreSource.load),
    streamed and by direct reads,
  - the node's disk tier: the adapter read back from the node's own disk, checked against its
    sha256 (and its header, names and shapes),
  - host -> slot: SlotBuffers.write of the loaded adapter into a slot (on CPU: the copy into
    the CPU slot buffers; on CUDA: host-to-device from page-locked memory, synchronized),
each a few times, printing the median (and best) throughput in MB/s (10^6 bytes/s) and the
CPU each process spent per run (this process plays the node; "S3" is SeaweedFS). Both
processes keep freed large buffers for reuse as the node and the store do (lora_common.malloc).

    python -m bench.store_fetch_bench                # 100 MB, 3 runs each
    python -m bench.store_fetch_bench --mb 20 --runs 2
    python -m bench.store_fetch_bench --single-part  # weights in one PUT: an MD5 ETag

--disk-tier measures only the node's disk tier, no store: DiskTier.read of an --mb adapter
that DiskTier.put wrote (under --workdir: put it on the disk to measure), into one reused
host buffer (page-locked on CUDA), for each --read-threads count: cold (the files' pages
dropped from the OS page cache first, bench/page_cache.py) and warm, each checked against
its chunk digests; and cold as an entry an older node wrote (no chunk digests: every file
checked whole against the manifest's sha256, one thread hashing in order).

    python -m bench.store_fetch_bench --disk-tier --mb 84 --runs 7 --read-threads 1,4,8,16
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import grpc
import torch
from safetensors import safe_open

from adapter_store.client import AdapterStoreClient
from adapter_store.push import push_adapter
from adapter_store.records import AdapterInfo, FileEntry, Manifest, adapter_digest, file_offsets
from adapter_store.s3 import S3Store
from adapter_store.samples import sized_adapter
from adapter_store.seaweedfs import SeaweedFS
from bench import page_cache
from inference_node.adapters.direct_reads import DirectReader, DirectReadSettings
from inference_node.adapters.disk_tier import CHUNKS_FILE, READ_THREADS, DiskTier
from inference_node.adapters.slots import SlotBuffers
from inference_node.adapters.sources import host_buffer
from inference_node.adapters.store_source import StoreSource
from inference_node.model.config import ModelConfig
from lora_common.malloc import keep_freed_buffers

BUCKET = "bench-adapters"
NAME = "bench-100mb"
RANK = 64


def child(args: argparse.Namespace) -> None:
    """The store, in its own process: commands on stdin ('clear', 'quit'), replies on stdout."""
    import logging

    from adapter_store.read_plans import DirectReads
    from adapter_store.server import BackgroundStore, StoreSettings

    logging.basicConfig(level=logging.WARNING)
    keep_freed_buffers()  # as `adapter-store serve` does
    settings = StoreSettings(bucket=BUCKET, s3_endpoint=args.endpoint, cache_dir=args.cache_dir, port=0,
                             poll_interval_s=60, shard_bytes=args.shard_kb << 10,
                             direct_reads=DirectReads(enabled=True))  # the streaming rows never ask
    store = BackgroundStore(settings)
    raw_port = asyncio.run_coroutine_threadsafe(serve_raw(args.shard_kb << 10), store.loop).result(30)
    print(json.dumps({"address": store.address, "raw": f"127.0.0.1:{raw_port}"}), flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command in ("clear", "settle"):
            store.cache.wait_idle(60)  # the last download is stored (fsynced) after its stream ends
            if command == "clear":
                store.cache.clear()
            print(json.dumps({command: True}), flush=True)
        elif command == "quit":
            break
    store.stop()


async def serve_raw(shard_bytes: int) -> int:
    """A bare gRPC stream next to the store: `nbytes` as prebuilt messages of `shard_bytes`,
    nothing read, hashed or encoded: what gRPC alone carries on this machine."""
    payload = os.urandom(shard_bytes)

    async def stream(request: bytes, context: grpc.aio.ServicerContext) -> None:
        left = int(request)
        while left > 0:
            await context.write(payload[:min(left, shard_bytes)])
            left -= shard_bytes

    server = grpc.aio.server(options=[("grpc.max_send_message_length", 64 << 20)])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "bench.Raw", {"Stream": grpc.unary_stream_rpc_method_handler(stream)})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    _RAW_SERVERS.append(server)
    return port


_RAW_SERVERS: list = []


class StoreProcess:
    def __init__(self, server: SeaweedFS, cache_dir: Path, shard_kb: int) -> None:
        env = {**os.environ, **server.env()}
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.store_fetch_bench", "--child",
                                      "--endpoint", server.endpoint_url,
                                      "--cache-dir", str(cache_dir), "--shard-kb", str(shard_kb)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        reply = self._reply()
        self.address, self.raw_address = reply["address"], reply["raw"]

    def _reply(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the store process exited")
        return json.loads(line)

    def command(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        self._reply()

    def clear_cache(self) -> None:
        """Empties the store's disk cache: the next fetch downloads from S3."""
        self.command("clear")

    def settle(self) -> None:
        """Waits until the store has stored its last download (so it does not compete)."""
        self.command("settle")

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("quit\n")
        self.proc.stdin.flush()
        self.proc.wait(30)


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Row:
    median: float       # MB/s
    best: float         # MB/s
    size: int           # bytes per run
    cpu_ms: list[float]  # median CPU per run of: this process (the node's side), the store, SeaweedFS


def measure(run: Callable[[], int], runs: int, pids: list[int],
            before: Callable[[], None] | None = None) -> Row:
    """Throughput over `runs` runs, and the CPU each process spent per run: on a machine
    shared with other work, the CPU columns stay put where the rates do not."""
    rates, cpu, size = [], [], 0
    for _ in range(runs):
        if before is not None:
            before()
        start_cpu = [time.process_time()] + [process_cpu_s(pid) for pid in pids]
        started = time.perf_counter()
        size = run()
        rates.append(size / (time.perf_counter() - started) / 1e6)
        end_cpu = [time.process_time()] + [process_cpu_s(pid) for pid in pids]
        cpu.append([(b - a) * 1000 for a, b in zip(start_cpu, end_cpu)])
    return Row(statistics.median(rates), max(rates), size, [statistics.median(c) for c in zip(*cpu)])


def bench_model(layers: int) -> ModelConfig:
    """A base model whose projections fit the synthetic adapter (hidden 2048, MLP 8192, KV 512)."""
    return ModelConfig.from_dict({"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 8192,
                                  "num_hidden_layers": layers, "num_attention_heads": 32,
                                  "num_key_value_heads": 8})


def disk_tier_bench(args: argparse.Namespace) -> None:
    """DiskTier.read alone: MB/s cold and warm per reader thread count (see the module doc)."""
    cuda = torch.cuda.is_available()
    weights, config = os.urandom(int(args.mb * 1e6)), b'{"r": 16}'
    files = (FileEntry("adapter_config.json", len(config), hashlib.sha256(config).hexdigest()),
             FileEntry("adapter_model.safetensors", len(weights), hashlib.sha256(weights).hexdigest()))
    digest = adapter_digest(f.sha256 for f in files)
    manifest = Manifest(AdapterInfo(NAME, digest[:16], rank=16, valid=True, size_bytes=len(config) + len(weights),
                                    updated_at=1), config.decode(), files, digest)
    total = len(config) + len(weights)
    buffer = host_buffer(file_offsets(manifest)[-1] + len(weights), cuda).numpy()
    with tempfile.TemporaryDirectory(prefix="disk-tier-bench-", dir=args.workdir) as tmp:
        root = Path(tmp)
        writer = DiskTier(root, 1 << 40)
        writer.put(manifest, [config, weights])
        writer.close()  # one tier a folder: each reader count's below opens it again
        folder = root / digest
        paths = [folder / str(i) for i in range(len(files))]
        recorded = (folder / CHUNKS_FILE).read_bytes()
        cached: list[float] = []

        def drop() -> None:
            if all(page_cache.drop(p) for p in paths):
                share = page_cache.resident_share(paths[-1])
                if share is not None:
                    cached.append(share)

        def as_older_entry() -> None:
            tier.flush()  # the last read's chunk digests are written, then taken away
            (folder / CHUNKS_FILE).unlink(missing_ok=True)
            drop()

        rows = []
        for threads in args.read_threads:
            tier = DiskTier(root, 1 << 40, read_threads=threads)
            entry = tier.lookup(NAME)
            assert entry is not None

            def read() -> int:
                tier.read(entry, lambda n: buffer[:n])
                return total
            rows.append((f"{threads:>2} readers, cold (page cache dropped)", measure(read, args.runs, [], drop)))
            rows.append((f"{threads:>2} readers, warm (page cache)", measure(read, args.runs, [], None)))
            older = measure(read, args.runs, [], as_older_entry)
            tier.close()  # it wrote the chunk digests again: the same record
            assert (folder / CHUNKS_FILE).read_bytes() == recorded
            rows.append((f"{threads:>2} readers, cold, older entry (whole-file sha256)", older))
        filesystem = page_cache.filesystem_of(root)
    print(f"\nDiskTier.read of {total / 1e6:.1f} MB on {filesystem}; median and best of "
          f"{args.runs} runs; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; reused host buffer, "
          f"{'page-locked' if cuda else 'pageable'}; share of pages cached after a drop: "
          f"{max(cached) if cached else float('nan'):.2f} at most\n")
    width = max(len(r[0]) for r in rows)
    print(f"{'read':<{width}}  {'median MB/s':>11}  {'best MB/s':>9}  {'ms (median)':>11}  {'CPU ms per run':>14}")
    for label, row in rows:
        print(f"{label:<{width}}  {row.median:>11.1f}  {row.best:>9.1f}  {row.size / row.median / 1e3:>11.1f}  "
              f"{row.cpu_ms[0]:>14.0f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=100.0, help="adapter size in MB")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--shard-kb", type=int, default=4096, help="the store's shard size")
    parser.add_argument("--single-part", action="store_true",
                        help="upload the weights in one PUT (their ETag is then their MD5, which a download "
                             "without a recorded digest checks); default: multipart above 16 MiB, as push does")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch intra-op threads in this process (0: torch's default, as the node runs)")
    parser.add_argument("--disk-tier", action="store_true",
                        help="only the node's disk tier: DiskTier.read cold and warm (no store, no S3)")
    parser.add_argument("--read-threads", type=lambda s: [int(t) for t in s.split(",")], default=[READ_THREADS],
                        help=f"--disk-tier: comma-separated reader thread counts (default {READ_THREADS})")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="--disk-tier: where the tier's files go (default: the temporary directory)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return
    if args.disk_tier:
        disk_tier_bench(args)
        return

    if args.threads:
        torch.set_num_threads(args.threads)
    keep_freed_buffers()  # as the node's engine core process does
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    with tempfile.TemporaryDirectory(prefix="store-bench-") as tmp, SeaweedFS(Path(tmp) / "seaweedfs") as server:
        server.create_bucket(BUCKET)
        folder = sized_adapter(Path(tmp) / NAME, args.mb, rank=RANK)
        s3_client = server.boto3_client()
        push_adapter(folder, NAME, S3Store(BUCKET, s3_client), "adapters/", progress=False,
                     **({"multipart_bytes": 1 << 40} if args.single_part else {}))
        key = f"adapters/{NAME}/adapter_model.safetensors"
        weights_size = (folder / "adapter_model.safetensors").stat().st_size
        with safe_open(str(folder / "adapter_model.safetensors"), "np") as tensors:
            model = bench_model(1 + max(int(k.split(".")[4]) for k in tensors.keys()))  # ...layers.{i}...

        def boto3_get() -> int:
            return len(s3_client.get_object(Bucket=BUCKET, Key=key)["Body"].read())

        def boto3_transfer() -> int:
            buffer = io.BytesIO()
            s3_client.download_fileobj(BUCKET, key, buffer)
            return buffer.getbuffer().nbytes

        store = StoreProcess(server, Path(tmp) / "cache", args.shard_kb)
        pids = [store.proc.pid, server.process.pid]
        try:
            with AdapterStoreClient(store.address) as client:
                manifest = client.get_manifest(NAME)
                total = sum(f.size for f in manifest.files)
                reused = host_buffer(file_offsets(manifest)[-1] + manifest.files[-1].size, cuda)

                def fetch_fresh() -> int:
                    fetched = client.fetch(NAME, deadline_s=600, allocate=lambda n: host_buffer(n, cuda).numpy())
                    return sum(len(b) for b in fetched.files.values())

                raw_channel = grpc.insecure_channel(store.raw_address,
                                                    options=[("grpc.max_receive_message_length", 64 << 20)])
                raw_stream = raw_channel.unary_stream("/bench.Raw/Stream")

                def grpc_alone() -> int:
                    return sum(len(m) for m in raw_stream(str(total).encode(), timeout=600))

                reader = DirectReader()

                def fetch_direct() -> int:
                    fetched = reader.read(client.get_read_plan(NAME), lambda n: host_buffer(n, cuda).numpy())
                    return sum(len(b) for b in fetched.files.values())

                def fetch_reused() -> int:
                    fetched = client.fetch(NAME, deadline_s=600, allocate=lambda n: reused[:n].numpy())
                    return sum(len(b) for b in fetched.files.values())

                from_store = StoreSource(store.address, model, RANK, pin_memory=cuda)
                direct_source = StoreSource(store.address, model, RANK, pin_memory=cuda,
                                            direct_reads=DirectReadSettings())
                disk = DiskTier(Path(tmp) / "node-disk", 8 << 30)
                from_disk = StoreSource(store.address, model, RANK, pin_memory=cuda, disk=disk)
                from_disk.load(NAME, "")
                disk.flush()
                loaded = {}

                def node_load(source: StoreSource) -> Callable[[], int]:
                    def run() -> int:
                        loaded["weights"] = source.load(NAME, "")
                        return total
                    return run

                buffers = SlotBuffers(model, 1, RANK, torch.float32, device)

                def to_slot() -> int:
                    buffers.free(0)  # its rows again: the copy is what is measured
                    assert buffers.place(0, buffers.ranks_of(loaded["weights"]))
                    event = buffers.write(0, loaded["weights"])
                    if event is not None:
                        event.synchronize()
                    return loaded["weights"].nbytes

                rows = [
                    ("boto3 get_object (one stream)", measure(boto3_get, args.runs, pids)),
                    ("boto3 download_fileobj (threaded)", measure(boto3_transfer, args.runs, pids)),
                    ("gRPC alone: same bytes as bare messages (nothing checked)", measure(grpc_alone, args.runs, pids)),
                    ("store -> node cold (S3 -> store -> node host memory)",
                     measure(fetch_fresh, args.runs, pids, store.clear_cache)),
                    ("store -> node cold, direct reads (plan from the store, S3 -> node host memory)",
                     measure(fetch_direct, args.runs, pids, store.clear_cache)),
                    ("node load, direct reads (+ validation, views)",
                     measure(node_load(direct_source), args.runs, pids)),
                ]
                store.settle()
                rows += [
                    ("store -> node warm (store disk cache -> node host memory)", measure(fetch_fresh, args.runs, pids)),
                    ("store -> node warm, into one reused host buffer", measure(fetch_reused, args.runs, pids)),
                    ("node load from the store, warm (+ validation, views)", measure(node_load(from_store), args.runs, pids)),
                    ("node load from its disk tier (sha256-verified, header checked)", measure(node_load(from_disk), args.runs, pids)),
                    (f"host -> slot copy ({'CUDA, pinned' if cuda else 'CPU slot buffers'})",
                     measure(to_slot, args.runs, pids)),
                ]
                from_store.close()
                direct_source.close()
                reader.close()
                from_disk.close()
                raw_channel.close()
        finally:
            store.close()

    boto3_rate = rows[0][1].median
    print(f"\nadapter: {weights_size / 1e6:.1f} MB safetensors ({'one PUT' if args.single_part else 'multipart'}); "
          f"shards of {args.shard_kb} KiB; median and best of "
          f"{args.runs} runs; SeaweedFS and store on loopback; {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f}; torch threads {torch.get_num_threads()}; host memory "
          f"{'page-locked' if cuda else 'pageable'}\n")
    width = max(len(r[0]) for r in rows)
    print(f"{'path':<{width}}  {'MB':>6}  {'median MB/s':>11}  {'best MB/s':>9}  "
          f"{'CPU ms per run: node':>20}  {'store':>5}  {'S3':>5}")
    for label, row in rows:
        node_ms, store_ms, s3_ms = row.cpu_ms
        print(f"{label:<{width}}  {row.size / 1e6:>6.1f}  {row.median:>11.1f}  {row.best:>9.1f}  "
              f"{node_ms:>20.0f}  {store_ms:>5.0f}  {s3_ms:>5.0f}")
    print(f"\ntargets (issue 32): cold >= {min(1000.0, boto3_rate / 1.5):.0f} MB/s (1 GB/s, or boto3's median / 1.5 "
          "if lower; streamed or by direct reads); warm >= 1000 MB/s")


if __name__ == "__main__":
    main()
