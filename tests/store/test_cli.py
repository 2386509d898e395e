"""`adapter-store` as people and containers run it: env-configured push, ls, serve with
health, reflection and metrics, and a clean stop on SIGTERM."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from adapter_store.client import AdapterStoreClient
from adapter_store.seaweedfs import SeaweedFS
from lora_common.ports import free_ports
from store_corpus import pickle_only


def cli(*args: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "adapter_store.cli", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture
def env(seaweed: SeaweedFS, bucket: str) -> dict[str, str]:
    return {**os.environ, **seaweed.env(), "ADAPTER_STORE_S3_ENDPOINT": seaweed.endpoint_url,
            "ADAPTER_STORE_BUCKET": bucket, "ADAPTER_STORE_PREFIX": "team/adapters"}


def test_push_and_ls_from_the_environment(env: dict[str, str], adapter_dir, tmp_path: Path, seaweed, bucket) -> None:
    folder = adapter_dir("sql-bot", rank=4)
    done = cli("push", str(folder), "--name", "sql-bot", env=env)
    assert done.returncode == 0, done.stderr
    assert "pushed sql-bot" in done.stdout and "rank 4" in done.stdout
    keys = {o["Key"] for o in seaweed.boto3_client().list_objects_v2(Bucket=bucket)["Contents"]}
    assert keys == {"team/adapters/sql-bot/adapter_config.json", "team/adapters/sql-bot/adapter_model.safetensors"}

    listed = cli("ls", "--json", env=env)
    assert listed.returncode == 0 and '"name": "sql-bot"' in listed.stdout

    pickle_only(tmp_path / "pickled")
    refused = cli("push", str(tmp_path / "pickled"), "--name", "pickled", env=env)
    assert refused.returncode == 2 and "pickle" in refused.stderr
    bad_name = cli("push", str(folder), "--name", "../escape", env=env)
    assert bad_name.returncode == 2 and "'..'" in bad_name.stderr


def test_serve_health_reflection_metrics_and_sigterm(env: dict[str, str], adapter_dir, tmp_path: Path) -> None:
    assert cli("push", str(adapter_dir("pirate")), "--name", "pirate", "--no-progress", env=env).returncode == 0
    port, metrics_port = free_ports(2)
    serve_env = {**env, "ADAPTER_STORE_PORT": str(port), "ADAPTER_STORE_CACHE_DIR": str(tmp_path / "cache"),
                 "ADAPTER_STORE_POLL_INTERVAL": "0.5", "ADAPTER_STORE_METRICS_PORT": str(metrics_port)}
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "adapter_store.cli", "serve"], env=serve_env, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        health = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + 30
        status = None
        while time.monotonic() < deadline:
            try:
                status = health.Check(health_pb2.HealthCheckRequest(service="lora.v1.AdapterStore"), timeout=1).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    break
            except grpc.RpcError:
                pass
            time.sleep(0.2)
        assert status == health_pb2.HealthCheckResponse.SERVING, open(tmp_path / "serve.log").read()

        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        reply = next(reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                  timeout=5))
        services = {s.name for s in reply.list_services_response.service}
        assert {"lora.v1.AdapterStore", "grpc.health.v1.Health"} <= services

        with AdapterStoreClient(f"127.0.0.1:{port}") as client:
            assert len(client.fetch("pirate").weights) > 0
        listed = cli("ls", "--store", f"127.0.0.1:{port}", env=env)
        assert listed.returncode == 0 and "pirate" in listed.stdout and "ok" in listed.stdout

        metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
        assert 'adapter_store_catalog_adapters{valid="true"} 1.0' in metrics
        assert "adapter_store_fetch_bytes_total" in metrics and "adapter_store_cache_hits_total" in metrics

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        output = open(tmp_path / "serve.log").read()
        assert "adapter store stopped" in output and "added pirate" in output
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
