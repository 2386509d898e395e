"""free_port hands out ports below the kernel's ephemeral range, each once: a port bind(0)
returns can be given to any outgoing connection before the child listens on it (a local
stack's store once failed so under the parallel suite), and two children told to listen on
the same port would clash."""
from __future__ import annotations

import socket
from pathlib import Path

import pytest

from lora_client.processes import free_port as launchers_free_port
from lora_common import ports


def test_ports_come_from_below_the_ephemeral_range_and_are_distinct_and_bindable() -> None:
    pool = ports.listen_range()
    if pool is None:
        pytest.skip("no /proc/sys/net/ipv4/ip_local_port_range here")
    low = int(ports.EPHEMERAL_RANGE_FILE.read_text().split()[0])
    handed = [ports.free_port() for _ in range(200)] + [launchers_free_port()]
    assert len(set(handed)) == len(handed)
    assert all(ports.LOWEST_PORT <= p < low for p in handed), handed
    with socket.socket() as s:
        s.bind(("127.0.0.1", handed[-1]))


class _ScriptedDraws:
    """Draws the next port of a scripted sequence."""

    def __init__(self, ports_drawn: list[int]) -> None:
        self.ports = iter(ports_drawn)

    def choice(self, pool: range) -> int:
        return next(self.ports)


def test_a_port_drawn_twice_or_taken_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "_draw", _ScriptedDraws([20001, 20001, 20002, 20003]))
    monkeypatch.setattr(ports, "_handed_out", set())
    monkeypatch.setattr(ports, "listen_range", lambda: range(20000, 30000))
    monkeypatch.setattr(ports, "_bindable", lambda port, host: port != 20002)  # 20002: listened on
    assert ports.free_port() == 20001
    assert ports.free_port() == 20003


def test_without_a_known_range_the_kernels_choice_is_handed_out_once(monkeypatch: pytest.MonkeyPatch) -> None:
    chosen = iter([50001, 50001, 50001, 50002])  # the kernel may return a free port twice in a row
    monkeypatch.setattr(ports, "_handed_out", set())
    monkeypatch.setattr(ports, "listen_range", lambda: None)
    monkeypatch.setattr(ports, "_kernel_choice", lambda host: next(chosen))
    assert ports.free_port() == 50001
    assert ports.free_port() == 50002


@pytest.mark.parametrize("text,expected", [
    ("32768\t60999\n", range(10000, 32768)),
    ("10500 60999", None),   # fewer than a thousand ports below it: the kernel's choice
    ("", None),
])
def test_the_listen_range_follows_the_ephemeral_range(tmp_path: Path, text: str, expected) -> None:
    f = tmp_path / "ip_local_port_range"
    f.write_text(text)
    assert ports.listen_range(f) == expected
    assert ports.listen_range(tmp_path / "absent") is None
