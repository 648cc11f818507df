"""Where a request's prefix blocks are, for the conductor: a local mirror of kvs-meta's block index kept from the
KV events (`--prefix-index local`) and seeded from kvs-meta's dump, or kvs-meta asked once per request (until the
seed is done, and always with `--prefix-index kvs-meta`), with retries and health gating. It answers "which
instance holds how many leading blocks"; it does not place, and it never writes to kvs-meta.

The seeding's states are `kvcentric.core.scheduling.seeding`, the gate's `kvcentric.core.scheduling.kvs_gate`;
this module only feeds them and asks for pages.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time

import nats.errors

from kvc_conductor.config import ConductorConfig
from kvcentric.core.protocol import (BadMessage, KVEventBatch, KVResync, KVSDump, KVSDumpQuery, KVSQuery, KVSReply,
                                     Subjects)
from kvcentric.core.scheduling.kvs_gate import KVSGate
from kvcentric.core.scheduling.prefix import HolderIndex, prefix_from_holders
from kvcentric.core.scheduling.seeding import IndexSeeding
from kvcentric.runtime import tracing
from kvcentric.runtime.bus import Bus
from kvcentric.runtime.tasks import Tasks


class KVSMetaFailed(Exception):
    """kvs-meta answered, but that it could not answer (e.g. its Redis is down)."""


KVS_ERRORS = (nats.errors.Error, asyncio.TimeoutError, BadMessage, KVSMetaFailed)
DUMP_PAGE_BLOCKS = 2000
"""Blocks asked for per page of kvs-meta's dump."""
DUMP_PAGE_TIMEOUT_S = 2.0
"""How long one page of the dump may take."""


class PrefixHits:
    """The leading blocks of a prompt each instance holds, from the local index or from kvs-meta."""

    def __init__(self, config: ConductorConfig, bus: Bus, counters: collections.Counter[str],
                 log: logging.Logger) -> None:
        self.config, self.bus, self.counters, self.log = config, bus, counters, log
        self.gate = KVSGate(config.kvs_retry_times, config.kvs_retry_interval_ms / 1000, config.kvs_down_duration_s)
        self.local = config.prefix_index == "local"
        self.seeding = IndexSeeding(HolderIndex(config.prefix_lease_ttl_s), config.prefix_seed_patience_s)
        self.index = self.seeding.index
        if not self.local:  # nothing to seed: the index stays empty and unused
            self.seeding.go_live(seeded=False)

    async def start(self, tasks: Tasks) -> None:
        """Follow the KV events and seed from kvs-meta (local index only): subscribed before the dump is asked
        for, so no event falls between the two."""
        if not self.local:
            return
        await self.bus.subscribe(Subjects.KV_EVENTS_ALL, KVEventBatch, self.on_kv_events)
        tasks.spawn(self.seed(), "seed-prefix-index")
        tasks.spawn(tasks.every(self.config.prefix_lease_ttl_s / 4, self.expire_leases), "prefix-index-leases")

    async def of(self, block_hashes: list[str]) -> dict[str, int] | None:
        """Leading blocks each instance holds; None when they cannot be known (kvs-meta down)."""
        if not block_hashes:
            return {}
        if self.local and self.seeding.live:
            attributes = {"kvc.block_hashes": len(block_hashes), "kvc.index": "local"}
            with tracing.span("kvs.query", attributes=attributes):
                return self.index.match(block_hashes)
        return await self.query_kvs_meta(block_hashes)

    def heard(self, instance_id: str, now: float) -> None:
        """A load report from the instance: its lease in the local index runs on."""
        if self.local:
            self.index.renew(instance_id, now)

    async def query_kvs_meta(self, block_hashes: list[str]) -> dict[str, int] | None:
        """Prefix hits from one kvs-meta batch query; None when it is down."""
        if not self.gate.available(time.monotonic()):
            return None
        for _ in range(self.config.kvs_retry_times):
            try:
                holders = await self.kvs_holders(block_hashes)
            except KVS_ERRORS as exc:
                self.counters["kvs_query_failures_total"] += 1
                if self.gate.on_failure(time.monotonic()):
                    self.log.warning("kvs-meta marked down for %g s after %d failures (last: %s); "
                                     "placing by load only", self.gate.down_duration_s, self.gate.retry_times,
                                     type(exc).__name__)
                    return None
                await asyncio.sleep(self.gate.retry_interval_s)
                continue
            self.gate.on_success()
            if len(holders) != len(block_hashes):
                self.counters["kvs_short_replies_total"] += 1
            return prefix_from_holders(holders)
        return None

    async def kvs_holders(self, block_hashes: list[str]) -> list[list[str]]:
        """kvs-meta's holders of each block (the trace goes on to kvs-meta); raises one of KVS_ERRORS."""
        answer = await self.bus.request(Subjects.KVS_QUERY, KVSQuery(block_hashes=block_hashes), KVSReply,
                                        self.config.kvs_timeout_s)
        if answer.error:
            raise KVSMetaFailed(answer.error)
        return answer.holders

    # ---------------------------------------------------------------- local block index

    async def on_kv_events(self, batch: KVEventBatch) -> None:
        self.seeding.on_events(batch, time.monotonic())

    async def seed(self) -> None:
        """Apply kvs-meta's dump, then the events buffered meanwhile, then go live. When kvs-meta does not
        answer for --prefix-seed-patience-s, go live from the events alone, and ask every engine to announce
        all the blocks it holds again (kvc.kv.resync, full)."""
        self.seeding.begin(time.monotonic())
        while not await self.load_dump():
            if self.seeding.out_of_patience(time.monotonic()):
                self.counters["prefix_seed_failures_total"] += 1
                self.log.warning("kvs-meta did not answer kvc.kvs.dump for %g s: the local block index starts "
                                 "from the KV events alone", self.config.prefix_seed_patience_s)
                self.go_live(seeded=False)
                await self.bus.publish(Subjects.KV_RESYNC, KVResync(reason="a conductor's index unseeded", full=True))
                return
            await asyncio.sleep(self.gate.retry_interval_s)
        self.go_live(seeded=True)

    async def load_dump(self) -> bool:
        """Apply kvs-meta's dump page by page; False when a page did not come (the next try starts over:
        applying a page twice changes nothing, and the buffered events correct what changed meanwhile)."""
        self.seeding.restart_dump()
        while True:
            try:
                page = await self.bus.request(Subjects.KVS_DUMP,
                                              KVSDumpQuery(cursor=self.seeding.cursor, count=DUMP_PAGE_BLOCKS),
                                              KVSDump, DUMP_PAGE_TIMEOUT_S)
            except KVS_ERRORS as exc:
                self.counters["prefix_dump_failures_total"] += 1
                say = self.log.warning if isinstance(exc, BadMessage) else self.log.debug
                say("no dump page from kvs-meta at cursor %d: %s: %s", self.seeding.cursor, type(exc).__name__, exc)
                return False
            if self.seeding.apply_page(page.events, page.cursor, time.monotonic()):
                self.counters["prefix_seed_blocks_total"] += self.seeding.dump_blocks
                return True

    def go_live(self, seeded: bool) -> None:
        replayed = self.seeding.go_live(seeded)
        self.log.info("local block index live (%s): %d blocks on %d nodes, %d buffered event batches applied",
                      "seeded from kvs-meta" if seeded else "not seeded", len(self.index), self.index.nodes,
                      replayed)

    async def expire_leases(self) -> None:
        for node_id in self.index.expire(time.monotonic()):
            self.counters["prefix_index_nodes_purged_total"] += 1
            self.log.info("no word from %s for %g s: dropped it from the local block index", node_id,
                          self.index.lease_ttl_s)

    def gauges(self) -> dict[str, float]:
        """The local index's size and seeding (none with `--prefix-index kvs-meta`)."""
        if not self.local:
            return {}
        return {"prefix_index_blocks": float(len(self.index)), "prefix_index_nodes": float(self.index.nodes),
                "prefix_index_seeded": float(self.seeding.seeded),
                "prefix_index_events_applied_total": float(self.index.events_applied)}
