"""A fleet of inference nodes on this machine behind HAProxy, and the view of who holds what.

NodeFleet starts N `inference-node serve` processes on free ports (gRPC and the OpenAI HTTP
API) and the proxy in front of them (lora_client/haproxy.py), with an entry for each API; it restarts them one at a time (a rolling restart: SIGTERM,
the node drains while the proxy stops sending it work, it starts again and rejoins once its
health checks pass) and kills them (SIGKILL) for fault drills. The local stack's --fleet
and the fleet tests use it.

fleet_view() asks every node for its adapters (ListAdapters), nodes given by address or
read from the proxy's stats page, as a proxy cannot be told which node to ask.
"""
from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

import grpc

from lora.v1 import inference_pb2 as pb

from .haproxy import Proxy, ProxySettings, Routing, read_stats
from .node_client import NodeClient
from .processes import Child, console_script, free_port, wait_healthy


@dataclass
class FleetNode:
    name: str
    port: int
    metrics_port: int
    http_port: int
    child: Child | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def http_target(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"


class NodeFleet:
    """N nodes with the same flags (node_args) and the proxy in front of them."""

    def __init__(self, work_dir: Path, size: int, node_args: Sequence[str], routing: Routing = "adapter",
                 env: dict[str, str] | None = None, proxy_port: int = 0, stats_port: int = 0,
                 start_timeout: float = 600.0, drain_timeout: float = 120.0, http_port: int = 0) -> None:
        """Every node serves the OpenAI HTTP API too, and the proxy has its HTTP entry on
        `http_port` (0: a free one) beside gRPC on `proxy_port`."""
        self.work_dir = work_dir
        self.logs = work_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.node_args = list(node_args)
        self.env = env
        self.start_timeout = start_timeout
        self.drain_timeout = drain_timeout
        self.nodes = [FleetNode(f"n{i + 1}", free_port(), free_port(), free_port()) for i in range(size)]
        self.proxy_settings = ProxySettings(tuple((n.name, n.target) for n in self.nodes),
                                            port=proxy_port or free_port(), stats_port=stats_port or free_port(),
                                            routing=routing, http_port=http_port or free_port(),
                                            http_servers=tuple((n.name, n.http_target) for n in self.nodes))
        self.proxy: Proxy | None = None

    # -- addresses ----------------------------------------------------------------------------------
    @property
    def target(self) -> str:
        """The proxy: where clients send requests."""
        return f"{self.proxy_settings.host}:{self.proxy_settings.port}"

    @property
    def stats_url(self) -> str:
        return f"http://{self.proxy_settings.host}:{self.proxy_settings.stats_port}/stats"

    @property
    def http_url(self) -> str:
        """The proxy's OpenAI-compatible API (the openai client's base_url)."""
        return f"http://{self.proxy_settings.host}:{self.proxy_settings.http_port}/v1"

    def node(self, name: str) -> FleetNode:
        return next(n for n in self.nodes if n.name == name)

    def log_path(self, node: FleetNode) -> Path:
        return self.logs / f"inference-node-{node.name}.log"

    # -- life cycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Every node (started together, as loading overlaps), then the proxy, until all are UP."""
        for node in self.nodes:
            self._spawn(node)
        for node in self.nodes:
            wait_healthy(node.target, self.start_timeout, node.child)
        with NodeClient(self.nodes[0].target) as client:  # its HTTP requests go least-busy, not hashed
            self.proxy_settings = replace(self.proxy_settings, base_model=client.stats(timeout=30).model)
        self.proxy = Proxy(self.proxy_settings, self.work_dir / "haproxy")
        self.proxy.wait_all_up()

    def _spawn(self, node: FleetNode) -> None:
        node.child = Child(f"inference-node {node.name}", console_script("inference-node") + [
            "serve", "--host", "127.0.0.1", "--port", str(node.port), "--metrics-port", str(node.metrics_port),
            "--http-port", str(node.http_port), *self.node_args], self.log_path(node), self.env)

    def start_node(self, name: str) -> None:
        """Starts a stopped node on its port again; returns once the proxy has it UP."""
        node = self.node(name)
        self._spawn(node)
        wait_healthy(node.target, self.start_timeout, node.child)
        self.proxy.wait(lambda servers: servers[name].status == "UP", 60, f"{name} back UP")

    def terminate(self, name: str) -> int:
        """SIGTERM to the node's launcher, as an orchestrator sends it; waits for its exit
        (it drains first) and returns its exit code."""
        node = self.node(name)
        node.child.proc.send_signal(signal.SIGTERM)
        try:
            return node.child.proc.wait(self.drain_timeout)
        finally:
            node.child.stop()

    def kill(self, name: str) -> int:
        """SIGKILL to every process of the node at once (a machine that died)."""
        node = self.node(name)
        try:
            os.killpg(node.child.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        code = node.child.proc.wait(30)
        node.child.stop()
        return code

    def rolling_restart(self, report: Callable[[str], None] = print) -> list[int]:
        """One node at a time: SIGTERM (it drains; the proxy stops sending it requests), wait
        for its exit, start it again, wait until the proxy has it UP, then the next. Returns
        the exit codes of the drained nodes."""
        codes = []
        for node in self.nodes:
            started = time.monotonic()
            report(f"[fleet] restarting {node.name} ({node.target}): draining")
            code = self.terminate(node.name)
            codes.append(code)
            report(f"[fleet] {node.name} exited with code {code} after {time.monotonic() - started:.1f}s; starting")
            self.start_node(node.name)
            report(f"[fleet] {node.name} back in the pool after {time.monotonic() - started:.1f}s")
        return codes

    def check_alive(self) -> None:
        """Raises ChildDied for the first process of the fleet that is no longer running."""
        for child in [n.child for n in self.nodes] + [self.proxy.child if self.proxy else None]:
            if child is not None and not child.alive():
                raise child.died()

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
            self.proxy = None
        for node in self.nodes:
            if node.child is not None:
                node.child.stop(self.drain_timeout)

    def __enter__(self) -> "NodeFleet":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- the fleet view ---------------------------------------------------------------------------------

TIER_GPU, TIER_HOST = pb.ADAPTER_TIER_GPU, pb.ADAPTER_TIER_HOST
TIER_NAMES = {pb.ADAPTER_TIER_GPU: "gpu", pb.ADAPTER_TIER_HOST: "host", pb.ADAPTER_TIER_DISK: "disk",
              pb.ADAPTER_TIER_LOADING: "loading"}


@dataclass
class NodeView:
    name: str
    address: str
    proxy_status: str                                # "" when not read from a proxy
    adapters: list[pb.AdapterStatus]
    max_loras: int = 0
    running: int = 0
    waiting: int = 0
    error: str = ""                                  # why the node did not answer


def nodes_from_proxy(stats_url: str) -> list[tuple[str, str, str]]:
    """(name, address, status) of each node behind the proxy."""
    return [(s.name, s.address, s.status) for s in read_stats(stats_url)]


def fleet_view(nodes: Sequence[tuple[str, str, str]], client: Callable[[str], NodeClient],
               timeout: float = 10.0) -> list[NodeView]:
    """ListAdapters and GetStats of every node (asked together; a node that does not
    answer is listed with the error)."""
    def ask(entry: tuple[str, str, str]) -> NodeView:
        name, address, status = entry
        try:
            with client(address) as c:
                listed = c.list_adapters(timeout=timeout)
                stats = c.stats(timeout=timeout)
            return NodeView(name, address, status, list(listed.adapters), listed.max_loras,
                            stats.running_requests, stats.waiting_requests)
        except grpc.RpcError as exc:
            first_line = (exc.details() or "").splitlines()[:1]
            return NodeView(name, address, status, [], error=f"{exc.code().name}: {''.join(first_line)}")

    with ThreadPoolExecutor(max(len(nodes), 1)) as pool:
        return list(pool.map(ask, nodes))


def format_fleet(views: Sequence[NodeView]) -> str:
    """One line per node, then a table: each adapter, and its tier on each node."""
    lines = [f"{'NODE':10} {'ADDRESS':22} {'PROXY':9} {'ON GPU':>6} {'PER STEP':>8} {'ADAPTERS':>8} "
             f"{'RUNNING':>7} {'WAITING':>7}"]
    for v in views:
        if v.error:
            lines.append(f"{v.name:10} {v.address:22} {v.proxy_status or '-':9} {v.error}")
            continue
        on_gpu = sum(1 for a in v.adapters if a.tier == pb.ADAPTER_TIER_GPU)
        lines.append(f"{v.name:10} {v.address:22} {v.proxy_status or '-':9} {on_gpu:>6} {v.max_loras:>8} "
                     f"{len(v.adapters):>8} {v.running:>7} {v.waiting:>7}")
    names = sorted({a.name for v in views for a in v.adapters})
    width = max([len(n) for n in names] + [7])
    lines.append("")
    lines.append(f"{'ADAPTER':{width}} " + " ".join(f"{v.name:>10}" for v in views))
    for name in names:
        cells = []
        for v in views:
            entry = next((a for a in v.adapters if a.name == name), None)
            cells.append("-" if entry is None else TIER_NAMES.get(entry.tier, "?") + ("*" if entry.pinned else ""))
        lines.append(f"{name:{width}} " + " ".join(f"{c:>10}" for c in cells))
    if not names:
        lines.append("(no adapter on any node)")
    lines.append("(ON GPU: adapters in GPU memory; PER STEP: the most distinct adapters one step serves "
                 "(--max-loras); gpu: in GPU memory; host: in host memory; disk: on the node's disk; loading; "
                 "*: pinned; -: not on that node)")
    return "\n".join(lines)
