"""Same-host KV pushes through shared memory: the sender copies each layer into a segment named in the push's
header and sends only where it lies; the receiver reads it from the segment. The gRPC stream still carries
the header, the layers' places and checksums, the commit and the ack, so everything else about a push is
unchanged, and a peer on another host (or one that cannot open the segment) gets the bytes inline.

It maps and copies memory; it does not decide which peers are on this host (`core/kvlinks.py` does, from
the hosts the peers advertise), nor what the receiver does with the bytes. A segment is named after the
process that made it (`kvc_<pid>_<n>`), so a leak is traceable to its maker.
"""

from __future__ import annotations

import collections
import itertools
import os
from multiprocessing import resource_tracker, shared_memory

from kvcentric.proto import kv_pb2
from kvcentric.runtime.kvwire import LayerData

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
MIN_SEGMENT_BYTES = 1 << 20
UNAVAILABLE = "shared memory unavailable"
"""How a receiver's refusal of a segment begins: the sender pushes to that peer inline from then on."""


_MADE_HERE: set[str] = set()
"""Segments this process created (a receiver in the same process must not untrack them)."""


class SharedMemoryUnavailable(OSError):
    """The receiver cannot open the segment a push names (another host, another /dev/shm)."""


_NUMBERS = itertools.count()


def segment_prefix(pid: int | None = None) -> str:
    """How the names of the segments process `pid` (default: this one) makes begin."""
    return f"kvc_{os.getpid() if pid is None else pid}_"


def _create(size: int) -> shared_memory.SharedMemory:
    """A new segment, its name given to this process's resource tracker before it exists: a process killed at
    any moment after (even while the segment is being made) leaves nothing in /dev/shm, since the tracker, a
    child process that outlives it, unlinks what it was told of (an unknown name costs it a warning)."""
    name = f"{segment_prefix()}{next(_NUMBERS)}"
    resource_tracker.register(f"/{name}", "shared_memory")
    try:
        return shared_memory.SharedMemory(name, create=True, size=size)
    except FileExistsError:  # left by a dead process of the same pid: a fresh random name
        resource_tracker.unregister(f"/{name}", "shared_memory")
        return shared_memory.SharedMemory(create=True, size=size)


def push_bytes(header: kv_pb2.KVHeader) -> int:
    """Key and value bytes of every layer of the tokens a push's header announces."""
    return header.num_layers * header.num_tokens * 2 * header.num_kv_heads * header.head_dim * \
        DTYPE_BYTES.get(header.dtype, 4)


class SegmentPool:
    """The sender's segments, reused push after push (a new segment costs page faults on first touch); at
    most `keep` idle ones are kept, the rest unlinked."""

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        self.idle: list[shared_memory.SharedMemory] = []

    def acquire(self, nbytes: int) -> shared_memory.SharedMemory:
        """An idle segment of at least `nbytes`, else a new one (sizes rounded up to a power of two)."""
        fitting = [segment for segment in self.idle if segment.size >= nbytes]
        if fitting:
            segment = min(fitting, key=lambda s: s.size)
            self.idle.remove(segment)
            return segment
        size = max(MIN_SEGMENT_BYTES, 1 << (max(nbytes, 1) - 1).bit_length())
        segment = _create(size)
        _MADE_HERE.add(segment.name)
        return segment

    def release(self, segment: shared_memory.SharedMemory) -> None:
        """The push that used `segment` was acknowledged: the receiver read it all."""
        self.idle.append(segment)
        while len(self.idle) > self.keep:
            _unlink(self.idle.pop(0))

    def close(self) -> None:
        for segment in self.idle:
            _unlink(segment)
        self.idle.clear()


class SegmentWriter:
    """One push's layers into its segment, one after another."""

    def __init__(self, segment: shared_memory.SharedMemory) -> None:
        self.segment, self.offset = segment, 0

    def put(self, layer: LayerData) -> LayerData:
        """The layer as sent: its bytes copied into the segment and the chunk naming where; as it was (bytes
        inline) when it does not fit."""
        size = len(layer.key)
        if len(layer.value) != size or self.offset + 2 * size > self.segment.size:
            return layer
        start, view = self.offset, _buffer(self.segment)
        view[start:start + size] = layer.key
        view[start + size:start + 2 * size] = layer.value
        self.offset += 2 * size
        return LayerData(layer.layer, layer.token_start, layer.token_end, b"", b"", layer.checksum, start, size)


class AttachedSegments:
    """The receiver's mappings of senders' segments, kept open (most recent `keep`) since senders reuse them."""

    def __init__(self, keep: int = 8) -> None:
        self.keep = keep
        self.open: collections.OrderedDict[str, shared_memory.SharedMemory] = collections.OrderedDict()

    def attach(self, name: str) -> shared_memory.SharedMemory:
        segment = self.open.get(name)
        if segment is not None:
            self.open.move_to_end(name)
            return segment
        try:
            segment = shared_memory.SharedMemory(name=name)
        except (OSError, ValueError) as exc:
            raise SharedMemoryUnavailable(f"{UNAVAILABLE}: cannot open segment {name}: {exc}") from exc
        if name not in _MADE_HERE:  # Python < 3.13 tracks an attached segment as if this process made it (and
            # would unlink it at exit): the sender owns it. (Two multiprocessing children of one parent share
            # a tracker: there this also drops the sender's entry, and a sender that crashes leaks its segment.)
            resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]
        self.open[name] = segment
        while len(self.open) > self.keep:
            _close(self.open.popitem(last=False)[1])
        return segment

    def resolve(self, name: str, layer: LayerData) -> LayerData:
        """The layer with its key and value as views of the segment (valid until the sender reuses it)."""
        segment = self.attach(name)
        start, size = layer.shm_offset, layer.shm_bytes
        if start + 2 * size > segment.size:
            raise ValueError(f"layer {layer.layer} lies beyond its shared memory segment")
        view = _buffer(segment)
        return LayerData(layer.layer, layer.token_start, layer.token_end, view[start:start + size],
                         view[start + size:start + 2 * size], layer.checksum)

    def close(self) -> None:
        for segment in self.open.values():
            _close(segment)
        self.open.clear()


def _buffer(segment: shared_memory.SharedMemory) -> memoryview:
    view = segment.buf
    if view is None:
        raise ValueError(f"shared memory segment {segment.name} is closed")
    return view


def _close(segment: shared_memory.SharedMemory) -> None:
    try:
        segment.close()
    except BufferError:  # a view of it is still alive somewhere: the mapping goes when that does
        pass


def _unlink(segment: shared_memory.SharedMemory) -> None:
    _MADE_HERE.discard(segment.name)
    _close(segment)
    try:
        segment.unlink()
    except FileNotFoundError:
        pass
