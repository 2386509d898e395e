"""free_port hands each port out once: the kernel may return the same free port to two
binds in a row, and two children told to listen on it would clash."""
from __future__ import annotations

import socket

from lora_client import processes


class _FakeSocket:
    """Binds to the next port of a scripted sequence, as the kernel might choose them."""

    ports: list[int] = []

    def __enter__(self) -> "_FakeSocket":
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def bind(self, address: tuple[str, int]) -> None:
        self.port = _FakeSocket.ports.pop(0)

    def getsockname(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)


def test_a_port_the_kernel_returns_twice_is_handed_out_once(monkeypatch) -> None:
    _FakeSocket.ports = [50001, 50001, 50001, 50002]
    monkeypatch.setattr(processes.socket, "socket", _FakeSocket)
    monkeypatch.setattr(processes, "_handed_out", set())
    assert processes.free_port() == 50001
    assert processes.free_port() == 50002
    assert _FakeSocket.ports == []


def test_free_ports_are_distinct_and_bindable() -> None:
    ports = [processes.free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))
