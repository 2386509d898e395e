"""AdapterShard on the wire with its multi-megabyte `data` field handled outside protobuf.

Protobuf (upb) copies a bytes field when it parses a message and again on every read of
the field from Python, and allocates and copies it several times when one is set and
serialized. A shard is mostly data, so both ends move the data field themselves: the
store appends it to the encoded header, the node reads it as a view of the received
message; protobuf parses only the small header fields.
"""
from __future__ import annotations

from lora.v1 import adapter_store_pb2 as pb

_DATA_FIELD = pb.AdapterShard.DATA_FIELD_NUMBER
_DATA_KEY = bytes([_DATA_FIELD << 3 | 2])  # length-delimited
_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5


def encode_shard(header: pb.AdapterShard, data: bytes) -> bytes:
    """An AdapterShard on the wire: `header` (every field but data) encoded by protobuf, then
    the data field appended (protobuf reads fields in any order): one copy of the data."""
    n, length = len(data), bytearray()
    while n > 0x7F:
        length.append(n & 0x7F | 0x80)
        n >>= 7
    length.append(n)
    return b"".join((header.SerializeToString(), _DATA_KEY, length, data))


def _varint(raw: bytes, at: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = raw[at]  # IndexError past the end: a truncated message
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 10 bytes")


def _data_span(raw: bytes) -> tuple[int, int, int] | None:
    """(field start, data start, data end) of the last data field (protobuf's rule for a
    repeated singular field), or None when there is none or the message is not one this
    top-level walk understands (protobuf then parses it whole, and reports what is wrong)."""
    span, at, size = None, 0, len(raw)
    try:
        while at < size:
            start = at
            key, at = _varint(raw, at)
            wire = key & 7
            if wire == _VARINT:
                _, at = _varint(raw, at)
            elif wire == _FIXED64:
                at += 8
            elif wire == _FIXED32:
                at += 4
            elif wire == _LENGTH:
                n, at = _varint(raw, at)
                if key >> 3 == _DATA_FIELD:
                    span = (start, at, at + n)
                at += n
            else:  # groups: never in this message
                return None
    except (IndexError, ValueError):
        return None
    return span if at == size else None


def decode_shard(raw: bytes) -> tuple[pb.AdapterShard, memoryview]:
    """The shard's header fields (data left empty) and its data as a view of `raw`."""
    span = _data_span(raw)
    if span is None:
        shard = pb.AdapterShard.FromString(raw)
        data = memoryview(shard.data)
        shard.ClearField("data")
        return shard, data
    start, begin, end = span
    header = raw[:start] if end == len(raw) else raw[:start] + raw[end:]
    shard = pb.AdapterShard.FromString(header)
    if shard.data:  # an earlier data field: the last one wins, as in protobuf
        shard.ClearField("data")
    return shard, memoryview(raw)[begin:end]
