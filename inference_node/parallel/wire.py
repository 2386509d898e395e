"""The control line of a tensor-parallel node: what rank 0 tells ranks 1..N-1, and what they
answer. Each message is a typed msgspec Struct, one of a tagged union each way, encoded as
msgpack in the first ZeroMQ frame; a staged step's packed input buffers and an adapter's
tensors follow as raw frames (never pickle).

Rank 0 to the others, in order:
- Capture: build and capture the graphs of a GraphPlan, in rank 0's order (each graph's
  collectives meet the same graph's on the other ranks).
- DecodeGraphStep: a decode step rank 0's runner staged for a graph (runner/decode_graphs.py);
  its packed buffers follow as three frames. The rank copies them into its own graph's
  buffers and replays the same graph; the token ids reach it by a broadcast inside the graph.
- PiecewiseStep: the same for a step the piecewise graphs run (runner/piecewise_graphs.py).
- EagerStep: an eager step's host inputs without its token ids, which come as a broadcast from
  rank 0's device (runner/eager.py).
- WriteSlot / ClearSlot: rank 0's adapter manager wrote or freed a slot (SlotBuffers.on_write
  and on_free); a write's two tensors per (layer, module) follow as frames.
- ReportSlots: answer with the slot table. Stop.

The others to rank 0: Ready (the rank has built its shard), SlotTable.
"""
from __future__ import annotations

import dataclasses

import msgspec
import numpy as np
import torch

from ..adapters.slots import SlotRecord
from ..adapters.weights import AdapterWeights
from ..runner.batch import HostBatch
from ..runner.decode_graphs import StagedDecode
from ..runner.eager import EagerStep
from ..runner.graph_plan import GraphPlan
from ..runner.piecewise_graphs import StagedPieces, StepShape
from ..runner.runner import Staged

Segments = tuple[tuple[int, int, int, int], ...]  # the CPU reference LoRA kernels' host segments


class Capture(msgspec.Struct, frozen=True, tag="capture"):
    plan: GraphPlan


class DecodeGraphStep(msgspec.Struct, frozen=True, tag="decode_graph"):
    key: tuple[int, int, int]       # (padded size, LoRA segments, group variant)
    rows: int
    width: int
    segments: Segments


class PiecewiseStep(msgspec.Struct, frozen=True, tag="piecewise"):
    shape: StepShape
    width: int
    segments: Segments


class EagerInputs(msgspec.Struct, frozen=True, tag="eager"):
    host: HostBatch                 # without the token ids (rank 0's broadcast brings them)
    chunk_slots: list[tuple[int, int]]


class TensorPair(msgspec.Struct, frozen=True):
    """One (layer, module)'s A and B, as the two frames that follow a WriteSlot."""

    layer: int
    module: str
    dtype: str                      # torch dtype name without "torch."
    a_shape: tuple[int, ...]
    b_shape: tuple[int, ...]


class ExpertPair(msgspec.Struct, frozen=True):
    """One MoE layer's expert LoRA of one expert parameter (AdapterWeights.experts): its
    A [experts, r, in] and B [experts, out, r] are the two frames after the TensorPairs'."""

    layer: int
    parameter: str
    dtype: str
    a_shape: tuple[int, ...]
    b_shape: tuple[int, ...]
    scaling: float


class WriteSlot(msgspec.Struct, frozen=True, tag="write_slot"):
    slot: int
    name: str
    version: str
    rank: int
    scaling: float
    target_modules: tuple[str, ...]
    firsts: dict[str, int]          # each module's first arena row (SlotBuffers.place_at)
    tensors: tuple[TensorPair, ...]
    experts: tuple[ExpertPair, ...] = ()


class ClearSlot(msgspec.Struct, frozen=True, tag="clear_slot"):
    slot: int


class ReportSlots(msgspec.Struct, frozen=True, tag="report_slots"):
    pass


class Stop(msgspec.Struct, frozen=True, tag="stop"):
    pass


class Ready(msgspec.Struct, frozen=True, tag="ready"):
    rank: int


class SlotTable(msgspec.Struct, frozen=True, tag="slot_table"):
    rank: int
    table: list[SlotRecord]


Control = Capture | DecodeGraphStep | PiecewiseStep | EagerInputs | WriteSlot | ClearSlot | ReportSlots | Stop
Reply = Ready | SlotTable

encode = msgspec.msgpack.Encoder().encode
decode_control = msgspec.msgpack.Decoder(Control).decode
decode_reply = msgspec.msgpack.Decoder(Reply).decode


# -- staged steps ---------------------------------------------------------------------------------
def step_frames(step: Staged) -> list:
    """A step rank 0's runner staged, as the frames of its message."""
    if isinstance(step, EagerStep):
        host = dataclasses.replace(step.host, input_ids=[], pending_at=[], pending_rows=[])
        return [encode(EagerInputs(host, step.chunk_slots))]
    if isinstance(step, StagedDecode):
        header = DecodeGraphStep(step.key, step.rows, step.width, step.segments)
    else:
        header = PiecewiseStep(step.shape, step.width, step.segments)
    return [encode(header), memoryview(step.int64), memoryview(step.int32), memoryview(step.table)]


def staged(message: DecodeGraphStep | PiecewiseStep | EagerInputs, frames: list[bytes]) -> Staged:
    """The step a message and the frames after it carry, for a rank's runner to run."""
    if isinstance(message, EagerInputs):
        return EagerStep(message.host, message.chunk_slots)
    packed = (np.frombuffer(frames[0], dtype=np.int64), np.frombuffer(frames[1], dtype=np.int32),
              np.frombuffer(frames[2], dtype=np.int32))
    if isinstance(message, DecodeGraphStep):
        return StagedDecode(message.key, message.rows, message.width, *packed, message.segments)
    return StagedPieces(message.shape, message.width, *packed, message.segments)


# -- adapter slots --------------------------------------------------------------------------------
def write_frames(slot: int, weights: AdapterWeights, firsts: dict[str, int]) -> list:
    """A slot write as the frames of its message: the header, then each pair's A and B."""
    keys = sorted(weights.tensors)
    pairs = [(key, weights.tensors[key]) for key in keys]
    experts = [(key, weights.experts[key]) for key in sorted(weights.experts)]
    header = WriteSlot(slot, weights.name, weights.version, weights.rank, float(weights.scaling),
                       tuple(weights.target_modules), firsts,
                       tuple(TensorPair(layer, module, str(a.dtype).removeprefix("torch."), tuple(a.shape),
                                        tuple(b.shape)) for (layer, module), (a, b) in pairs),
                       tuple(ExpertPair(layer, parameter, str(a.dtype).removeprefix("torch."), tuple(a.shape),
                                        tuple(b.shape), float(scaling))
                             for (layer, parameter), (a, b, scaling) in experts))
    frames: list = [encode(header)]
    for _, (a, b, *_) in pairs + experts:
        frames += [_tensor_frame(a), _tensor_frame(b)]
    return frames


def written(message: WriteSlot, frames: list[bytes]) -> AdapterWeights:
    """The adapter a WriteSlot and the frames after it carry."""
    tensors = {(p.layer, p.module): (_frame_tensor(frames[2 * i], p.dtype, p.a_shape),
                                     _frame_tensor(frames[2 * i + 1], p.dtype, p.b_shape))
               for i, p in enumerate(message.tensors)}
    first = 2 * len(message.tensors)
    experts = {(p.layer, p.parameter): (_frame_tensor(frames[first + 2 * i], p.dtype, p.a_shape),
                                        _frame_tensor(frames[first + 2 * i + 1], p.dtype, p.b_shape), p.scaling)
               for i, p in enumerate(message.experts)}
    return AdapterWeights(message.name, message.version, message.rank, message.scaling,
                          message.target_modules, tensors, experts=experts)


def _tensor_frame(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().cpu().contiguous().view(torch.uint8).numpy())


def _frame_tensor(frame: bytes, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.frombuffer(bytearray(frame), dtype=torch.uint8).view(getattr(torch, dtype)).reshape(shape)
