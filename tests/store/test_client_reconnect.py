"""A node's store channel reconnects within seconds of the store coming back, however long the
store was down (gRPC's default reconnect backoff grows to 2 minutes: a fetch issued after a
long outage could fail at its deadline against a store that is up again)."""
from __future__ import annotations

import socket
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from adapter_store.client import AdapterStoreClient


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_store_client_reconnects_promptly_after_a_long_outage() -> None:
    port = _free_port()
    client = AdapterStoreClient(f"127.0.0.1:{port}")
    stub = health_pb2_grpc.HealthStub(client.channel)
    # 20 s with nothing listening: each failed call makes the channel try again later.
    outage_ends = time.monotonic() + 20
    while time.monotonic() < outage_ends:
        try:
            stub.Check(health_pb2.HealthCheckRequest(), timeout=0.5)
        except grpc.RpcError:
            pass
        time.sleep(0.2)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    try:
        started = time.monotonic()
        reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=15, wait_for_ready=True)
        waited = time.monotonic() - started
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert waited < 3.5, f"the channel took {waited:.1f}s to reconnect to a store that was up"
    finally:
        server.stop(0)
        client.close()
