"""The kvs-meta service's asyncio shell: ingests kvc.kv.events.* into Redis, keeps a lease per node
renewed by its load reports (the heartbeat) and purges nodes whose lease ran out, answers kvc.kvs.query
over NATS and GET /batch_query_keys over HTTP, and pages through the whole index on kvc.kvs.dump (how a
conductor seeds its local mirror). The storage logic is `kvcentric.runtime.kvs_store`.
"""

from __future__ import annotations

import asyncio

from aiohttp import web
from redis.asyncio import Redis
from redis.exceptions import RedisError

from kvc_kvs_meta.config import KVSMetaConfig
from kvcentric.core.openai_api import ApiError
from kvcentric.core.protocol import KVEventBatch, KVSDump, KVSDumpQuery, KVSQuery, KVSReply, LoadReport, Subjects
from kvcentric.runtime.kvs_store import KVMetaStore, mooncake_batch_reply
from kvcentric.runtime.service import Service


READY_PING_TIMEOUT_S = 0.5
"""How long /ready waits for Redis to answer a ping."""


class KVSMetaService(Service):
    role = "kvs-meta"

    def __init__(self, config: KVSMetaConfig) -> None:
        super().__init__(config)
        self.config: KVSMetaConfig = config
        self.redis = Redis.from_url(config.redis_url)
        self.store = KVMetaStore(self.redis, config.lease_ttl_s)
        self.heartbeats: set[str] = set()

    async def start(self) -> None:
        await self.redis.ping()
        await self.bus.subscribe(Subjects.KV_EVENTS_ALL, KVEventBatch, self.on_events)
        await self.bus.subscribe(Subjects.KVS_QUERY, KVSQuery, self.on_query, queue="kvs-meta",
                                 bad_reply=lambda error: KVSReply(holders=[], error=error))
        await self.bus.subscribe(Subjects.KVS_DUMP, KVSDumpQuery, self.on_dump, queue="kvs-meta")
        await self.bus.subscribe(Subjects.LOAD_ALL, LoadReport, self.on_heartbeat)
        self.tasks.spawn(self.tasks.every(self.config.lease_ttl_s / 4, self.leases), "leases")

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
        await self.store.apply(batch.events)
        self.counters["kv_events_total"] += len(batch.events)

    async def on_heartbeat(self, report: LoadReport) -> None:
        self.heartbeats.add(report.instance_id)

    async def leases(self) -> None:
        """Renew the leases of nodes heard from since the last round; purge nodes whose lease ran out."""
        beating, self.heartbeats = sorted(self.heartbeats), set()
        if beating:
            await self.store.renew_leases(beating)
        for node_id in await self.store.expired_nodes():
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
        return web.json_response(mooncake_batch_reply(keys, await self.store.holders(keys)))


def bad_query(message: str) -> web.Response:
    body = {**ApiError(400, message, param="keys").body(), "success": False}
    return web.json_response(body, status=400)
