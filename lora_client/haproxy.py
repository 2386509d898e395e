"""HAProxy in front of a fleet of inference nodes: its configuration, process and stats.

Routing. gRPC is HTTP/2 end to end (`proto h2` on the listener and on every server). A
request that carries the `x-lora-adapter` header (the adapter it names; the typed client
and lora-client set it) is hashed on it: consistent hashing, so each adapter's traffic
lands on one node and a node that leaves or joins moves only its share of adapters, with
bounded load (`hash-balance-factor`): a node already serving more than that percentage of
the average number of requests is skipped for the next one on the ring, so one hot adapter
spills over instead of sinking its node. Requests without the header (the base model) go
to the least busy node. The header is only a routing hint: the node serves whatever the
request body names.

Health. HAProxy has no gRPC health check, and its HTTP check cannot send a gRPC body (a
message frame starts with NUL bytes, which its config strings cannot hold). So the check is
a tcp-check that speaks HTTP/2 itself: the connection preface, an empty SETTINGS frame and
one grpc.health.v1.Health/Check call for the node's service, then it waits for the answer's
message and passes only on SERVING. A draining node answers NOT_SERVING at once and leaves
the pool within a check or two, while its running answers finish; a node whose engine died
answers NOT_SERVING or nothing. Both the hashing backend and the base-model backend follow
this one check (`track`).

The OpenAI HTTP entry (with `http_port`): a second frontend in HTTP/1.1 over the nodes'
HTTP APIs, routed the same way. The adapter a request names is its `x-lora-adapter` header
or else its JSON body's `model` (the body is buffered: `option http-buffer-request`, bodies up
to `tune.bufsize`, raised to 64 KiB; a larger one whose `model` comes after that, like a long
chat from the openai client, which writes `messages` first, routes least-busy unless it has
the header): hashed with the same bounded load, the base model's requests (`base_model`),
and those naming no model (GET /v1/models), to the least busy node. Its servers `track` the
gRPC check of the same node.

Retries at the proxy: a request whose connection to a node fails, or that gets no response
at all (the node died before answering), is sent to another node (`retry-on`,
`option redispatch`); nothing was streamed to the client then. Refusals by a draining node
are gRPC statuses inside a 200 response, which HAProxy passes through: clients retry them
(lora_client.node_client.RetryPolicy, or gRPC's retry policy, see docs/FLEET.md).
"""
from __future__ import annotations

import argparse
import csv
import io
import struct
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from .node_client import ADAPTER_HEADER, NODE_HEADER
from .processes import Child

HEALTH_SERVICE = "lora.v1.InferenceNode"
HEALTH_PATH = "/grpc.health.v1.Health/Check"
# The Check answer's message: gRPC frame (not compressed, 2 bytes) holding field 1 (status)
# = 1 (SERVING) or 2 (NOT_SERVING).
SERVING_REPLY = "00000000020801"
ANY_STATUS_REPLY = "000000000208(01|02)"

Routing = Literal["adapter", "roundrobin"]


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    """One HTTP/2 frame (RFC 9113 section 4.1)."""
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def _literal(name: bytes, value: bytes) -> bytes:
    """An HPACK header field without indexing, new name, no Huffman (RFC 7541 section 6.2.2)."""
    assert len(name) < 127 and len(value) < 127
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


def grpc_health_check_request(service: str = HEALTH_SERVICE) -> bytes:
    """The bytes a client sends for one grpc.health.v1.Health/Check call over cleartext
    HTTP/2 (prior knowledge): preface, empty SETTINGS, HEADERS, one DATA frame that ends the
    stream with the HealthCheckRequest message."""
    name = service.encode()
    message = b"\x0a" + bytes([len(name)]) + name if name else b""   # field 1, length-delimited
    body = b"\x00" + struct.pack(">I", len(message)) + message       # gRPC frame: not compressed
    headers = b"".join([
        b"\x83",  # :method POST (static table entry 3)
        b"\x86",  # :scheme http (entry 6)
        _literal(b":path", HEALTH_PATH.encode()),
        _literal(b":authority", b"lora-node"),
        _literal(b"content-type", b"application/grpc"),
        _literal(b"te", b"trailers"),
    ])
    return (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(0x4, 0, 0, b"")
            + _frame(0x1, 0x4, 1, headers)      # HEADERS, END_HEADERS
            + _frame(0x0, 0x1, 1, body))        # DATA, END_STREAM


@dataclass(frozen=True)
class ProxySettings:
    """What the proxy listens on and where it sends requests."""

    servers: tuple[tuple[str, str], ...]   # (name, HOST:PORT) of each node
    port: int = 50050                      # gRPC, HTTP/2 cleartext
    stats_port: int = 8404                 # HTTP stats page, with ;csv (lora-client fleet reads it)
    host: str = "127.0.0.1"
    routing: Routing = "adapter"           # roundrobin: the baseline adapter affinity is measured against
    balance_factor: int = 150              # hash-balance-factor: a node's most load, in % of the average
    check_interval_ms: int = 500
    check_fall: int = 2                    # failed checks before a node leaves the pool
    check_rise: int = 2                    # passed checks before it rejoins
    dns_resolver: str = ""                 # e.g. 127.0.0.11:53 in Docker: names resolved at run time
    http_port: int = 0                     # the OpenAI HTTP entry (0: none)
    http_servers: tuple[tuple[str, str], ...] = ()  # (name, HOST:PORT of its HTTP API) of each node
    base_model: str = ""                   # the nodes' base model name: its HTTP requests go least-busy

    def __post_init__(self) -> None:
        if self.http_port and {n for n, _ in self.http_servers} != {n for n, _ in self.servers}:
            raise ValueError("the HTTP entry needs each node's HTTP address, under the names of `servers`")


def render_config(s: ProxySettings) -> str:
    """haproxy.cfg for these settings."""
    check = grpc_health_check_request().hex()
    hashed = ["    balance hdr(%s)" % ADAPTER_HEADER, "    hash-type consistent",
              f"    hash-balance-factor {s.balance_factor}"] if s.routing == "adapter" else ["    balance roundrobin"]
    base_balance = "leastconn" if s.routing == "adapter" else "roundrobin"
    checked = f"check inter {s.check_interval_ms}ms fall {s.check_fall} rise {s.check_rise}"
    resolved = ""
    lines = [
        "# Generated by lora_client.haproxy (python -m lora_client.haproxy --help); see docs/FLEET.md.",
        "global",
        "    log stdout format raw local0 info",
        *(["    tune.bufsize 65536"] if s.http_port else []),   # an OpenAI body, buffered to read its model
        "",
    ]
    if s.dns_resolver:
        lines += ["resolvers dns", f"    nameserver dns {s.dns_resolver}", "    hold valid 5s", ""]
        resolved = " resolvers dns init-addr last,libc,none"
    lines += [
        "defaults",
        "    mode http",
        "    log global",
        "    option httplog",
        "    timeout connect 2s",
        "    timeout client 10m",   # a quiet stream (a long prompt's prefill) is not a dead one
        "    timeout server 10m",
        "    timeout queue 30s",
        "    timeout check 2s",
        "    retries 3",
        "    option redispatch 1",
        "    retry-on conn-failure empty-response",
        "",
        "frontend grpc",
        f"    bind {s.host}:{s.port} proto h2",
        f"    acl names_adapter req.hdr({ADAPTER_HEADER}) -m len 1:",
        "    use_backend by_adapter if names_adapter",
        "    default_backend base_model",
        "",
        "frontend stats",
        f"    bind {s.host}:{s.stats_port}",
        "    stats enable",
        "    stats uri /stats",
        "    stats refresh 2s",
        "    stats show-legends",   # node addresses in the CSV: lora-client fleet dials them
        "",
        "backend by_adapter",
        *hashed,
        f"    http-response set-header {NODE_HEADER} %s",
        "    option tcp-check",
        f"    tcp-check send-binary {check}",
        # rbinary matches a regex against the hex of what came back: wait for the answer...
        f"    tcp-check expect rbinary {ANY_STATUS_REPLY}",
        # ...then SERVING, or fail at once (min-recv 0: no waiting for more bytes).
        f"    tcp-check expect min-recv 0 binary {SERVING_REPLY}",
        f"    default-server proto h2 {checked}{resolved}",
        *(f"    server {name} {address}" for name, address in s.servers),
        "",
        "backend base_model",
        f"    balance {base_balance}",
        f"    http-response set-header {NODE_HEADER} %s",
        f"    default-server proto h2{resolved}",   # up or down with the checked server it tracks
        *(f"    server {name} {address} track by_adapter/{name}" for name, address in s.servers),
        "",
    ]
    if s.http_port:
        lines += _http_entry(s, hashed, base_balance, resolved)
    return "\n".join(lines)


def _http_entry(s: ProxySettings, hashed: list[str], base_balance: str, resolved: str) -> list[str]:
    """The OpenAI HTTP frontend and its two backends (module docstring)."""
    named = f"req.hdr({ADAPTER_HEADER}) -m len 1:"
    base = [f"    acl is_base_model var(txn.model) -m str {s.base_model}"] if s.base_model else []
    default_server = [f"    default-server{resolved}"] if resolved else []
    return [
        "frontend openai",
        f"    bind {s.host}:{s.http_port}",
        "    option http-buffer-request",
        f"    http-request set-var(txn.model) req.hdr({ADAPTER_HEADER}) if {{ {named} }}",
        f"    http-request set-var(txn.model) req.body,json_query('$.model') unless {{ {named} }}",
        "    acl names_model var(txn.model) -m len 1:",
        *base,
        f"    http-request set-header {ADAPTER_HEADER} %[var(txn.model)] if names_model",
        f"    use_backend http_by_adapter if names_model{' !is_base_model' if s.base_model else ''}",
        "    default_backend http_base_model",
        "",
        "backend http_by_adapter",
        *hashed,
        f"    http-response set-header {NODE_HEADER} %s",
        *default_server,
        *(f"    server {name} {address} track by_adapter/{name}" for name, address in s.http_servers),
        "",
        "backend http_base_model",
        f"    balance {base_balance}",
        f"    http-response set-header {NODE_HEADER} %s",
        *default_server,
        *(f"    server {name} {address} track by_adapter/{name}" for name, address in s.http_servers),
        "",
    ]


@dataclass(frozen=True)
class ServerState:
    """One node as the proxy sees it (a row of its stats CSV)."""

    name: str
    address: str      # HOST:PORT
    status: str       # UP, DOWN, MAINT, "UP 1/2" (rising), "DOWN 1/2" (falling)...
    check: str        # last check: L7OK, L7RSP (answered, not SERVING), L4CON (refused)...
    active: int       # requests it serves now (in this backend)

    @property
    def up(self) -> bool:
        return self.status.startswith("UP")


def read_stats(stats_url: str, backend: str = "by_adapter", timeout: float = 5.0) -> list[ServerState]:
    """The nodes of the proxy's hashing backend, from its stats page (`<url>;csv`)."""
    with urllib.request.urlopen(f"{stats_url};csv", timeout=timeout) as reply:
        text = reply.read().decode()
    rows = csv.DictReader(io.StringIO(text.lstrip("# ")))
    return [ServerState(r["svname"], r["addr"], r["status"], r["check_status"], int(r["scur"] or 0))
            for r in rows if r["pxname"] == backend and r["svname"] not in ("FRONTEND", "BACKEND")]


def haproxy_binary() -> str | None:
    import shutil

    return shutil.which("haproxy")


MISSING = ("HAProxy is not installed: install the Debian/Ubuntu package `haproxy` "
           "(apt-get install -y haproxy) or see https://www.haproxy.org")


class Proxy:
    """HAProxy as a child process, its config written from ProxySettings."""

    def __init__(self, settings: ProxySettings, work_dir: Path) -> None:
        binary = haproxy_binary()
        if binary is None:
            raise RuntimeError(MISSING)
        self.settings = settings
        work_dir.mkdir(parents=True, exist_ok=True)
        self.config_path = work_dir / "haproxy.cfg"
        self.config_path.write_text(render_config(settings))
        self.child = Child("haproxy", [binary, "-db", "-f", str(self.config_path)], work_dir / "haproxy.log")

    @property
    def target(self) -> str:
        return f"{self.settings.host}:{self.settings.port}"

    @property
    def stats_url(self) -> str:
        return f"http://{self.settings.host}:{self.settings.stats_port}/stats"

    def servers(self) -> dict[str, ServerState]:
        return {s.name: s for s in read_stats(self.stats_url)}

    def wait(self, predicate, timeout: float, what: str) -> dict[str, ServerState]:
        """Polls the stats page until predicate(servers) holds; raises if the proxy dies."""
        deadline = time.monotonic() + timeout
        while True:
            if not self.child.alive():
                raise self.child.died()
            try:
                servers = self.servers()
                if predicate(servers):
                    return servers
            except OSError:
                servers = {}
            if time.monotonic() > deadline:
                raise TimeoutError(f"the proxy: {what} not seen in {timeout:.0f}s; now "
                                   + ", ".join(f"{s.name} {s.status} ({s.check})" for s in servers.values()))
            time.sleep(0.1)

    def wait_all_up(self, timeout: float = 60.0) -> None:
        self.wait(lambda servers: len(servers) == len(self.settings.servers)
                  and all(s.status == "UP" for s in servers.values()), timeout, "every node UP")

    def stop(self) -> int:
        return self.child.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lora_client.haproxy",
                                 description="print an haproxy.cfg that routes gRPC by adapter over nodes")
    ap.add_argument("--server", action="append", required=True, metavar="NAME=HOST:PORT",
                    help="a node (repeat for each)")
    ap.add_argument("--port", type=int, default=50050, help="the proxy's gRPC port")
    ap.add_argument("--stats-port", type=int, default=8404, help="the stats page's port")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on")
    ap.add_argument("--routing", choices=["adapter", "roundrobin"], default="adapter")
    ap.add_argument("--balance-factor", type=int, default=150, help="hash-balance-factor (percent)")
    ap.add_argument("--dns-resolver", default="", help="HOST:PORT of a DNS server for server names (Docker: "
                    "127.0.0.11:53)")
    ap.add_argument("--http-port", type=int, default=0,
                    help="the OpenAI HTTP entry's port, routed by the body's model (0: no HTTP entry)")
    ap.add_argument("--http-server", action="append", default=[], metavar="NAME=HOST:PORT",
                    help="a node's OpenAI HTTP API (repeat for each, with the names of --server)")
    ap.add_argument("--base-model", default="", help="the nodes' base model name: its HTTP requests go to the "
                    "least busy node instead of being hashed")
    args = ap.parse_args(argv)
    servers = tuple(tuple(s.split("=", 1)) for s in args.server)
    http_servers = tuple(tuple(s.split("=", 1)) for s in args.http_server)
    if any(len(s) != 2 for s in servers + http_servers):
        ap.error("--server and --http-server take NAME=HOST:PORT")
    try:
        settings = ProxySettings(servers, args.port, args.stats_port, args.host, args.routing, args.balance_factor,
                                 dns_resolver=args.dns_resolver, http_port=args.http_port,
                                 http_servers=http_servers, base_model=args.base_model)
    except ValueError as exc:
        ap.error(str(exc))
    sys.stdout.write(render_config(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
