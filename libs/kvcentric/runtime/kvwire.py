"""The protobuf wire form of `KVChunk` (kv.proto), written and read by hand for the bulk path.

A layer chunk's key and value are megabytes; building a protobuf message copies them in and serializing
copies them again. Here a layer is encoded with one join and decoded into memoryviews of the received
buffer (no copy). The bytes are exactly what protobuf produces, so a peer that uses the generated
classes (grpcio or grpclib) reads and writes the same stream. Headers and commits go through protobuf.
"""

from __future__ import annotations

import dataclasses
from typing import TypeAlias

from kvcentric.proto import kv_pb2

HEADER, LAYER, COMMIT = 1, 2, 3  # KVChunk's oneof field numbers


@dataclasses.dataclass(frozen=True, slots=True)
class LayerData:
    """One LayerChunk: KV of tokens token_start..token_end-1 of one layer. In a same-host push the bytes are
    in the push's shared-memory segment instead (`shm_bytes` of key at `shm_offset`, the value after it)."""

    layer: int
    token_start: int
    token_end: int
    key: bytes | memoryview
    value: bytes | memoryview
    checksum: int
    shm_offset: int = 0
    shm_bytes: int = 0

    @property
    def nbytes(self) -> int:
        return len(self.key) + len(self.value) + 2 * self.shm_bytes


Item: TypeAlias = "kv_pb2.KVHeader | LayerData | kv_pb2.KVCommit"


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(data: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _field(number: int, payload: bytes | memoryview) -> list:
    return [_varint(number << 3 | 2), _varint(len(payload)), payload]


def _int_field(number: int, value: int) -> bytes:
    return _varint(number << 3) + _varint(value) if value else b""


def encode(item: Item | kv_pb2.KVChunk) -> bytes:
    """The serialized KVChunk holding `item` (protobuf-identical for layers; protobuf itself otherwise)."""
    if isinstance(item, kv_pb2.KVChunk):
        return item.SerializeToString()
    if isinstance(item, LayerData):
        body = [_int_field(1, item.layer), _int_field(2, item.token_start), _int_field(3, item.token_end),
                *(_field(4, item.key) if len(item.key) else []), *(_field(5, item.value) if len(item.value) else []),
                _int_field(6, item.checksum), _int_field(7, item.shm_offset), _int_field(8, item.shm_bytes)]
        inner_len = sum(len(part) for part in body)
        return b"".join([_varint(LAYER << 3 | 2), _varint(inner_len), *body])
    number = HEADER if isinstance(item, kv_pb2.KVHeader) else COMMIT
    return b"".join(_field(number, item.SerializeToString()))


def decode(data: bytes | bytearray) -> Item:
    """Parse a serialized KVChunk; a layer's key and value are views into `data`. Raises ValueError."""
    view = memoryview(data)
    try:
        tag, pos = _read_varint(view, 0)
        length, pos = _read_varint(view, pos)
    except IndexError:
        raise ValueError("truncated KVChunk") from None
    if tag & 7 != 2 or pos + length != len(view):
        raise ValueError("malformed KVChunk")
    number, payload = tag >> 3, view[pos:]
    if number == LAYER:
        return _decode_layer(payload)
    if number == HEADER:
        return kv_pb2.KVHeader.FromString(payload.tobytes())
    if number == COMMIT:
        return kv_pb2.KVCommit.FromString(payload.tobytes())
    raise ValueError(f"unknown KVChunk field {number}")


def _decode_layer(view: memoryview) -> LayerData:
    numbers: dict[int, int] = {}
    payloads: dict[int, memoryview] = {}
    pos = 0
    try:
        while pos < len(view):
            tag, pos = _read_varint(view, pos)
            if tag & 7 == 0:
                numbers[tag >> 3], pos = _read_varint(view, pos)
            elif tag & 7 == 2:
                length, pos = _read_varint(view, pos)
                payloads[tag >> 3], pos = view[pos:pos + length], pos + length
            else:
                raise ValueError(f"unexpected wire type {tag & 7} in LayerChunk")
    except IndexError:
        raise ValueError("truncated LayerChunk") from None
    empty = memoryview(b"")
    return LayerData(numbers.get(1, 0), numbers.get(2, 0), numbers.get(3, 0), payloads.get(4, empty),
                     payloads.get(5, empty), numbers.get(6, 0), numbers.get(7, 0), numbers.get(8, 0))


def normalize(item: Item | kv_pb2.KVChunk) -> Item:
    """Generated-class chunks (as tests and other clients build them) to the items used here."""
    if not isinstance(item, kv_pb2.KVChunk):
        return item
    kind = item.WhichOneof("kind")
    if kind == "layer":
        layer = item.layer
        return LayerData(layer.layer, layer.token_start, layer.token_end, layer.key, layer.value, layer.checksum,
                         layer.shm_offset, layer.shm_bytes)
    return item.header if kind == "header" else item.commit
