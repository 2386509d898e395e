"""`python -m lora_client.healthcheck HOST:PORT [SERVICE]`: exit 0 when the gRPC health
service answers SERVING (used by container health checks)."""
from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print("usage: python -m lora_client.healthcheck HOST:PORT [SERVICE]", file=sys.stderr)
        return 2
    target, service = args[0], (args[1] if len(args) > 1 else "")
    try:
        with grpc.insecure_channel(target) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=3)
    except grpc.RpcError as exc:
        print(f"{target}: {exc.code().name}", file=sys.stderr)
        return 1
    serving = reply.status == health_pb2.HealthCheckResponse.SERVING
    print(f"{target}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}")
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
