"""Free TCP ports for the services a launcher starts as children (local stack, SeaweedFS, tests).

A port that bind(0) returns lies in the kernel's ephemeral range. Between choosing it and the
child listening on it, any outgoing connection on the host (a boto3 request, another test's
client) may be given that port as its local end, and the child then cannot listen. Ports are
therefore drawn from below that range, where the kernel hands out none by itself, and each is
handed out once per process.
"""
from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PORT = 10000  # below: well-known and registered services' usual ports

_handed_out: set[int] = set()
_lock = threading.Lock()
_draw = random.Random()  # seeded from the OS: parallel test processes draw apart


def listen_range(range_file: Path = EPHEMERAL_RANGE_FILE) -> range | None:
    """Ports below the ephemeral range (at least a thousand of them), or None where the range
    cannot be read (not Linux): then the kernel's own choice is taken."""
    try:
        low = int(range_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return range(LOWEST_PORT, low) if low - LOWEST_PORT >= 1000 else None


def _bindable(port: int, host: str) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _kernel_choice(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, outside the ephemeral range, never one this process
    handed out before."""
    pool = listen_range()
    with _lock:
        for _ in range(10_000):
            port = _draw.choice(pool) if pool is not None else _kernel_choice(host)
            if port in _handed_out or (pool is not None and not _bindable(port, host)):
                continue
            _handed_out.add(port)
            return port
    raise OSError(f"no free TCP port found on {host}")


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """count distinct free ports."""
    return [free_port(host) for _ in range(count)]
