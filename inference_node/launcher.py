"""Starts a node as processes and stops them together.

`inference-node serve` runs here: it starts the engine core process (the GPU loop), waits
for its welcome, then serves gRPC (and the OpenAI-compatible HTTP API, with --http-port)
from this process and from more front ends sharing the ports (--api-processes; auto sizes
them by the engine's device and the cores the node has: frontend_count). Nothing here imports
torch or the engine: the core process alone loads them, and the checkpoint (the embedded
model converted there on first use) reaches the front ends in its welcome. On SIGTERM
or Ctrl-C this process drains the node (the others stop taking work); if the engine core
dies, every front end answers its open streams with UNAVAILABLE, reports NOT_SERVING and the
node exits non-zero. A front end that dies drains the node, which then exits 1: its share of
the port closed unseen and its requests' answers have nowhere to go, so the node's
supervisor restarts it whole. Children never outlive it: the core and the front ends
watch their parent and exit when it is gone.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Callable

from .config import CONFIG_EXIT, NodeConfig
from .core.protocol import CoreInfo
from .frontend.engine_client import EngineClient
from .parent_watch import die_with_parent, parent_alive

log = logging.getLogger(__name__)
START_TIMEOUT_S = 3600.0  # loading, warming up and capturing a large model's graphs takes minutes
MAX_AUTO_FRONTENDS = 4


class NodeStartError(RuntimeError):
    """The engine core (or a front end) exited before it was ready."""

    def __init__(self, message: str, exitcode: int | None = None) -> None:
        super().__init__(message)
        self.exitcode = exitcode


def frontend_count(config: NodeConfig, info: CoreInfo) -> int:
    """--api-processes, or for auto: one beside a CPU engine, whose torch threads take every
    core but one (cpu_threads); beside a GPU engine, one per three cores its processes (one
    per tensor-parallel rank) leave, from 1 to 4. Measured on an H200 with the 1B shape at 64
    streams, one front end carried 0.81x of the in-process engine's tokens/s through gRPC, two
    0.94x; each front end wants a core of its own, as the engine's processes do."""
    if config.server.api_processes:
        return config.server.api_processes
    if info.device != "cuda":
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(MAX_AUTO_FRONTENDS, (cores - config.model.tensor_parallel_size) // 3))


def _run_core(config: NodeConfig, address: str) -> None:
    """The core process's target: torch and the engine are imported there, never here."""
    from .core.engine_core import run_engine_core_process

    run_engine_core_process(config, address)


class Processes:
    """The node's child processes, started with `spawn` (CUDA cannot follow a fork)."""

    def __init__(self) -> None:
        self.context = multiprocessing.get_context("spawn")
        self.ipc_dir = tempfile.mkdtemp(prefix="lora-node-")
        self.core_address = f"ipc://{self.ipc_dir}/core"
        self.core: multiprocessing.Process | None = None
        self.frontends: list[multiprocessing.Process] = []
        self.stopping = False
        self.frontend_failed = False  # one failed to start, or exited before it was asked to

    def output_address(self, index: int) -> str:
        return f"ipc://{self.ipc_dir}/frontend-{index}"

    def start_core(self, config: NodeConfig) -> None:
        self.core = self.context.Process(target=_run_core, name="engine-core", args=(config, self.core_address))
        self.core.start()

    def start_frontends(self, count: int, config: NodeConfig, port: int, http_port: int) -> None:
        """Starts front ends 1..count-1 on the ports the first one bound, and waits until each
        serves (or one dies)."""
        ready = [self.context.Event() for _ in range(1, count)]
        for index, event in enumerate(ready, start=1):
            proc = self.context.Process(target=run_frontend_process, name=f"frontend-{index}",
                                        args=(index, config, port, http_port, self.core_address,
                                              self.output_address(index), event))
            proc.start()
            self.frontends.append(proc)
        for proc, event in zip(self.frontends, ready):
            while not event.wait(0.2):
                if not proc.is_alive():
                    self.frontend_failed = True
                    raise NodeStartError(f"{proc.name} exited with code {proc.exitcode} while starting")

    def watch_frontends(self, on_exit: Callable[[], None]) -> None:
        """Logs a front end that exits before `stop_frontends` asked it to, and calls on_exit."""
        loop = asyncio.get_running_loop()

        def exited(proc: multiprocessing.Process) -> None:
            loop.remove_reader(proc.sentinel)
            if not self.stopping:
                proc.join(1.0)
                log.error("%s exited with code %s while serving: draining the node, which then exits 1",
                          proc.name, proc.exitcode)
                self.frontend_failed = True
                on_exit()

        for proc in self.frontends:
            loop.add_reader(proc.sentinel, exited, proc)

    def stop_frontends(self) -> None:
        self.stopping = True
        for proc in self.frontends:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGTERM)

    def join(self, timeout: float) -> None:
        """Waits for every child; kills what is still there after `timeout`."""
        for proc in [*self.frontends, *([self.core] if self.core is not None else [])]:
            proc.join(timeout)
            if proc.is_alive():
                log.error("%s did not stop in %.0fs: killing it", proc.name, timeout)
                proc.kill()
                proc.join(5.0)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


async def _connect(client: EngineClient, core: multiprocessing.Process) -> None:
    """Waits for the core's welcome; fails at once if the core dies while it loads."""
    loop = asyncio.get_running_loop()
    died = loop.create_future()
    loop.add_reader(core.sentinel, lambda: died.done() or died.set_result(None))
    connect = loop.create_task(client.connect(START_TIMEOUT_S))
    try:
        await asyncio.wait({connect, died}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        loop.remove_reader(core.sentinel)
    if not connect.done():
        connect.cancel()
        core.join(1.0)
        raise NodeStartError(f"the engine process exited with code {core.exitcode} while starting "
                             "(its error is logged above)", core.exitcode)
    connect.result()


def unserved_model(config: NodeConfig) -> str | None:
    """Why the checkpoint's config.json is of an architecture the node does not serve (one
    line naming what it serves), or None. Read here, before any process starts, by the model's
    config parser (model/config.py, model/families.py: plain Python, no torch; imported only
    when the node starts, never by a front end). A checkpoint that is not there or not readable
    is the engine core's to report."""
    if not config.model.checkpoint:
        return None  # the embedded model
    from .model.config import ModelConfig
    from .model.families import UnsupportedModel

    try:
        model = ModelConfig.from_checkpoint(Path(config.model.checkpoint))
    except UnsupportedModel as exc:
        return str(exc)
    except (OSError, KeyError, TypeError, ValueError):
        return None
    if config.model.quantize_fp8 and model.num_experts:
        return (f"{model.family}: --quantization {config.model.quantization} of a mixture-of-experts model is "
                f"not served (its experts would stay 16-bit); serve it without --quantization")
    return None


async def run_node(config: NodeConfig, on_ready: Callable = lambda server: None) -> int:
    """Runs the node until SIGTERM/SIGINT (0), until its engine core dies (1), or not at all
    when a setting cannot work (2) or its checkpoint is of an architecture it does not serve (1)."""
    server_options = config.server
    refusal = unserved_model(config)
    if refusal is not None:  # fails now, in one line, before any process starts
        log.error("%s", refusal)
        return 1
    procs = Processes()
    procs.start_core(config)
    client = EngineClient(procs.core_address, procs.output_address(0), "frontend-0")
    server = None
    try:
        try:
            await _connect(client, procs.core)
        except NodeStartError as exc:
            log.error("%s", exc)
            return CONFIG_EXIT if exc.exitcode == CONFIG_EXIT else 1
        count = frontend_count(config, client.info)
        log.info("%d front-end process%s (--api-processes %s)", count, "" if count == 1 else "es",
                 server_options.api_processes or "auto")
        metrics_dir = None
        if count > 1 and "prometheus_client" not in sys.modules:
            # prometheus_client picks its multiprocess mode when first imported, here and in the
            # front ends spawned later (they inherit the environment).
            metrics_dir = os.path.join(procs.ipc_dir, "metrics")
            os.makedirs(metrics_dir)
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
        from .server import NodeServer

        server = NodeServer(config, client, server_options.host, server_options.port, server_options.drain_seconds,
                            owns_core=True, reuse_port=count > 1, metrics_dir=metrics_dir,
                            http_port=server_options.http_port or None,
                            unhealthy_seconds=server_options.drain_min_seconds)
        await server.start(serving=count == 1)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, server.request_stop)
        if count > 1:
            try:
                await asyncio.get_running_loop().run_in_executor(
                    None, procs.start_frontends, count, config, server.port, server.http_port)
            except NodeStartError as exc:
                log.error("%s", exc)
                server.request_stop()
            else:
                procs.watch_frontends(server.request_stop)
            await server.set_serving()
        on_ready(server)
        await server.wait_for_stop()
        procs.stop_frontends()
        await server.stop()
        return 1 if server.core_failed or procs.frontend_failed else 0
    finally:
        if server is None:
            client.close()
        await asyncio.get_running_loop().run_in_executor(None, procs.join, server_options.drain_seconds + 10.0)
        log.info("inference node stopped")


def serve(config: NodeConfig) -> int:
    return asyncio.run(run_node(config))


def run_frontend_process(index: int, config: NodeConfig, port: int, http_port: int, core_address: str,
                         output_address: str, ready) -> None:
    """An extra front end: serves the same ports until SIGTERM from the launcher."""
    die_with_parent(signal.SIGTERM)  # a drain of its own: it refuses new work, ends its streams
    logging.basicConfig(level=config.server.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s frontend-{index} %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group: the launcher decides
    raise SystemExit(asyncio.run(_frontend(index, config, port, http_port, core_address, output_address, ready)))


async def _frontend(index: int, config: NodeConfig, port: int, http_port: int, core_address: str,
                    output_address: str, ready) -> int:
    from .server import NodeServer

    client = EngineClient(core_address, output_address, f"frontend-{index}")
    await client.connect(60.0)
    server = NodeServer(config, client, config.server.host, port, config.server.drain_seconds,
                        owns_core=False, reuse_port=True, http_port=http_port or None,
                        unhealthy_seconds=config.server.drain_min_seconds)
    await server.start()
    ready.set()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, server.request_stop)
    async def watch_parent() -> None:
        while parent_alive():
            await asyncio.sleep(0.5)
        log.error("the node's launcher is gone: stopping")
        server.request_stop()

    watcher = loop.create_task(watch_parent())
    await server.wait_for_stop()
    watcher.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await watcher
    await server.stop()
    return 1 if server.core_failed else 0
