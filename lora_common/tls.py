"""TLS and mutual TLS for the gRPC servers and clients of both services.

One place turns PEM file paths (flags or env) into gRPC credentials, so the node, the store
and the clients agree on what each combination means:
- a server with a certificate and key serves TLS; with a client CA as well it requires and
  verifies client certificates (mutual TLS);
- a client with a CA verifies the server against it (without one, against the system's
  roots); with a certificate and key it presents them to servers that ask.
Nothing set means plaintext, the default of the local stack. Files are read and checked at
startup, so a wrong path or a swapped cert/key fails with the flag's name, not at the first
handshake.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import grpc


class TLSConfigError(ValueError):
    """A TLS setting that cannot work; the message names the flag to fix."""


def _read_pem(path: str, flag: str, marker: bytes) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise TLSConfigError(f"{flag} {path}: cannot read it ({exc.strerror or exc})") from None
    if b"-----BEGIN" not in data or marker not in data:
        kind = "certificate" if marker == b"CERTIFICATE-----" else "private key"
        raise TLSConfigError(f"{flag} {path}: not a PEM {kind}")
    return data


_CERT, _KEY = b"CERTIFICATE-----", b"PRIVATE KEY-----"


@dataclass(frozen=True)
class ServerTLS:
    """A server's TLS: cert + key turn it on; client_ca makes client certificates mandatory."""

    cert: str | None = None
    key: str | None = None
    client_ca: str | None = None
    flag: str = "--tls"  # the flags' common prefix, for error messages

    @property
    def enabled(self) -> bool:
        return bool(self.cert or self.key or self.client_ca)

    @property
    def mutual(self) -> bool:
        return bool(self.client_ca)

    def credentials(self) -> grpc.ServerCredentials | None:
        """None for plaintext; raises TLSConfigError for an incomplete or unreadable setting."""
        if not self.enabled:
            return None
        if not (self.cert and self.key):
            raise TLSConfigError(f"{self.flag}-cert and {self.flag}-key are both needed to serve TLS"
                                 + (f" ({self.flag}-client-ca alone is not enough)" if self.client_ca else ""))
        pair = (_read_pem(self.key, f"{self.flag}-key", _KEY), _read_pem(self.cert, f"{self.flag}-cert", _CERT))
        ca = _read_pem(self.client_ca, f"{self.flag}-client-ca", _CERT) if self.client_ca else None
        return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)

    def describe(self) -> str:
        return "plaintext" if not self.enabled else ("mutual TLS" if self.mutual else "TLS")


@dataclass(frozen=True)
class ClientTLS:
    """A client's TLS: on when `enabled` or any file is given; ca=None trusts the system's roots."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    server_name: str | None = None  # the name the server's certificate must carry, if not the target's host
    enabled: bool = False
    flag: str = "--tls"

    @property
    def on(self) -> bool:
        return bool(self.enabled or self.ca or self.cert or self.key)

    def credentials(self) -> grpc.ChannelCredentials | None:
        if not self.on:
            return None
        if bool(self.cert) != bool(self.key):
            raise TLSConfigError(f"{self.flag}-cert and {self.flag}-key go together (a client certificate "
                                 "needs its private key)")
        return grpc.ssl_channel_credentials(
            root_certificates=_read_pem(self.ca, f"{self.flag}-ca", _CERT) if self.ca else None,
            private_key=_read_pem(self.key, f"{self.flag}-key", _KEY) if self.key else None,
            certificate_chain=_read_pem(self.cert, f"{self.flag}-cert", _CERT) if self.cert else None)

    def options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.on and self.server_name else []

    def describe(self) -> str:
        return "plaintext" if not self.on else ("mutual TLS" if self.cert else "TLS")


# gRPC servers listen with SO_REUSEPORT by default, so a second server started on a port that
# is already served binds it too and the kernel splits the connections between the two: a
# client then gets UNIMPLEMENTED from whichever service answered. Both servers pass this
# option, so a port in use fails at startup with a message instead.
EXCLUSIVE_PORT = ("grpc.so_reuseport", 0)


def add_port(server: grpc.aio.Server | grpc.Server, address: str, tls: ServerTLS | None) -> int:
    """Listens on `address` with TLS when configured; returns the port. A port that cannot be
    bound (in use, or an address not on this host) raises OSError naming it."""
    credentials = tls.credentials() if tls is not None else None
    try:
        port = (server.add_insecure_port(address) if credentials is None
                else server.add_secure_port(address, credentials))
    except RuntimeError:  # grpcio raises on a failed bind; older versions returned 0
        port = 0
    if port == 0:
        raise OSError(f"cannot listen on {address}: the port is in use or the address is not "
                      "on this host; choose another --host/--port")
    return port


def open_channel(target: str, tls: ClientTLS | None = None,
                 options: Sequence[tuple[str, object]] = ()) -> grpc.Channel:
    """A blocking-API channel to `target`, secure when `tls` is on."""
    credentials = tls.credentials() if tls is not None else None
    if credentials is None:
        return grpc.insecure_channel(target, options=list(options))
    return grpc.secure_channel(target, credentials, options=list(options) + tls.options())


def add_server_flags(parser: argparse.ArgumentParser, what: str) -> None:
    """--tls-cert, --tls-key, --tls-client-ca of a server (`what` names it in the help)."""
    parser.add_argument("--tls-cert", default=None,
                        help=f"PEM certificate (chain) of the {what}; with --tls-key it serves TLS only")
    parser.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    parser.add_argument("--tls-client-ca", default=None,
                        help="PEM CA bundle: when set, clients must present a certificate it signed (mutual TLS)")


def add_client_flags(parser: argparse.ArgumentParser, prefix: str, what: str) -> None:
    """--<prefix>, --<prefix>-ca, --<prefix>-cert, --<prefix>-key, --<prefix>-server-name."""
    parser.add_argument(f"--{prefix}", action="store_true",
                        help=f"connect to the {what} over TLS (implied by --{prefix}-ca/-cert/-key; "
                             "without a CA the system's roots are trusted)")
    parser.add_argument(f"--{prefix}-ca", default=None, help=f"PEM CA bundle that signed the {what}'s certificate")
    parser.add_argument(f"--{prefix}-cert", default=None,
                        help=f"PEM client certificate, when the {what} requires one (mutual TLS)")
    parser.add_argument(f"--{prefix}-key", default=None, help=f"PEM private key of --{prefix}-cert")
    parser.add_argument(f"--{prefix}-server-name", default=None,
                        help=f"name the {what}'s certificate must carry when it differs from the host "
                             "dialled (e.g. dialling an IP)")


def server_tls_from_args(args: argparse.Namespace) -> ServerTLS:
    return ServerTLS(cert=args.tls_cert, key=args.tls_key, client_ca=args.tls_client_ca)


def client_tls_from_args(args: argparse.Namespace, prefix: str) -> ClientTLS:
    attr = prefix.replace("-", "_")
    return ClientTLS(ca=getattr(args, f"{attr}_ca"), cert=getattr(args, f"{attr}_cert"),
                     key=getattr(args, f"{attr}_key"), server_name=getattr(args, f"{attr}_server_name"),
                     enabled=getattr(args, attr), flag=f"--{prefix}")


__all__ = ["ClientTLS", "ServerTLS", "TLSConfigError", "add_client_flags", "add_port", "add_server_flags",
           "client_tls_from_args", "open_channel", "server_tls_from_args"]
