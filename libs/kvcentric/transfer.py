"""KV bytes between nodes over gRPC (grpcio, C core): the servicer that receives into a sink, and the
client that pushes a request's layers as they are produced.

The contract is `kvcentric/proto/kv.proto`; what a receiver does with the bytes (write into a decode
engine's paged cache, keep in a host pool) is the sink's business, not this module's.
"""

from __future__ import annotations

import asyncio
import collections
import zlib
from typing import AsyncIterator, Protocol

import grpc

from kvcentric.proto import kv_pb2, kv_pb2_grpc

MAX_MESSAGE_BYTES = 1 << 30
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


class TransferError(RuntimeError):
    """A push that did not complete; the message says why."""


class KVSink(Protocol):
    """Where a receiving messenger puts a pushed request's KV. Raise to refuse; abort frees."""

    def begin(self, header: kv_pb2.KVHeader) -> None: ...
    def write(self, request_id: str, chunk: kv_pb2.LayerChunk) -> None: ...
    def commit(self, request_id: str, commit: kv_pb2.KVCommit) -> None: ...
    def abort(self, request_id: str, reason: str) -> None: ...


def checksum(key: bytes, value: bytes) -> int:
    return zlib.crc32(value, zlib.crc32(key))


class KVTransferServicer(kv_pb2_grpc.KVTransferServicer):
    def __init__(self, sink: KVSink) -> None:
        self.sink = sink
        self.stats: collections.Counter[str] = collections.Counter()

    async def PushKV(self, request_iterator, context) -> kv_pb2.PushAck:
        request_id, received, committed = "", 0, False
        try:
            async for chunk in request_iterator:
                kind = chunk.WhichOneof("kind")
                if kind == "header":
                    if request_id:
                        raise ValueError("second header in one stream")
                    request_id = chunk.header.request_id  # from here on a failure aborts it
                    self.sink.begin(chunk.header)
                elif not request_id:
                    raise ValueError(f"{kind} before the header")
                elif kind == "layer":
                    layer = chunk.layer
                    if checksum(layer.key, layer.value) != layer.checksum:
                        self.stats["checksum_failures"] += 1
                        raise ValueError(f"checksum mismatch in layer {layer.layer}")
                    self.sink.write(request_id, layer)
                    received += len(layer.key) + len(layer.value)
                elif kind == "commit":
                    self.sink.commit(request_id, chunk.commit)
                    committed = True
                    break
                else:
                    raise ValueError("empty chunk")
            if not committed:
                raise ValueError("stream ended before its commit")
            self.stats["bytes_received"] += received
            self.stats["streams_received"] += 1
            return kv_pb2.PushAck(ok=True, bytes_received=received)
        except Exception as exc:  # noqa: BLE001 - every refusal goes back to the sender as an ack
            return kv_pb2.PushAck(ok=False, error=str(exc), bytes_received=received)
        finally:
            if request_id and not committed:
                self.sink.abort(request_id, "push did not complete")

    async def PullKV(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this messenger does not serve pulls")

    async def Stats(self, request, context) -> kv_pb2.StatsReply:
        return kv_pb2.StatsReply(**{k: v for k, v in self.stats.items() if k in STATS_FIELDS})


STATS_FIELDS = set(kv_pb2.StatsReply.DESCRIPTOR.fields_by_name)


async def start_server(servicer: kv_pb2_grpc.KVTransferServicer, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """Serve KVTransfer on host:port (0 picks a free port); returns the server and its port."""
    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    kv_pb2_grpc.add_KVTransferServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind the KV transfer port {host}:{port}")
    await server.start()
    return server, bound


class KVPusher:
    """Client side: one channel per peer, reused across requests."""

    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.stats: collections.Counter[str] = collections.Counter()

    def _stub(self, addr: str) -> kv_pb2_grpc.KVTransferStub:
        channel = self._channels.get(addr)
        if channel is None:
            channel = self._channels[addr] = grpc.aio.insecure_channel(addr, options=CHANNEL_OPTIONS)
        return kv_pb2_grpc.KVTransferStub(channel)

    async def push(self, addr: str, chunks: AsyncIterator[kv_pb2.KVChunk], timeout_s: float = 60.0) -> int:
        """Stream `chunks` (header, layers, commit) to the messenger at `addr`; returns bytes accepted."""
        try:
            ack = await self._stub(addr).PushKV(chunks, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise TransferError(f"KV push to {addr} failed: {exc.code().name}: {exc.details()}") from exc
        if not ack.ok:
            raise TransferError(f"KV push to {addr} refused: {ack.error}")
        self.stats["bytes_sent"] += ack.bytes_received
        self.stats["streams_sent"] += 1
        return ack.bytes_received

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self._channels.values()), return_exceptions=True)
        self._channels.clear()
