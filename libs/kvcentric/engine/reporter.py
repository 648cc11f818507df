"""What an engine tells the rest of the cluster: its load on kvc.load.<role>.<id> (the conductor places by
it) and the blocks that entered or left its prefix cache on kvc.kv.events.<id> (kvs-meta indexes them).

It reports; the numbers of a load come from the role, which knows its queues.
"""

from __future__ import annotations

import time
from typing import NamedTuple

from kvcentric.core.block_pool import BlockPool
from kvcentric.core.protocol import BlockEvicted, BlockStored, KVEventBatch, LoadReport, Role, Subjects
from kvcentric.engine.kvpool import HostBlockPool
from kvcentric.engine.speed import SpeedMeter
from kvcentric.runtime.bus import Bus
from kvcentric.runtime.transfer import KVPusher


class Load(NamedTuple):
    """How busy a role is: requests waiting (and their prompt tokens), and requests running."""
    queued_requests: int
    queued_tokens: int
    running: int


class Reporter:
    """Load reports and KV cache events of one instance, built from its pools and its KV pusher."""

    def __init__(self, bus: Bus, instance_id: str, cluster: str, pool: BlockPool, host: HostBlockPool | None,
                 pusher: KVPusher) -> None:
        self.bus, self.instance_id, self.cluster = bus, instance_id, cluster
        self.pool, self.host, self.pusher = pool, host, pusher
        self.reports_sent = 0
        """Load reports published; the first is how the conductor learns of this instance."""
        self.speed: SpeedMeter | None = None
        """The engine's measured cost model, carried by the load reports when it changed (and now and then)."""

    def readiness(self, draining: bool) -> str:
        """Why the engine cannot take work ("" when it can): not yet announced to the conductor, or draining."""
        if draining:
            return "draining for a role change"
        return "" if self.reports_sent else "no load report sent to the conductor yet"

    def load_report(self, role: Role, load: Load, kv_addr: str, draining: bool) -> LoadReport:
        return LoadReport(instance_id=self.instance_id, role=role, cluster=self.cluster, kv_addr=kv_addr,
                          queued_requests=load.queued_requests, queued_tokens=load.queued_tokens, running=load.running,
                          kv_blocks_total=self.pool.num_blocks, kv_blocks_free=self.pool.num_free, ts=time.time(),
                          link_bandwidth=dict(self.pusher.bandwidth),
                          kv_bytes_sent=self.pusher.stats["bytes_streamed"], draining=draining,
                          cost=self.speed.for_report() if self.speed is not None else None)

    async def publish_load(self, role: Role, load: Load, kv_addr: str, draining: bool = False) -> None:
        await self.bus.publish(Subjects.load(role, self.instance_id), self.load_report(role, load, kv_addr, draining))
        self.reports_sent += 1

    async def publish_cache_changes(self) -> None:
        """Announce the blocks that entered or left the device and host pools since the last call."""
        events = []
        for tier, pool in (("device", self.pool), ("dram", self.host)):
            stored, evicted = pool.drain_events() if pool is not None else ([], [])
            events += ([BlockEvicted(node_id=self.instance_id, block_hashes=evicted, tier=tier)] if evicted else []) + \
                      ([BlockStored(node_id=self.instance_id, block_hashes=stored, tier=tier)] if stored else [])
        await self._publish_events(events)

    async def publish_cache_forgotten(self) -> None:
        """Announce every cached block gone (the instance starts over as another role, with an empty cache)."""
        events = []
        for tier, hashes in (("device", list(self.pool.hash_to_block)),
                             ("dram", list(self.host.slot_of) if self.host is not None else [])):
            if hashes:
                events.append(BlockEvicted(node_id=self.instance_id, block_hashes=hashes, tier=tier))
        await self._publish_events(events)

    async def _publish_events(self, events: list) -> None:
        if events:
            await self.bus.publish(Subjects.kv_events(self.instance_id), KVEventBatch(events=events))

    def stats(self) -> dict:
        """The pools' and the pusher's counters, for /health and /metrics."""
        host = {**self.host.stats, "host_blocks": len(self.host), "host_blocks_capacity": self.host.capacity} \
            if self.host is not None else {}
        pushed = {f"push_{key}": value for key, value in self.pusher.stats.items()}
        return {**host, **pushed, "kv_blocks_free": self.pool.num_free, "kv_blocks_total": self.pool.num_blocks}
