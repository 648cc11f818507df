"""KV pushes through Mooncake's Transfer Engine (the optional `mooncake-transfer-engine` packages; RDMA where
the host has it, its TCP transport otherwise): the sender copies each layer into a memory region it registered
once with its engine and announces where it lies on the push's gRPC stream; the receiver reads it from there
into a region of its own (registered once too) and hands it to its sink. Checksums, refusals, the commit and
the ack stay on the gRPC stream as for any push.

It registers, places and reads bytes; it does not choose which peers it is used for (`core/kvlinks.py`), and a
push that finds no room in the sender's region goes inline over gRPC.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable

import numpy as np

from kvcentric.proto import kv_pb2
from kvcentric.runtime.kvwire import Item, LayerData
from kvcentric.runtime.shm import push_bytes

log = logging.getLogger("kvcentric.mooncake")
PROTOCOLS = ("tcp", "rdma")


class MooncakeUnavailable(RuntimeError):
    """The Transfer Engine cannot be imported or started here; the message says why."""


def available() -> str:
    """Why Mooncake's Transfer Engine cannot be used here ("" when it can be imported)."""
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except ImportError as exc:  # also a missing system library (libibverbs, libcudart) of the wheel
        return f"mooncake.engine does not import: {exc}"
    return ""


def transfer_engine(host: str, protocol: str = "tcp", device: str = ""):
    """A started TransferEngine on `host` (the address peers reach), peers found by handshake (no metadata
    server); returns (engine, its segment name "host:port")."""
    why = available()
    if why:
        raise MooncakeUnavailable(why)
    from mooncake.engine import TransferEngine
    engine = TransferEngine()
    if engine.initialize(host, "P2PHANDSHAKE", protocol, device) != 0:
        raise MooncakeUnavailable(f"Mooncake's Transfer Engine did not start on {host} over {protocol}")
    return engine, f"{host}:{engine.get_rpc_port()}"


class Region:
    """First-fit places in a registered buffer of `size` bytes: `take` a range, `give` it back."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.free: list[tuple[int, int]] = [(0, size)]
        self.lock = threading.Lock()

    def take(self, nbytes: int) -> int | None:
        """The offset of `nbytes` free bytes, or None when no free range is that long."""
        with self.lock:
            for index, (start, length) in enumerate(self.free):
                if length >= nbytes:
                    self.free[index] = (start + nbytes, length - nbytes)
                    if length == nbytes:
                        del self.free[index]
                    return start
        return None

    def give(self, start: int, nbytes: int) -> None:
        with self.lock:
            self.free.append((start, nbytes))
            self.free.sort()
            merged: list[tuple[int, int]] = []
            for begin, length in self.free:
                if merged and merged[-1][0] + merged[-1][1] == begin:
                    merged[-1] = (merged[-1][0], merged[-1][1] + length)
                else:
                    merged.append((begin, length))
            self.free = merged


class Registered:
    """A buffer registered once with the engine, and its places."""

    def __init__(self, engine, size_bytes: int) -> None:
        self.engine = engine
        self.buffer = np.zeros(size_bytes, dtype=np.uint8)  # its pages arrive as transfers first touch them
        self.base = self.buffer.ctypes.data
        if engine.register_memory(self.base, size_bytes) != 0:
            raise MooncakeUnavailable(f"registering {size_bytes} bytes with the Transfer Engine failed")
        self.region = Region(size_bytes)

    def close(self) -> None:
        self.engine.unregister_memory(self.base)


class MooncakeSender(Registered):
    """The pushing side: each push's layers copied into a place of the registered buffer, given back once the
    receiver acknowledged the push (it has read every layer by then)."""

    def __init__(self, engine, segment: str, size_bytes: int) -> None:
        super().__init__(engine, size_bytes)
        self.segment = segment

    async def push(self, chunks: AsyncIterator[Item], send: Callable[[AsyncIterator[Item]], Awaitable[int]],
                   stats) -> int:
        """`send` the push with its layers' bytes left in the registered buffer; returns what `send` returns."""
        places: list[tuple[int, int]] = []

        async def placed() -> AsyncIterator[Item]:
            offset = end = 0
            async for item in chunks:
                if isinstance(item, kv_pb2.KVHeader):
                    size = push_bytes(item)
                    start = self.region.take(size)
                    if start is None:
                        stats["mooncake_no_room"] += 1
                        yield item  # inline
                        continue
                    places.append((start, size))
                    offset, end = start, start + size
                    header = kv_pb2.KVHeader()
                    header.CopyFrom(item)
                    header.mooncake_segment, header.mooncake_base = self.segment, self.base
                    yield header
                elif isinstance(item, LayerData) and offset + item.nbytes <= end and len(item.key) == len(item.value):
                    yield self._put(item, offset)
                    offset += item.nbytes
                    stats["mooncake_bytes_sent"] += item.nbytes
                else:
                    yield item
        try:
            return await send(placed())
        finally:
            for start, size in places:
                self.region.give(start, size)

    def _put(self, layer: LayerData, offset: int) -> LayerData:
        size = len(layer.key)
        self.buffer[offset:offset + size] = np.frombuffer(layer.key, dtype=np.uint8)
        self.buffer[offset + size:offset + 2 * size] = np.frombuffer(layer.value, dtype=np.uint8)
        return LayerData(layer.layer, layer.token_start, layer.token_end, b"", b"", layer.checksum, offset, size)


class MooncakeReceiver(Registered):
    """The receiving side: each announced layer read from the sender's buffer into a place of this one, copied
    out to bytes of its own, the place given back."""

    def __init__(self, engine, segment: str, size_bytes: int) -> None:
        super().__init__(engine, size_bytes)
        self.segment = segment
        self.room = asyncio.Condition()

    async def read(self, segment: str, base: int, layer: LayerData) -> LayerData:
        size = 2 * layer.shm_bytes
        if size > self.region.size:
            raise ValueError(f"layer {layer.layer} ({size} bytes) exceeds the Mooncake landing buffer")
        async with self.room:
            while (start := self.region.take(size)) is None:
                await self.room.wait()
        try:
            rc = await asyncio.get_running_loop().run_in_executor(
                None, self.engine.transfer_sync_read, segment, self.base + start, base + layer.shm_offset, size)
            if rc < 0:
                raise ValueError(f"reading layer {layer.layer} from {segment} over the Transfer Engine failed ({rc})")
            data = memoryview(self.buffer[start:start + size].tobytes())
        finally:
            self.region.give(start, size)
            async with self.room:
                self.room.notify_all()
        half = layer.shm_bytes
        return LayerData(layer.layer, layer.token_start, layer.token_end, data[:half], data[half:], layer.checksum)


def open_mooncake(host: str, size_bytes: int, protocol: str = "tcp",
                  device: str = "") -> tuple[MooncakeSender, MooncakeReceiver] | None:
    """One engine's Transfer Engine and its two registered buffers (`size_bytes` each); None, logged, where the
    package is absent or the engine does not start."""
    try:
        engine, segment = transfer_engine(host, protocol, device)
        return MooncakeSender(engine, segment, size_bytes), MooncakeReceiver(engine, segment, size_bytes)
    except MooncakeUnavailable as exc:
        log.info("no Mooncake transport: %s", exc)
        return None
