"""Starting and stopping the services as child processes (demo, local stack, tests).

Each child gets its own process group, so stopping it also stops whatever it started, and
every child is stopped when the launcher exits, also on Ctrl-C.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lora_common.ports import free_port  # noqa: F401  (the launchers' and tests' import)




def describe_exit(code: int | None) -> str:
    """'code 1', or 'signal 9 (SIGKILL)' for a process a signal ended (Popen's negative codes)."""
    if code is None:
        return "no exit code (still running)"
    if code < 0:
        try:
            return f"signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


def tail(path: Path | None, lines: int = 20) -> str:
    """The last lines of a log file ('' when there is none)."""
    if path is None:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 64 * 1024))  # logs can be large: the end is enough
            return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def death_report(name: str, code: int | None, log_path: Path | None, lines: int = 20) -> str:
    """What a person needs when a child died: which one, how, and the end of its log."""
    report = f"{name} exited with {describe_exit(code)}"
    last = tail(log_path, lines)
    if log_path is not None:
        report += f"; last lines of {log_path}:\n" + ("\n".join(f"  | {line}" for line in last.splitlines())
                                                      or "  | (empty)")
    return report


class ChildDied(RuntimeError):
    """A child exited while it should be serving; str() is its death_report."""

    def __init__(self, name: str, code: int | None, log_path: Path | None) -> None:
        super().__init__(death_report(name, code, log_path))
        self.name, self.code, self.log_path = name, code, log_path


class Child:
    def __init__(self, name: str, argv: Sequence[str], log_path: Path | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log_path = log_path
        self.log_file = open(log_path, "ab") if log_path else None
        out = self.log_file if self.log_file else subprocess.DEVNULL
        self.proc = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, start_new_session=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def died(self) -> ChildDied:
        return ChildDied(self.name, self.proc.poll(), self.log_path)

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM to the whole group, then SIGKILL if it does not exit in time."""
        if self.alive():
            _signal_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                _signal_group(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        _signal_group(self.proc.pid, signal.SIGKILL)  # leftovers of the group, if any
        if self.log_file:
            self.log_file.close()
        return self.proc.returncode


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def wait_healthy(target: str, timeout: float, child: Child | None = None, service: str = "") -> None:
    """Polls grpc.health.v1 until SERVING; raises if the child dies or time runs out."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if child is not None and not child.alive():
                raise child.died()
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{target} not healthy after {timeout:.0f}s")
            time.sleep(0.25)


def console_script(name: str) -> list[str]:
    """argv for one of this distribution's console scripts, next to the running Python."""
    candidate = Path(sys.executable).parent / name
    return [str(candidate)] if candidate.exists() else [name]
