"""The ranks of a tensor-parallel node other than rank 0, and rank 0's line to them.

Rank 0 is the engine core process: it alone runs the scheduler, the KV block allocator, the
prefix cache and the adapter manager. Ranks 1..N-1 are processes it spawns; each holds its
shard of the model, of the KV cache (its own KV heads, the same block ids) and of the adapter
slots, and does what rank 0 tells it, in order, over one ZeroMQ socket (msgpack, adapter
tensors as raw frames, never pickle):

- CAPTURE: build and capture the decode graphs and the piecewise graphs rank 0 captures, in
  the same order (each graph's collectives meet the same graph's on the other ranks).
- GRAPH: a decode step rank 0 staged for its graph (DecodeGraphs.mirror): its packed input
  buffers as raw frames; the rank copies them into its own graph's buffers and replays the
  same graph. The token ids go from rank 0 to the others by a broadcast inside the graph.
- PIECES: the same for a step with prompt tokens (PiecewiseGraphs.mirror): the rank runs the
  same pieces with attention between them.
- STEP: an eager step's host inputs (positions, slot mapping, block tables, ...) and each chunk's
  adapter slot. The token ids follow as a broadcast from rank 0's device (a decode row's
  token is the previous step's sample, which only rank 0's device holds), then every rank
  runs the same forward, meeting at the same collectives. Rank 0 samples; the others drop
  the logits.
- WRITE / CLEAR: rank 0's adapter manager wrote or freed a slot (SlotBuffers.on_write and
  on_free); the rank places the same adapter at the same arena rows (a write carries the
  first row of each module's run) and writes its shard of it there, or frees the slot's
  rows, so every rank's slot table stays rank 0's.
- REPORT: the rank answers its slot table (rank 0 compares them: check_slot_tables).
- STOP.

The control line is ZeroMQ rather than a collective so an idle node waits without a
collective's timeout; a rank that dies ends the node (rank 0 watches every rank's process).
"""
from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import tempfile
import threading
from typing import Any, Callable

import msgpack
import numpy as np
import torch
import zmq

from ..adapters.weights import AdapterWeights
from ..runner.batch import HostBatch
from ..runner.decode_graphs import StagedStep
from ..runner.eager import EagerStep
from ..runner.graph_plan import GraphPlan
from ..runner.launches import StepLaunches
from ..runner.lora.plan import LoraStepPlan
from ..runner.piecewise_graphs import StagedPieces, StepShape
from ..runner.rank import RankRunner
from ..runner.runner import Staged
from ..parent_watch import die_with_parent
from .group import leave_tensor_parallel
from .shard import Shard

log = logging.getLogger(__name__)

STEP, WRITE, CLEAR, REPORT, STOP, READY, TABLE = "step", "write", "clear", "report", "stop", "ready", "table"
CAPTURE, GRAPH, PIECES = "capture", "graph", "pieces"


def _pack(message: list) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def _normalised(table: list) -> list:
    """A slot table as it reads after the wire (tuples become lists)."""
    return _unpack(_pack(table))


def _tensor_frame(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().cpu().contiguous().view(torch.uint8).numpy())


def _frame_tensor(frame: bytes, dtype: str, shape: list[int]) -> torch.Tensor:
    return torch.frombuffer(bytearray(frame), dtype=torch.uint8).view(getattr(torch, dtype)).reshape(shape)


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
        self._on_death = on_death or _exit_node
        self._watch = threading.Thread(target=self._watch_ranks, name="tp-watch", daemon=True)
        self._watch.start()

    # -- start-up -----------------------------------------------------------------------------
    def wait_ready(self) -> None:
        """Blocks until every rank has built its shard (or raises if one died first)."""
        pending = set(range(1, self.size))
        while pending:
            if self.replies.poll(1000):
                kind, rank, *_ = _unpack(self.replies.recv())
                if kind == READY:
                    pending.discard(rank)
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
        if isinstance(step, EagerStep):
            host = step.host
            frames = [_pack([STEP, host.positions, host.slot_mapping, host.block_tables, host.query_start_loc,
                             host.seq_lens, host.logits_indices, host.max_query_len, step.chunk_slots])]
        elif isinstance(step, StagedStep):
            header = _pack([GRAPH, list(step.key), step.rows, step.width, [list(seg) for seg in step.segments]])
            frames = [header, memoryview(step.int64), memoryview(step.int32), memoryview(step.table)]
        else:
            shape = dataclasses.astuple(step.shape)
            header = _pack([PIECES, list(shape), step.width, [list(seg) for seg in step.segments]])
            frames = [header, memoryview(step.int64), memoryview(step.int32), memoryview(step.table)]
        for sock in self.controls:  # copied: the buffers are reused while a message may still be queued
            sock.send_multipart(frames)

    def capture_graphs(self, plan: GraphPlan) -> None:
        for sock in self.controls:
            sock.send(_pack([CAPTURE, dataclasses.asdict(plan)]))

    def write_slot(self, slot: int, weights: AdapterWeights, firsts: dict[str, int]) -> None:
        keys = sorted(weights.tensors)
        header = [WRITE, slot, weights.name, weights.version, weights.rank, float(weights.scaling),
                  list(weights.target_modules), firsts,
                  [[layer, module, str(a.dtype).removeprefix("torch."), list(a.shape), list(b.shape)]
                   for (layer, module), (a, b) in ((k, weights.tensors[k]) for k in keys)]]
        frames: list = [_pack(header)]
        for key in keys:
            a, b = weights.tensors[key]
            frames += [_tensor_frame(a), _tensor_frame(b)]
        for sock in self.controls:
            sock.send_multipart(frames)

    def clear_slot(self, slot: int) -> None:
        for sock in self.controls:
            sock.send(_pack([CLEAR, slot]))

    # -- checks ----------------------------------------------------------------------------------
    def slot_tables(self) -> list[list]:
        """Every rank's slot table, rank 0's first (as they read after the wire)."""
        for sock in self.controls:
            sock.send(_pack([REPORT]))
        tables: dict[int, list] = {}
        while len(tables) < self.size - 1:
            if not self.replies.poll(30_000):
                raise RuntimeError("a tensor-parallel rank did not report its slot table")
            kind, rank, table = _unpack(self.replies.recv())
            if kind == TABLE:
                tables[rank] = table
        own = _normalised(list(self.slots.table)) if self.slots is not None else []
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
                sock.send(_pack([STOP]), zmq.NOBLOCK)
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

    def _watch_ranks(self) -> None:
        multiprocessing.connection.wait([p.sentinel for p in self.procs])
        if not self._stopping:
            dead = ", ".join(f"{p.name} (exit {p.exitcode})" for p in self.procs if not p.is_alive())
            self._on_death(f"tensor-parallel rank {dead} died: the node cannot run a step without it")


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
    out.send(_pack([READY, rank]))
    log.info("tensor-parallel rank %d of %d ready", rank, size)
    try:
        while True:
            frames = inbox.recv_multipart()
            message = _unpack(frames[0])
            if message[0] == STOP:
                worker.release_graphs()
                leave_tensor_parallel()
                return
            if message[0] == REPORT:
                out.send(_pack([TABLE, rank, worker.table()]))
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
        return _normalised(list(self.slots.table)) if self.slots is not None else []

    def handle(self, message: list, frames: list[bytes]) -> None:
        kind = message[0]
        if kind == STEP:
            positions, slot_mapping, block_tables, query_start_loc, seq_lens, logits_indices, max_query_len, \
                chunk_slots = message[1:]
            self.runner.run(EagerStep(HostBatch([], [], [], positions, slot_mapping, block_tables, query_start_loc,
                                                seq_lens, logits_indices, max_query_len), chunk_slots))
        elif kind == GRAPH:
            _, key, rows, width, segments = message
            self.runner.run(StagedStep(
                tuple(key), rows, width, np.frombuffer(frames[0], dtype=np.int64),
                np.frombuffer(frames[1], dtype=np.int32), np.frombuffer(frames[2], dtype=np.int32),
                tuple(tuple(seg) for seg in segments)))
        elif kind == PIECES:
            _, shape, width, segments = message
            self.runner.run(StagedPieces(
                StepShape(*shape), width, np.frombuffer(frames[0], dtype=np.int64),
                np.frombuffer(frames[1], dtype=np.int32), np.frombuffer(frames[2], dtype=np.int32),
                tuple(tuple(seg) for seg in segments)))
        elif kind == CAPTURE:
            self.runner.capture(GraphPlan(**message[1]))
        elif kind == WRITE:
            self.write(message, frames)
        elif kind == CLEAR:
            self.slots.free(message[1])
        else:
            raise ValueError(f"unknown control message {kind!r}")

    def write(self, header: list, frames: list[bytes]) -> None:
        _, slot, name, version, rank, scaling, modules, firsts, shapes = header
        tensors = {}
        for i, (layer, module, dtype, a_shape, b_shape) in enumerate(shapes):
            tensors[(layer, module)] = (_frame_tensor(frames[2 * i], dtype, a_shape),
                                        _frame_tensor(frames[2 * i + 1], dtype, b_shape))
        weights = AdapterWeights(name, version, rank, scaling, tuple(modules), tensors)
        self.slots.place_at(slot, self.slots.ranks_of(weights), firsts)
        event = self.slots.write(slot, weights)
        if event is not None:  # the next step reads the slot: it waits for the copy on the device
            torch.cuda.current_stream(self.device).wait_event(event)
