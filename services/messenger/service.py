"""The standalone messenger's asyncio shell: serves KVTransfer over gRPC backed by a host-memory store.

Pushed request KV is kept (bounded, oldest first out) and can be pulled back by request id. Engines
run the same gRPC servicer in-process by default; this service is the node-level store of DESIGN.md.
"""

from __future__ import annotations

import grpc

from kvc_messenger.config import MessengerConfig
from kvcentric.proto import kv_pb2
from kvcentric.runtime.host_store import HostKVStore
from kvcentric.runtime.security import transfer_tls
from kvcentric.runtime.service import Service
from kvcentric.runtime.transfer import KVTransferServicer, advertised_address, start_server


class StoreServicer(KVTransferServicer):
    """KVTransfer whose pulls are served from the host store."""

    sink: HostKVStore

    async def Stats(self, request, context) -> kv_pb2.StatsReply:
        self.stats["stored_requests"] = len(self.sink.complete)
        return await super().Stats(request, context)

    async def PullKV(self, request, context):
        """The request's KV as it was pushed, waiting up to `wait_s` for the push to commit."""
        entry = await self.sink.wait_for(request.request_id, request.wait_s)
        if entry is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no KV for request {request.request_id}")
            return  # abort raises; this tells the type checker so
        yield kv_pb2.KVChunk(header=entry.header)
        for number in sorted(entry.layers):
            layer = entry.layers[number]
            yield kv_pb2.KVChunk(layer=kv_pb2.LayerChunk(
                layer=layer.layer, token_start=layer.token_start, token_end=layer.token_end, key=bytes(layer.key),
                value=bytes(layer.value), checksum=layer.checksum))
        yield kv_pb2.KVChunk(commit=entry.commit)
        self.stats["bytes_sent"] += entry.nbytes
        self.stats["streams_sent"] += 1


class MessengerService(Service):
    role = "messenger"

    def __init__(self, config: MessengerConfig) -> None:
        super().__init__(config)
        self.config: MessengerConfig = config
        self.store = HostKVStore(config.capacity_mb << 20)
        self.servicer = StoreServicer(self.store)
        self.kv_port = 0
        self._grpc = None

    async def start(self) -> None:
        self._grpc, self.kv_port = await start_server(self.servicer, self.config.kv_host, self.config.kv_port,
                                                      tls=transfer_tls(self.config))

    async def stop(self) -> None:
        if self._grpc is not None:
            await self._grpc.stop(grace=1.0)

    def health(self) -> dict:
        return {"kv_addr": advertised_address(self.config.kv_host, self.kv_port), "stats": self.gauges()}

    def gauges(self) -> dict[str, float]:
        return {**self.servicer.stats, "stored_requests": len(self.store.complete),
                "used_bytes": self.store.used_bytes, "evicted_requests": self.store.evicted}
