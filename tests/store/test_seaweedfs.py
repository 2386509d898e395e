"""The embedded SeaweedFS helper: every port chosen and set, telemetry off, nothing left."""
from __future__ import annotations

import subprocess

from adapter_store.seaweedfs import PORT_NAMES, SeaweedFS


def test_every_port_is_explicit_and_distinct(seaweed: SeaweedFS) -> None:
    command = seaweed._command()
    assert "-master.telemetry=false" in command
    assert f"-ip.bind={seaweed.host}" in command and seaweed.host == "127.0.0.1"
    ports = [seaweed.ports[n] for n in PORT_NAMES]
    assert len(set(ports)) == len(ports)
    for flag in ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
                 "filer.port.grpc", "s3.port", "s3.port.grpc"):
        assert any(arg.startswith(f"-{flag}=") for arg in command), flag
    assert "-s3.port.iceberg=0" in command and "-s3.port.lance=0" in command


def test_listens_only_where_told_and_stops_its_whole_group() -> None:
    with SeaweedFS() as server:
        data_dir = server.data_dir
        pid = server.process.pid
        listening = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
        mine = [line.split()[3] for line in listening.splitlines() if f"pid={pid}," in line]
        assert mine and all(addr.startswith("127.0.0.1:") for addr in mine)
        assert {int(a.rsplit(":", 1)[1]) for a in mine} <= set(server.ports.values())
        client = server.boto3_client()
        server.create_bucket("helper-test")
        client.put_object(Bucket="helper-test", Key="k", Body=b"v")
        server.restart()
        assert client.get_object(Bucket="helper-test", Key="k")["Body"].read() == b"v"
        pid = server.process.pid
    assert subprocess.run(["pgrep", "-g", str(pid)], capture_output=True).stdout == b""
    assert not data_dir.exists()  # a temporary data dir goes with the server
