"""A host-memory store of pushed request KV, bounded in bytes, oldest request dropped first.

It is the sink of a standalone messenger: pushes land here whole (header, layers, commit) and can be
pulled again by request id, waiting for the push to commit when the pull comes first. No I/O; the gRPC
side is `kvcentric.runtime.transfer`.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses

from kvcentric.runtime.kvwire import LayerData
from kvcentric.proto import kv_pb2


@dataclasses.dataclass
class StoredKV:
    header: kv_pb2.KVHeader
    layers: dict[int, LayerData] = dataclasses.field(default_factory=dict)
    commit: kv_pb2.KVCommit | None = None
    nbytes: int = 0


class HostKVStore:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.pending: dict[str, StoredKV] = {}
        self.complete: collections.OrderedDict[str, StoredKV] = collections.OrderedDict()
        self.evicted = 0
        self._committed = asyncio.Event()
        """Set when a push commits, then replaced by a fresh one: what a waiting pull wakes on."""

    async def begin(self, header: kv_pb2.KVHeader) -> None:
        if header.stripes > 1 and header.request_id in self.pending:
            return  # another stripe of a push in progress
        if header.request_id in self.pending or header.request_id in self.complete:
            raise ValueError(f"request {header.request_id} is already stored")
        self.pending[header.request_id] = StoredKV(header)

    def write(self, request_id: str, chunk: LayerData) -> None:
        entry = self.pending[request_id]
        size = len(chunk.key) + len(chunk.value)
        if size > self.capacity_bytes:
            raise ValueError(f"layer of {size} bytes exceeds the store's capacity")
        self._make_room(size)
        entry.layers[chunk.layer] = chunk
        entry.nbytes += size
        self.used_bytes += size

    def commit(self, request_id: str, commit: kv_pb2.KVCommit) -> None:
        entry = self.pending.pop(request_id)
        entry.commit = commit
        self.complete[request_id] = entry
        self._committed.set()
        self._committed = asyncio.Event()

    def abort(self, request_id: str, reason: str, retryable: bool = False) -> None:
        entry = self.pending.pop(request_id, None)
        if entry is not None:
            self.used_bytes -= entry.nbytes

    def get(self, request_id: str) -> StoredKV | None:
        entry = self.complete.get(request_id)
        if entry is not None:
            self.complete.move_to_end(request_id)
        return entry

    async def wait_for(self, request_id: str, timeout_s: float) -> StoredKV | None:
        """The request's stored KV, once its push has committed; None when it has not within `timeout_s`."""
        try:
            async with asyncio.timeout(timeout_s):
                while (entry := self.get(request_id)) is None:
                    await self._committed.wait()
        except TimeoutError:
            return None
        return entry

    def _make_room(self, size: int) -> None:
        while self.used_bytes + size > self.capacity_bytes and self.complete:
            _, oldest = self.complete.popitem(last=False)
            self.used_bytes -= oldest.nbytes
            self.evicted += 1
        if self.used_bytes + size > self.capacity_bytes:
            raise ValueError("the store is full of transfers in progress")
