"""The kvs-meta service's asyncio shell: ingests kvc.kv.events.* into Redis, keeps a lease per node
renewed by its load reports (the heartbeat) and purges nodes whose lease ran out, answers kvc.kvs.query
over NATS and GET /batch_query_keys over HTTP, and pages through the whole index on kvc.kvs.dump (how a
conductor seeds its local mirror). It heals the index: it compares each engine's digest (kvc.kv.digest.*)
with what the index holds for it and, when they differ, asks the engine for its block lists and publishes
the difference as the engine's KV events (so conductors' mirrors heal too); it asks every engine for its
digest when it starts and when its Redis comes back, and purges nobody for a grace period then. With Redis
Sentinels (--redis-sentinels) it follows a failover to the new primary. The storage logic is
`kvcentric.runtime.kvs_store`, the digests `kvcentric.core.kvdigest`.
"""

from __future__ import annotations

import asyncio
import time
import urllib.parse

import nats.errors

from aiohttp import web
from redis.asyncio import Redis
from redis.asyncio.sentinel import Sentinel
from redis.exceptions import RedisError

from kvc_kvs_meta.config import KVSMetaConfig
from kvcentric.core.kvdigest import digests, healed_blocks, healing_events, mismatched_tiers
from kvcentric.core.openai_api import ApiError
from kvcentric.core.protocol import (BadMessage, KVDigest, KVEventBatch, KVResync, KVSDump, KVSDumpQuery, KVSnapshot,
                                     KVSnapshotQuery, KVSQuery, KVSReply, LoadReport, Subjects)
from kvcentric.runtime.kvs_store import KVMetaStore, mooncake_batch_reply
from kvcentric.runtime.security import redis_options
from kvcentric.runtime.service import Service


def connect_redis(config: KVSMetaConfig) -> Redis:
    """The client of the metadata store: --redis-url itself, or with --redis-sentinels the primary of
    --redis-master as the Sentinels name it, looked up again whenever a connection to it fails or finds it
    demoted (read-only), so writes follow a failover."""
    options = redis_options(config.redis_url, config.redis_user, config.redis_password_file, config.tls_ca,
                            config.tls_cert, config.tls_key)
    if not config.redis_sentinels:
        return Redis.from_url(config.redis_url, **options)
    db = int(urllib.parse.urlparse(config.redis_url).path.strip("/") or 0)
    if config.redis_url.startswith("rediss://"):
        options["ssl"] = True
    sentinel = Sentinel([address for address in config.sentinels if address], sentinel_kwargs=dict(options),
                        socket_timeout=SENTINEL_TIMEOUT_S, **options)
    return sentinel.master_for(config.redis_master, db=db)


SENTINEL_TIMEOUT_S = 2.0
"""How long a Sentinel or the primary may take to answer one command before the next is asked."""
READY_PING_TIMEOUT_S = 0.5
"""How long /ready waits for Redis to answer a ping."""


class KVSMetaService(Service):
    role = "kvs-meta"

    def __init__(self, config: KVSMetaConfig) -> None:
        super().__init__(config)
        self.config: KVSMetaConfig = config
        self.redis = connect_redis(config)
        self.store = KVMetaStore(self.redis, config.lease_ttl_s)
        self.heartbeats: set[str] = set()
        self.endpoints: dict[str, tuple[str, int]] = {}
        """Each engine's messenger address and block bytes, from its load reports (for /batch_query_keys)."""
        self.grace_until = time.monotonic() + config.startup_grace_s
        """No node is purged before this (time.monotonic()): kvs-meta started, or its Redis came back."""
        self.redis_lost = False
        """Whether the last Redis call failed: when one works again, every engine is asked for its digest."""

    async def start(self) -> None:
        await self.redis.ping()
        await self.bus.subscribe(Subjects.KV_EVENTS_ALL, KVEventBatch, self.on_events)
        await self.bus.subscribe(Subjects.KVS_QUERY, KVSQuery, self.on_query, queue="kvs-meta",
                                 bad_reply=lambda error: KVSReply(holders=[], error=error))
        await self.bus.subscribe(Subjects.KVS_DUMP, KVSDumpQuery, self.on_dump, queue="kvs-meta")
        await self.bus.subscribe(Subjects.LOAD_ALL, LoadReport, self.on_heartbeat)
        await self.bus.subscribe(Subjects.KV_DIGEST_ALL, KVDigest, self.on_digest, queue="kvs-meta")
        self.grace_until = time.monotonic() + self.config.startup_grace_s
        self.tasks.spawn(self.tasks.every(self.config.lease_ttl_s / 4, self.leases), "leases")
        await self.ask_for_digests("kvs-meta started")

    async def stop(self) -> None:
        await self.redis.aclose()

    async def readiness(self) -> str:
        try:
            await asyncio.wait_for(self.redis.ping(), READY_PING_TIMEOUT_S)
        except (TimeoutError, RedisError, OSError) as exc:
            return f"Redis does not answer: {type(exc).__name__}"
        return ""

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/batch_query_keys", self.batch_query_keys)

    async def on_events(self, batch: KVEventBatch) -> None:
        try:
            await self.store.apply(batch.events)
        except (RedisError, OSError):
            self.counters["kv_events_dropped_total"] += len(batch.events)  # the next digests find them missing
            self.redis_lost = True
            return
        self.counters["kv_events_total"] += len(batch.events)

    async def ask_for_digests(self, reason: str) -> None:
        self.counters["resync_broadcasts_total"] += 1
        self.log.info("asking every engine for the digest of its blocks: %s", reason)
        await self.bus.publish(Subjects.KV_RESYNC, KVResync(reason=reason))

    async def on_digest(self, digest: KVDigest) -> None:
        """Compare an engine's digest with the index; on a difference, fetch its lists and heal."""
        self.heartbeats.add(digest.node_id)
        self.counters["kv_digests_total"] += 1
        try:
            indexed = await self.store.node_blocks(digest.node_id)
        except (RedisError, OSError):
            self.redis_lost = True  # the digest after Redis comes back heals this node
            return
        tiers = mismatched_tiers(digest.tiers, digests(indexed))
        if not tiers:
            return
        try:
            snapshot = await self.bus.request(Subjects.kv_snapshot(digest.node_id), KVSnapshotQuery(tiers=tiers),
                                              KVSnapshot, timeout_s=self.config.snapshot_timeout_s)
        except (nats.errors.Error, BadMessage) as exc:
            self.counters["kv_snapshot_failures_total"] += 1
            self.log.warning("%s's blocks differ from the index, and its lists did not come: %s",
                             digest.node_id, exc)
            return
        events = healing_events(digest.node_id, snapshot.tiers, {tier: indexed.get(tier, set()) for tier in tiers})
        if events:
            await self.bus.publish(Subjects.kv_events(digest.node_id), KVEventBatch(events=events))
        self.counters["kv_blocks_healed_total"] += healed_blocks(events)
        self.log.info("the index differed from %s's blocks in %s: healed %d blocks", digest.node_id,
                      ", ".join(tiers), healed_blocks(events))

    async def on_heartbeat(self, report: LoadReport) -> None:
        self.heartbeats.add(report.instance_id)
        self.endpoints[report.instance_id] = (report.kv_addr, report.block_bytes)

    async def leases(self) -> None:
        """Renew the leases of nodes heard from since the last round; purge nodes whose lease ran out."""
        beating, self.heartbeats = sorted(self.heartbeats), set()
        try:
            if beating:
                await self.store.renew_leases(beating)
            expired = await self.store.expired_nodes()
        except (RedisError, OSError) as exc:
            if not self.redis_lost:
                self.log.warning("Redis does not answer: %s", exc)
            self.redis_lost = True
            return
        if self.redis_lost:
            self.redis_lost = False
            self.grace_until = time.monotonic() + self.config.startup_grace_s
            await self.ask_for_digests("Redis came back")
        if time.monotonic() < self.grace_until:
            return
        for node_id in expired:
            purged = await self.store.purge_node(node_id)
            self.counters["nodes_purged_total"] += 1
            self.log.info("lease of %s ran out: purged it from %d blocks", node_id, purged)

    async def on_query(self, query: KVSQuery) -> KVSReply:
        self.counters["queries_total"] += 1
        return KVSReply(holders=await self.store.holders(query.block_hashes[: self.config.max_query_keys]))

    async def on_dump(self, query: KVSDumpQuery) -> KVSDump:
        """One page of the index; a query that fails gets no answer (the asker retries), never an
        empty "last page" that would pass for the whole index."""
        self.counters["dump_pages_total"] += 1
        count = max(1, min(query.count, self.config.max_query_keys))
        events, cursor = await self.store.dump(max(0, query.cursor), count)
        return KVSDump(events=events, cursor=cursor)

    async def batch_query_keys(self, request: web.Request) -> web.Response:
        """Mooncake's master query. A bad query is a 400 OpenAI error object (with Mooncake's `success:
        false` beside it); Redis down is the HTTP layer's 503 with Retry-After."""
        keys = [k for k in request.query.get("keys", "").split(",") if k]
        if not keys:
            return bad_query("give keys=k1,k2,...")
        if len(keys) > self.config.max_query_keys:
            return bad_query(f"at most {self.config.max_query_keys} keys (--max-query-keys)")
        self.counters["http_queries_total"] += 1
        return web.json_response(mooncake_batch_reply(keys, await self.store.holders(keys), self.endpoints))


def bad_query(message: str) -> web.Response:
    body = {**ApiError(400, message, param="keys").body(), "success": False}
    return web.json_response(body, status=400)
