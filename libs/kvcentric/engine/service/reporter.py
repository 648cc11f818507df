"""What an engine tells the rest of the cluster: its load on kvc.load.<role>.<id> (the conductor places by
it, and counts the instance alive while it comes) and the blocks that entered or left its prefix cache on
kvc.kv.events.<id> (kvs-meta indexes them).

Load reports go out through the instance's heartbeat thread: the event loop computes the numbers, the
heartbeat sends each new one at once and, while the loop computes none (it is busy) or computes only the same
numbers again (an idle engine), sends the last one again marked `repeat` every `heartbeat_every_s`, so a busy
engine never looks dead and an idle one wakes the cluster half as often. It reports; the numbers of a load come from the
role, which knows its queues.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import NamedTuple

import msgspec

from kvcentric.core.block_pool import BlockPool
from kvcentric.core.costmodel import CostModel
from kvcentric.core.kvdigest import digests
from kvcentric.core.pipeline import StagePosition
from kvcentric.core.protocol import (BlockEvicted, BlockStored, KVDigest, KVEventBatch, KVResync, KVSnapshot,
                                     KVSnapshotQuery, LoadReport, Role, Subjects)
from kvcentric.core.scheduling.queueing import QueuedPrefill, queue_seconds, uncached_tokens
from kvcentric.engine.kv.kvpool import HostBlockPool
from kvcentric.engine.cores.prefill import PrefillEngine
from kvcentric.engine.service.speed import SpeedMeter
from kvcentric.runtime.bus import Bus
from kvcentric.runtime.heartbeat import Heartbeat
from kvcentric.runtime.security import NatsAccess
from kvcentric.runtime.transfer import KVPusher


REANNOUNCE_BATCH = 4096
"""Most block hashes in one re-announced BlockStored event (about 270 kB: under NATS's 1 MB payload)."""


MAX_LISTED_PREFILLS = 256
"""Most request ids a prefill load report lists (the newest: the conductor's unlisted placements are those)."""


class Load(NamedTuple):
    """How busy a role is: requests waiting (and their prompt tokens), and requests running."""
    queued_requests: int
    queued_tokens: int
    running: int
    staging_blocks_free: int = 0
    """Decode: blocks' worth of room left in its host staging."""
    prefills: tuple[QueuedPrefill, ...] | None = None
    """Prefill: the prompts running and queued, oldest first, with what of each is done or expected cached
    (None: a role that does not prefill)."""


def unchanged(before: LoadReport, after: LoadReport) -> bool:
    """Whether two computed reports say the same (all but the time each was made)."""
    return msgspec.structs.replace(after, ts=before.ts) == before


def prefills_of(engine: PrefillEngine) -> tuple[QueuedPrefill, ...]:
    """A prefill engine's prompts, running first, then queued: what each has done (a queued one: the prefix
    its placement expected it to reuse)."""
    running = [QueuedPrefill(w.request_id, w.num_tokens, w.done) for w in engine.running.values()]
    queued = [QueuedPrefill(job.request_id, len(job.token_ids), job.cached_tokens) for job in engine.queue]
    return (*running, *queued)


class Reporter:
    """Load reports and KV cache events of one instance, built from its pools and its KV pusher."""

    def __init__(self, bus: Bus, instance_id: str, cluster: str, pool: BlockPool, host: HostBlockPool | None,
                 pusher: KVPusher, heartbeat_every_s: float = 0.0) -> None:
        """`heartbeat_every_s`: the longest the heartbeat goes without sending a role's load (0: no
        heartbeat thread; each report is published on `bus` by the event loop, as in unit tests)."""
        self.bus, self.instance_id, self.cluster = bus, instance_id, cluster
        self.pool, self.host, self.pusher = pool, host, pusher
        self.heartbeat_every_s = heartbeat_every_s
        self.block_bytes = 0
        """Bytes of one of its KV blocks over all layers (set by the service; reported for kvs-meta)."""
        self.heartbeat: Heartbeat | None = None
        self.reports_sent = 0
        self.pipeline: StagePosition | None = None
        """The prefill group this instance is a stage of, named in its load reports (None: not one)."""
        self.est_queue_s = -1.0
        """A prefill instance's T_queue in its latest report (-1: none predicted yet), also on /metrics."""
        """Load reports published; the first is how the conductor learns of this instance."""
        self.latest: dict[str, tuple[LoadReport, float]] = {}
        """Role -> the last report the event loop computed and when (time.monotonic())."""
        self.sent_at: dict[str, tuple[LoadReport, float]] = {}
        """Role -> the report the heartbeat last sent (fresh or repeated) and when; heartbeat thread only."""
        self.ticks = 0
        self.unchanged_reports = 0
        """Loads the event loop computed that equalled the last one, left to the heartbeat to repeat."""
        self.speed: SpeedMeter | None = None
        """The engine's measured cost model, carried by the load reports when it changed (and now and then)."""
        self._cost: tuple[int, CostModel] | None = None
        """The measured prefill model and the fit version it was built from."""
        self.announces = False
        """Whether this role announces its blocks (its first publish_cache_changes); only then does it send
        digests and answer for its blocks, so a role that never announces never enters the index."""

    def readiness(self, draining: bool) -> str:
        """Why the engine cannot take work ("" when it can): not yet announced to the conductor, or draining."""
        if draining:
            return "draining for a role change"
        return "" if self.reports_sent else "no load report sent to the conductor yet"

    def load_report(self, role: Role, load: Load, kv_addr: str, draining: bool) -> LoadReport:
        report = LoadReport(instance_id=self.instance_id, role=role, cluster=self.cluster, kv_addr=kv_addr,
                            queued_requests=load.queued_requests, queued_tokens=load.queued_tokens,
                            running=load.running, kv_blocks_total=self.pool.num_blocks,
                            kv_blocks_free=self.pool.num_free, ts=time.time(),
                            kv_staging_blocks_free=load.staging_blocks_free, block_bytes=self.block_bytes,
                            link_bandwidth=dict(self.pusher.bandwidth),
                            kv_bytes_sent=self.pusher.stats["bytes_streamed"], draining=draining,
                            cost=self.speed.for_report() if self.speed is not None else None,
                            **pipeline_fields(self.pipeline))
        if role != "prefill":
            return report
        report = msgspec.structs.replace(report, **self.latest_chunk())
        if load.prefills is None:
            return report
        return msgspec.structs.replace(report, **self.prefill_queue(load.prefills))

    def latest_chunk(self) -> dict:
        """The latest prefill chunk this engine timed and its number (none timed yet: nothing)."""
        fit = self.speed.fit if self.speed is not None else None
        if fit is None or not fit.prefill.last:
            return {}
        return {"last_prefill": list(fit.prefill.last), "prefill_samples": fit.prefill.seen}

    def prefill_queue(self, prefills: tuple[QueuedPrefill, ...]) -> dict:
        """The queue fields of a prefill report: T_queue predicted from this engine's measured model (Mooncake
        §6.1; -1 before it has one), the tokens still to compute, and the newest request ids."""
        cost = self.prefill_cost()
        self.est_queue_s = round(queue_seconds(cost, prefills), 6) if cost is not None else -1.0
        return {"est_queue_s": self.est_queue_s,
                "queued_uncached_tokens": uncached_tokens(prefills),
                "prefill_ids": [prefill.request_id for prefill in prefills[-MAX_LISTED_PREFILLS:]]}

    def prefill_cost(self) -> CostModel | None:
        """The prefill model this engine measured of itself (None before its first fit)."""
        fit = self.speed.fit if self.speed is not None else None
        if fit is None or fit.prefill.fit is None:
            return None
        if self._cost is None or self._cost[0] != fit.version:
            p = fit.prefill.fit.coefficients
            assert self.speed is not None
            model = CostModel(prefill=(p[0], p[1], p[2], p[3]), decode=(0.0, 0.0, 0.0), kv_bytes_per_token=0,
                              source="measured", prefill_chunk=self.speed.prefill_chunk)
            self._cost = (fit.version, model)
        return self._cost[1]

    async def start_heartbeat(self, nats_url: NatsAccess | str) -> None:
        """Start the heartbeat thread (its own NATS connection); load reports go through it from now on."""
        if self.heartbeat_every_s > 0:
            self.heartbeat = Heartbeat(nats_url, self.instance_id, self.heartbeat_every_s, self.due_reports,
                                       logging.getLogger("kvcentric.heartbeat"))
            await self.heartbeat.start()

    async def stop_heartbeat(self) -> None:
        if self.heartbeat is not None:
            await self.heartbeat.stop()

    async def publish_load(self, role: Role, load: Load, kv_addr: str, draining: bool = False) -> None:
        """Send this load now; returns once it is out (a heartbeat late by a second gives up waiting). A load
        that says what the last one said is not sent again at once: the heartbeat repeats the last one within
        `heartbeat_every_s`, with its age taken from now."""
        report = self.load_report(role, load, kv_addr, draining)
        if self.heartbeat is None:
            await self.bus.publish(Subjects.load(role, self.instance_id), report)
            self.reports_sent += 1
            return
        previous = self.latest.get(role)
        if previous is not None and unchanged(previous[0], report):
            # The numbers still hold: vouch for them (their age stays fresh), and let the heartbeat repeat them
            # on its own period instead of waking it and every subscriber with the same report.
            self.latest[role] = (previous[0], time.monotonic())
            self.unchanged_reports += 1
            return
        self.latest[role] = (report, time.monotonic())
        try:
            await asyncio.wait_for(asyncio.wrap_future(self.heartbeat.beat()), 1.0)
        except TimeoutError:
            pass

    def due_reports(self, now: float) -> list[tuple[str, LoadReport]]:
        """In the heartbeat thread: each role's new load once, and its last one again (`repeat`) when the
        event loop has computed none for `heartbeat_every_s`; all stamped with this tick's number."""
        due = []
        for role, (report, computed_at) in list(self.latest.items()):
            last_report, last_sent = self.sent_at.get(role, (None, -math.inf))
            repeat = last_report is report
            if repeat and now - last_sent < self.heartbeat_every_s * 0.9:
                continue
            due.append((role, report, computed_at, repeat))
        if not due:
            return []
        self.ticks += 1
        out = []
        for role, report, computed_at, repeat in due:
            self.sent_at[role] = (report, now)
            stamped = msgspec.structs.replace(report, seq=self.ticks, repeat=repeat, ts=time.time(),
                                              load_age_s=round(now - computed_at, 4))
            out.append((Subjects.load(role, self.instance_id), stamped))
        self.reports_sent += len(out)
        return out

    async def publish_cache_changes(self) -> None:
        """Announce the blocks that entered or left the device and host pools since the last call."""
        self.announces = True
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
        self.announces = False
        await self._publish_events(events)

    # ---------------------------------------------------------------- re-announcing (the index heals)

    def block_sets(self) -> dict[str, list[str]]:
        """Every block hash held now, per tier."""
        return {"device": list(self.pool.hash_to_block),
                "dram": list(self.host.slot_of) if self.host is not None else []}

    async def publish_digest(self) -> None:
        """Send the digest of what this instance holds (kvs-meta asks for the lists when its index differs)."""
        if self.announces:
            message = KVDigest(node_id=self.instance_id, tiers=digests(self.block_sets()))
            await self.bus.publish(Subjects.kv_digest(self.instance_id), message)

    async def snapshot(self, query: KVSnapshotQuery) -> KVSnapshot:
        """Every block held now, in the tiers asked for (none when this role does not announce blocks)."""
        held = self.block_sets() if self.announces else {}
        wanted = {tier: hashes for tier, hashes in held.items() if not query.tiers or tier in query.tiers}
        return KVSnapshot(node_id=self.instance_id, tiers=wanted)

    async def publish_cache_held(self) -> None:
        """Announce every held block again as BlockStored events, in batches of at most REANNOUNCE_BATCH."""
        if not self.announces:
            return
        for tier, hashes in self.block_sets().items():
            for start in range(0, len(hashes), REANNOUNCE_BATCH):
                part = hashes[start:start + REANNOUNCE_BATCH]
                await self._publish_events([BlockStored(node_id=self.instance_id, block_hashes=part, tier=tier)])

    async def listen_for_resync(self) -> None:
        """Answer kvs-meta's requests for this instance's blocks; on a KV_RESYNC send the digest (or, when
        it asks for it all, every held block)."""
        async def on_resync(resync: KVResync) -> None:
            await (self.publish_cache_held() if resync.full else self.publish_digest())
        await self.bus.subscribe(Subjects.KV_RESYNC, KVResync, on_resync)
        await self.bus.subscribe(Subjects.kv_snapshot(self.instance_id), KVSnapshotQuery, self.snapshot)

    async def _publish_events(self, events: list) -> None:
        if events:
            await self.bus.publish(Subjects.kv_events(self.instance_id), KVEventBatch(events=events))

    def stats(self) -> dict:
        """The pools', the pusher's and the heartbeat's counters, for /health and /metrics."""
        host = {**self.host.stats, "host_blocks": len(self.host), "host_blocks_capacity": self.host.capacity} \
            if self.host is not None else {}
        pushed = {f"push_{key}": value for key, value in self.pusher.stats.items()}
        beats = {"heartbeats_total": self.heartbeat.beats,
                 "heartbeat_longest_gap_s": round(self.heartbeat.longest_gap_s, 4)} if self.heartbeat else {}
        return {**host, **pushed, **beats, "kv_blocks_free": self.pool.num_free,
                "kv_blocks_total": self.pool.num_blocks}


def pipeline_fields(position: StagePosition | None) -> dict:
    """The load report's fields that place an instance in its prefill group."""
    if position is None:
        return {}
    return {"pipeline_group": position.group, "stage": position.index, "stages": position.stages}
