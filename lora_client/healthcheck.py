"""`python -m lora_client.healthcheck HOST:PORT [SERVICE]`: exit 0 when the gRPC health
service answers SERVING (used by container health checks).

A server that serves TLS is checked over TLS when LORA_CLIENT_TLS_CA (and, for mutual TLS,
LORA_CLIENT_TLS_CERT / LORA_CLIENT_TLS_KEY) are set, or the --tls-* flags given: the same
names lora-client reads, so one set of variables in a container serves both.
"""
from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lora_common.envargs import EnvArgumentParser
from lora_common.tls import TLSConfigError, add_client_flags, client_tls_from_args, open_channel


def parser() -> EnvArgumentParser:
    ap = EnvArgumentParser(prog="python -m lora_client.healthcheck", env_prefix="LORA_CLIENT",
                           description="exit 0 when a gRPC server's health service answers SERVING")
    ap.add_argument("target", help="HOST:PORT")
    ap.add_argument("service", nargs="?", default="", help="service name (default: the whole server)")
    add_client_flags(ap, "tls", "server")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        channel = open_channel(args.target, client_tls_from_args(args, "tls"))
    except TLSConfigError as exc:
        print(f"{args.target}: {exc}", file=sys.stderr)
        return 2
    try:
        with channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=3)
    except grpc.RpcError as exc:
        print(f"{args.target}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    serving = reply.status == health_pb2.HealthCheckResponse.SERVING
    print(f"{args.target}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}")
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
