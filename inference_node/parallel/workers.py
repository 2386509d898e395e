"""The ranks of a tensor-parallel node other than rank 0, and rank 0's line to them.

Rank 0 is the engine core process: it alone runs the scheduler, the KV block allocator, the
prefix cache and the adapter manager. Ranks 1..N-1 are processes it spawns; each holds its
shard of the model, of the KV cache (its own KV heads, the same block ids) and of the adapter
slots, and does what rank 0 tells it, in order, over one ZeroMQ socket (the typed messages of
wire.py). Every step rank 0's model runner staged goes to them first (Workers.mirror), and
their runner runs it the same way (runner/rank.py), meeting rank 0 at the forward's
collectives; every adapter slot rank 0 writes or frees is written or freed alike, at the same
arena rows, so every rank's slot table stays rank 0's (check_slot_tables compares them).

The control line is ZeroMQ rather than a collective so an idle node waits without a
collective's timeout; a rank that dies ends the node (rank 0 watches every rank's process).
"""
from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import tempfile
import threading
from typing import Any, Callable

import torch
import zmq

from ..adapters.weights import AdapterWeights
from ..parent_watch import die_with_parent
from ..runner.graph_plan import GraphPlan
from ..runner.launches import StepLaunches
from ..runner.lora.plan import LoraStepPlan
from ..runner.rank import RankRunner
from ..runner.runner import Staged
from . import wire
from .group import leave_tensor_parallel
from .shard import Shard

log = logging.getLogger(__name__)


class Workers:
    """Rank 0's side: spawns ranks 1..size-1 and tells them what to do, in order."""

    def __init__(self, settings, size: int, build_rank: Callable[..., Any], log_level: str = "INFO",
                 on_death: Callable[[str], None] | None = None) -> None:
        """build_rank(settings, shard, rendezvous): a rank's model, KV cache and slots
        (node.build_rank; passed in, a module-level function the spawned ranks import)."""
        self.size = size
        self.dir = tempfile.mkdtemp(prefix="lora-tp-")
        self.rendezvous = os.path.join(self.dir, "rendezvous")
        self.context = zmq.Context.instance()
        self.replies = self.context.socket(zmq.PULL)
        self.replies.setsockopt(zmq.LINGER, 0)
        reply_address = f"ipc://{self.dir}/replies"
        self.replies.bind(reply_address)
        self.controls: list[zmq.Socket] = []
        spawn = multiprocessing.get_context("spawn")
        self.procs: list[multiprocessing.Process] = []
        for rank in range(1, size):
            sock = self.context.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            address = f"ipc://{self.dir}/control-{rank}"
            sock.bind(address)
            self.controls.append(sock)
            proc = spawn.Process(target=run_worker, name=f"tp-rank-{rank}",
                                 args=(build_rank, settings, rank, size, self.rendezvous, address, reply_address,
                                       log_level))
            proc.start()
            self.procs.append(proc)
        self.slots = None                 # rank 0's SlotBuffers, once attached
        self.table_checks = 0
        self._stopping = False
        self._reaping = threading.Lock()  # lost(): the watcher and the engine thread may ask at once
        self._on_death = on_death or _exit_node
        self._watch = threading.Thread(target=self._watch_ranks, name="tp-watch", daemon=True)
        self._watch.start()

    # -- start-up -----------------------------------------------------------------------------
    def wait_ready(self) -> None:
        """Blocks until every rank has built its shard (or raises if one died first)."""
        pending = set(range(1, self.size))
        while pending:
            if self.replies.poll(1000):
                reply = wire.decode_reply(self.replies.recv())
                if isinstance(reply, wire.Ready):
                    pending.discard(reply.rank)
            dead = [p.name for p in self.procs if not p.is_alive()]
            if dead and pending:
                raise RuntimeError(f"tensor-parallel rank(s) {', '.join(dead)} died while loading (see the log above)")

    def attach(self, slots) -> None:
        """Sends every write and clear of rank 0's adapter slots on to the other ranks."""
        self.slots = slots
        slots.on_write = self.write_slot
        slots.on_free = self.clear_slot

    # -- per step and per slot change (the engine thread) ------------------------------------------
    def mirror(self, step: Staged) -> None:
        """Sends a step rank 0's runner staged: the other ranks run it the same way."""
        self._send(wire.step_frames(step))

    def capture_graphs(self, plan: GraphPlan) -> None:
        self._send([wire.encode(wire.Capture(plan))])

    def write_slot(self, slot: int, weights: AdapterWeights, firsts: dict[str, int]) -> None:
        self._send(wire.write_frames(slot, weights, firsts))

    def clear_slot(self, slot: int) -> None:
        self._send([wire.encode(wire.ClearSlot(slot))])

    def _send(self, frames: list) -> None:
        for sock in self.controls:  # copied: staged buffers are reused while a message may still be queued
            sock.send_multipart(frames)

    # -- checks ----------------------------------------------------------------------------------
    def slot_tables(self) -> list[list]:
        """Every rank's slot table, rank 0's first."""
        self._send([wire.encode(wire.ReportSlots())])
        tables: dict[int, list] = {}
        while len(tables) < self.size - 1:
            if not self.replies.poll(30_000):
                raise RuntimeError("a tensor-parallel rank did not report its slot table")
            reply = wire.decode_reply(self.replies.recv())
            if isinstance(reply, wire.SlotTable):
                tables[reply.rank] = reply.table
        own = list(self.slots.table) if self.slots is not None else []
        return [own] + [tables[r] for r in range(1, self.size)]

    def check_slot_tables(self) -> None:
        """Raises AssertionError unless every rank's slots hold what rank 0's hold."""
        tables = self.slot_tables()
        for rank, table in enumerate(tables[1:], start=1):
            if table != tables[0]:
                diff = [(slot, tables[0][slot], theirs) for slot, theirs in enumerate(table)
                        if slot >= len(tables[0]) or theirs != tables[0][slot]]
                raise AssertionError(f"tensor-parallel rank {rank}'s adapter slots differ from rank 0's: "
                                     f"(slot, rank 0, rank {rank}) {diff}")
        self.table_checks += 1

    # -- the end -----------------------------------------------------------------------------------
    def stop(self, timeout: float = 10.0, leave: Callable[[], object] | None = None) -> None:
        """Tells every rank to stop; `leave` (rank 0's side of the group's teardown) runs
        before waiting for them, since each rank tears its group down on the way out."""
        self._stopping = True
        for sock in self.controls:
            try:
                sock.send(wire.encode(wire.Stop()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        if leave is not None:
            leave()
        for proc in self.procs:
            proc.join(timeout)
            if proc.is_alive():
                log.warning("%s did not exit within %.0fs of being told to stop: killed", proc.name, timeout)
                proc.kill()
                proc.join(5)
        for sock in [*self.controls, self.replies]:
            sock.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def lost(self, wait_s: float) -> str | None:
        """Which ranks died, in the one line the node logs ("tensor-parallel rank tp-rank-1
        (exit -9) died: ..."), waiting up to wait_s for one to; None while every rank lives.
        A rank's sentinel closes while it exits, a moment before it can be reaped: its exit
        code is waited for, by one thread at a time (two reaping one child race in waitpid,
        and the loser reads no exit code)."""
        ended = multiprocessing.connection.wait([p.sentinel for p in self.procs], timeout=wait_s)
        dead = [p for p in self.procs if p.sentinel in ended]
        with self._reaping:
            for proc in dead:
                proc.join(5.0)
        if not dead:
            return None
        names = ", ".join(f"{p.name} (exit {p.exitcode})" for p in dead)
        return f"tensor-parallel rank {names} died: the node cannot run a step without it"

    def _watch_ranks(self) -> None:
        multiprocessing.connection.wait([p.sentinel for p in self.procs])
        if not self._stopping:
            self._on_death(self.lost(0.0))


def _exit_node(message: str) -> None:
    log.error("%s; stopping the engine core", message)
    os._exit(1)


# -- ranks 1..N-1 ------------------------------------------------------------------------------------
def run_worker(build_rank: Callable[..., Any], settings, rank: int, size: int, rendezvous: str, control: str,
               reply: str, log_level: str = "INFO") -> None:
    """A tensor-parallel rank's process: builds its shard, then runs what rank 0 sends."""

    die_with_parent(signal.SIGKILL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(),
                        format=f"%(asctime)s %(levelname)s %(name)s[rank {rank}]: %(message)s")
    context = zmq.Context()
    inbox = context.socket(zmq.PULL)
    inbox.connect(control)
    out = context.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 1000)
    out.connect(reply)
    built = build_rank(settings, Shard(rank, size), rendezvous)
    worker = RankWorker(built.model, built.kv, built.slots, built.launches)
    out.send(wire.encode(wire.Ready(rank)))
    log.info("tensor-parallel rank %d of %d ready", rank, size)
    try:
        while True:
            frames = inbox.recv_multipart()
            message = wire.decode_control(frames[0])
            if isinstance(message, wire.Stop):
                worker.release_graphs()
                leave_tensor_parallel()
                return
            if isinstance(message, wire.ReportSlots):
                out.send(wire.encode(wire.SlotTable(rank, worker.table())))
                continue
            worker.handle(message, frames[1:])
    except Exception:
        log.exception("tensor-parallel rank %d failed", rank)
        os._exit(1)
    finally:
        inbox.close()
        out.close()


class RankWorker:
    """One rank's adapter slots and runner (its model shard and KV cache), driven by rank 0's
    messages."""

    def __init__(self, model, kv, slots, launches: StepLaunches) -> None:
        self.slots, self.device = slots, model.device
        lora = LoraStepPlan(slots, launches.base.tuning) if slots is not None else None
        self.runner = RankRunner(model, launches, kv, lora)

    def release_graphs(self) -> None:
        self.runner.release_graphs()

    def table(self) -> list:
        return list(self.slots.table) if self.slots is not None else []

    def handle(self, message: wire.Control, frames: list[bytes]) -> None:
        if isinstance(message, (wire.DecodeGraphStep, wire.PiecewiseStep, wire.EagerInputs)):
            self.runner.run(wire.staged(message, frames))
        elif isinstance(message, wire.Capture):
            self.runner.capture(message.plan)
        elif isinstance(message, wire.WriteSlot):
            weights = wire.written(message, frames)
            self.slots.place_at(message.slot, self.slots.ranks_of(weights), message.firsts)
            event = self.slots.write(message.slot, weights)
            if event is not None:  # the next step reads the slot: it waits for the copy on the device
                torch.cuda.current_stream(self.device).wait_event(event)
        elif isinstance(message, wire.ClearSlot):
            self.slots.free(message.slot)
        else:
            raise ValueError(f"unexpected control message {message!r}")
