"""The KV index heals itself (issue 19): on a real NATS server and real redis-servers, a real kvs-meta and the
engines' real Reporter over real block pools (the part of an engine that announces its blocks; no model is
needed to hold blocks). Events are lost while Redis or kvs-meta is down; within seconds of their return the
index (kvs-meta's query API) again says exactly what the engines hold, and kvs-meta's restart purges no live
engine."""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import signal
import time
import urllib.request
import uuid

import nats
import nats.errors
import pytest

from conftest import start_server, stop
from harness import UpProcess
from test_conductor_service import start_conductor
from kvc_kvs_meta.config import KVSMetaConfig
from kvc_kvs_meta.service import KVSMetaService
from kvcentric.core.block_pool import BlockPool
from kvcentric.core.protocol import KVSDump, KVSDumpQuery, KVSQuery, KVSReply, Subjects, decode, encode
from kvcentric.engine.service.reporter import Reporter
from kvcentric.runtime.bus import Bus
from kvcentric.tools.processes import free_port, redis_server_argv
from waiting import eventually, eventually_async

HEAL_S = 10.0
"""How long the index may take to match the engines again (it takes well under a second when idle)."""


class Engine:
    """An engine's block pool and its Reporter on a real bus: it stores and evicts blocks, announces them
    as an engine's work loop does, and answers kvs-meta's resync and snapshot requests."""

    def __init__(self, name: str, blocks: int = 64) -> None:
        self.name = name
        self.pool = BlockPool(blocks, 16)
        self.stopping = asyncio.Event()
        self.bus = Bus(name, collections.Counter(), logging.getLogger(name))
        self.reporter = Reporter(self.bus, name, "test", self.pool, None, pusher=None)  # type: ignore[arg-type]
        self.run = uuid.uuid4().hex[:8]
        self.made = 0

    async def start(self, nats_url: str) -> None:
        await self.bus.connect(nats_url, self.stopping)
        await self.reporter.listen_for_resync()

    def store(self, count: int) -> None:
        """Fill `count` blocks with new hashes (the least recently freed ones are evicted for them)."""
        blocks = self.pool.allocate(count)
        self.pool.cache(blocks, [f"{self.name}-{self.run}-{self.made + i}" for i in range(count)])
        self.made += count
        self.pool.free(blocks)

    def holds(self) -> list[str]:
        return sorted(self.pool.hash_to_block)

    def ever_made(self) -> list[str]:
        return [f"{self.name}-{self.run}-{i}" for i in range(self.made)]

    async def close(self) -> None:
        self.stopping.set()
        await self.bus.close()


async def index_view(nc, engines: list[Engine]) -> dict[str, list[str]]:
    """Engine -> the blocks kvs-meta's query API says it holds (among every block any engine ever made)."""
    hashes = [h for engine in engines for h in engine.ever_made()]
    reply = await nc.request(Subjects.KVS_QUERY, encode(KVSQuery(block_hashes=hashes)), timeout=2)
    view: dict[str, list[str]] = {engine.name: [] for engine in engines}
    for block_hash, holders in zip(hashes, decode(reply.data, KVSReply).holders):
        for holder in holders:
            view.setdefault(holder.rsplit(":", 1)[0], []).append(block_hash)
    return {name: sorted(blocks) for name, blocks in view.items()}


async def index_matches(nc, engines: list[Engine], what: str) -> None:
    await eventually_async(lambda: index_view(nc, engines), what, timeout_s=HEAL_S, every_s=0.1,
                           until=lambda view: view == {engine.name: engine.holds() for engine in engines},
                           ignoring=(nats.errors.NoRespondersError, nats.errors.TimeoutError))


async def start_kvs_meta(nats_url: str, redis_url: str, **settings) -> KVSMetaService:
    service = KVSMetaService(KVSMetaConfig(nats_url=nats_url, instance_id="kvs-heal", redis_url=redis_url,
                                           **settings))
    await service.open()
    return service


@pytest.fixture
def own_redis():
    """A redis-server of this test's own (no persistence), to stop and start again, empty, on the same port."""
    port = free_port()
    servers = [start_server(redis_server_argv(port), port)]

    def restart() -> None:
        servers.append(start_server(redis_server_argv(port), port))

    try:
        yield f"redis://127.0.0.1:{port}/0", servers, restart
    finally:
        stop(servers[-1])


async def started_engines(nats_url: str, *names: str) -> list[Engine]:
    engines = [Engine(name) for name in names]
    for engine in engines:
        await engine.start(nats_url)
        engine.store(40)
        await engine.reporter.publish_cache_changes()
    return engines


async def test_after_redis_comes_back_empty_the_index_holds_what_the_engines_hold(own_nats, own_redis):
    redis_url, servers, restart = own_redis
    kvs = await start_kvs_meta(own_nats, redis_url, lease_ttl_s=2.0)
    engines = await started_engines(own_nats, "p0", "p1")
    nc = await nats.connect(own_nats)
    try:
        await index_matches(nc, engines, "kvs-meta indexed the announced blocks")
        stop(servers[-1])
        for engine in engines:  # stored and evicted while Redis is down: these events are lost
            engine.store(30)
            await engine.reporter.publish_cache_changes()
        await eventually_async(lambda: kvs.redis_lost, "kvs-meta noticed Redis is gone")
        restart()  # empty: no AOF, no RDB
        await index_matches(nc, engines, "the index healed after Redis came back empty")
        assert kvs.counters["kv_blocks_healed_total"] > 0 and kvs.counters["nodes_purged_total"] == 0
    finally:
        await nc.close()
        for engine in engines:
            await engine.close()
        await kvs.close()


async def test_a_restarted_kvs_meta_heals_lost_events_and_purges_no_live_engine(own_nats, own_redis):
    redis_url = own_redis[0]
    settings = {"lease_ttl_s": 1.0, "startup_grace_s": 3.0}
    kvs = await start_kvs_meta(own_nats, redis_url, **settings)
    engines = await started_engines(own_nats, "p0", "p1", "gone")
    live, gone = engines[:2], engines[2]
    nc = await nats.connect(own_nats)
    try:
        await index_matches(nc, engines, "kvs-meta indexed the announced blocks")
        await kvs.close()
        await gone.close()  # an engine that dies while kvs-meta is down: the index keeps its blocks for now
        for engine in live:  # while kvs-meta is down: events nobody ingests, leases that lapse
            engine.store(30)
            await engine.reporter.publish_cache_changes()
        await asyncio.sleep(2 * settings["lease_ttl_s"])

        kvs = await start_kvs_meta(own_nats, redis_url, **settings)
        await index_matches(nc, engines, "the index healed after kvs-meta's restart, within its grace period")
        assert kvs.counters["nodes_purged_total"] == 0

        async def digests_now_and_then() -> None:  # the engines' periodic digest (--kv-digest-every-s)
            while True:
                for engine in live:
                    await engine.reporter.publish_digest()
                await asyncio.sleep(0.3)

        beating = asyncio.ensure_future(digests_now_and_then())
        gone.pool = BlockPool(1, 16)  # what the index should say of it once purged: nothing
        await eventually_async(lambda: index_view(nc, engines), "the dead engine was purged after the grace",
                               timeout_s=HEAL_S, every_s=0.2,
                               until=lambda view: view == {engine.name: sorted(engine.pool.hash_to_block)
                                                           for engine in engines})
        beating.cancel()
        assert kvs.counters["nodes_purged_total"] == 1
    finally:
        await nc.close()
        for engine in live:
            await engine.close()
        await kvs.close()


async def test_a_conductor_that_could_not_seed_its_index_gets_every_engines_blocks_again(own_nats):
    engines = await started_engines(own_nats, "p0", "p1")  # announced before the conductor existed
    conductor = await start_conductor(own_nats, policy="cache_aware", prefix_index="local",
                                      prefix_seed_patience_s=0.5)  # no kvs-meta on this NATS: it goes unseeded
    try:
        await eventually_async(lambda: conductor.seeding.live, "the conductor went live unseeded")
        assert not conductor.seeded
        await eventually_async(lambda: {engine.name: conductor.index.match(engine.holds()).get(engine.name, 0)
                                        for engine in engines}, "the engines announced all their blocks again",
                               until=lambda matched: matched == {"p0": 40, "p1": 40})
    finally:
        await conductor.close()
        for engine in engines:
            await engine.close()


# ---------------------------------------------------------------- a whole `kvcentric up`


def complete(url: str, prompt: str) -> int:
    body = json.dumps({"prompt": prompt, "max_tokens": 2, "temperature": 0}).encode()
    request = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return response.status


async def whole_index(nats_url: str) -> set[tuple[str, str, str]]:
    """Every (node, tier, block) in kvs-meta's index, paged in through kvc.kvs.dump."""
    nc = await nats.connect(nats_url)
    try:
        held, cursor = set(), 0
        while True:
            reply = await nc.request(Subjects.KVS_DUMP, encode(KVSDumpQuery(cursor=cursor)), timeout=2)
            page = decode(reply.data, KVSDump)
            held |= {(event.node_id, event.tier, h) for event in page.events for h in event.block_hashes}
            cursor = page.cursor
            if not cursor:
                return held
    finally:
        await nc.close()


def settled_index(nats_url: str) -> set[tuple[str, str, str]]:
    """The index once two dumps a second apart agree."""
    seen = [asyncio.run(whole_index(nats_url))]

    def again() -> bool:
        time.sleep(1.0)
        seen.append(asyncio.run(whole_index(nats_url)))
        return seen[-1] == seen[-2]
    eventually(again, "the index stopped changing", timeout_s=30)
    return seen[-1]


def test_under_kvcentric_up_a_restarted_empty_redis_gets_the_engines_blocks_back(tmp_path):
    up = UpProcess(str(tmp_path), "--prefill", "1", "--decode", "1")
    try:
        for i in range(4):  # byte tokens: each prompt fills a few 16-token blocks of its own
            assert complete(up.url, f"prompt {i}: " + "the index heals itself " * 6) == 200
        nats_url = up.reload()["nats_url"]
        before = settled_index(nats_url)  # the host pool's write-behind announces its blocks a little later
        assert {node for node, _, _ in before} == {"prefill-0"} and len(before) >= 12
        said = len(up.said)
        os.kill(up.reload()["services"]["redis-server"]["pid"], signal.SIGKILL)
        up.wait_said(r"redis-server restarted \(pid \d+\)", after=said)
        # no request since: what prefill-0 holds is what the index held before; the new Redis starts empty
        eventually(lambda: asyncio.run(whole_index(nats_url)), "the index holds prefill-0's blocks again",
                   until=lambda held: held == before, timeout_s=30, every_s=0.5,
                   ignoring=(nats.errors.NoRespondersError, nats.errors.TimeoutError))
    finally:
        up.stop()
