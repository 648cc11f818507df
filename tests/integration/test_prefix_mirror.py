"""The conductor's local block index on real NATS and Redis: kvs-meta's paged dump, cache-aware placement
from KV events with no kvs-meta lookup per request, a conductor started after the events seeded from the
dump, going live from events alone when kvs-meta is down, and bad dump pages and events dropped."""

from __future__ import annotations

import nats
import pytest
from redis.asyncio import Redis

from kvc_kvs_meta.config import KVSMetaConfig
from kvc_kvs_meta.service import KVSMetaService
from kvcentric.runtime.kvs_store import DUMP_MAX_BYTES, KVMetaStore
from kvcentric.core.protocol import (BlockEvicted, BlockStored, KVEventBatch, KVSDump, KVSDumpQuery, Placement,
                                ScheduleRequest, Subjects, decode, encode)
from test_conductor_service import announce, metrics, schedule, start_conductor
from waiting import eventually_async

HASHES = [f"mirror-{i}" for i in range(6)]


@pytest.fixture
async def redis_db(redis_url):
    """A Redis database of this test's own, emptied before and after."""
    url = redis_url.rsplit("/", 1)[0] + "/5"
    redis = Redis.from_url(url)
    await redis.flushdb()
    try:
        yield url, redis
    finally:
        await redis.flushdb()
        await redis.aclose()


@pytest.fixture
async def kvs_meta(own_nats, redis_db):
    service = KVSMetaService(KVSMetaConfig(nats_url=own_nats, instance_id="kvs-mirror", redis_url=redis_db[0]))
    await service.open()
    try:
        yield service
    finally:
        await service.close()


async def dump_all(store: KVMetaStore, count: int) -> tuple[dict[str, set[str]], int]:
    held: dict[str, set[str]] = {}
    cursor, pages = 0, 0
    while True:
        events, cursor = await store.dump(cursor, count)
        pages += 1
        assert len(encode(KVSDump(events=events, cursor=cursor))) < DUMP_MAX_BYTES * 2
        for event in events:
            for block_hash in event.block_hashes:
                held.setdefault(block_hash, set()).add(f"{event.node_id}:{event.tier}")
        if not cursor:
            return held, pages


async def test_the_dump_pages_through_every_block_and_holder(redis_db):
    store = KVMetaStore(redis_db[1])
    hashes = [f"{i:064x}" for i in range(5000)]
    await store.apply([BlockStored(node_id="p0", block_hashes=hashes, tier="device"),
                       BlockStored(node_id="p1", block_hashes=hashes[::2], tier="dram")])
    held, pages = await dump_all(store, count=1000)
    assert pages >= 5 and len(held) == 5000
    assert all(held[h] == ({"p0:device", "p1:dram"} if i % 2 == 0 else {"p0:device"}) for i, h in enumerate(hashes))


async def test_a_dump_page_stays_under_its_byte_budget(redis_db):
    store = KVMetaStore(redis_db[1])
    hashes = [f"{i:064x}" for i in range(1500)]  # 1.6 MB of hashes in all
    await store.apply([BlockStored(node_id=f"node-{n}", block_hashes=hashes, tier=tier)
                       for n in range(8) for tier in ("device", "dram")])
    events, cursor = await store.dump(0, 10_000)
    assert cursor != 0 and len(encode(KVSDump(events=events, cursor=cursor))) < 2 * DUMP_MAX_BYTES + 100_000


async def test_a_purged_node_leaves_no_tier_behind(redis_db):
    store = KVMetaStore(redis_db[1])
    await store.apply([BlockStored(node_id="p0", block_hashes=["a"], tier="device"),
                       BlockStored(node_id="p0", block_hashes=["a"], tier="dram"),
                       BlockEvicted(node_id="p0", block_hashes=["a"], tier="device")])
    assert await store.holders(["a"]) == [["p0:dram"]]
    assert await store.purge_node("p0") == 1
    assert await store.holders(["a"]) == [[]]


async def store_blocks(nc, node: str, hashes: list[str]) -> None:
    batch = KVEventBatch(events=[BlockStored(node_id=node, block_hashes=hashes, tier="device")])
    await nc.publish(Subjects.kv_events(node), encode(batch))
    await nc.flush()


async def test_a_local_conductor_places_from_kv_events_and_a_late_one_from_the_seed(own_nats, kvs_meta, redis_db):
    nc = await nats.connect(own_nats)
    conductor = await start_conductor(own_nats, policy="cache_aware")
    try:
        await eventually_async(lambda: (conductor.pending, conductor.seeded), "the first conductor was seeded",
                               until=lambda state: state == (None, True))
        await announce(nc, conductor)
        await store_blocks(nc, "p1", HASHES[:4])
        await eventually_async(lambda: conductor.index.match(HASHES), "the first conductor saw the event",
                               until=lambda match: match == {"p1": 4})
        decision = await schedule(nc, ScheduleRequest(request_id="a", n_tokens=100, block_hashes=HASHES, max_tokens=8))
        assert isinstance(decision, Placement) and decision.prefill_id == "p1" and decision.cached_tokens == 4 * 16
        assert kvs_meta.counters["queries_total"] == 0  # no lookup on the request's path
        text = await metrics(conductor)
        assert 'kvc_prefix_index_blocks{role="conductor",instance="conductor-test"} 4.0' in text
        assert 'kvc_prefix_index_seeded{role="conductor",instance="conductor-test"} 1.0' in text
    finally:
        await conductor.close()
    holders = KVMetaStore(redis_db[1]).holders
    await eventually_async(lambda: holders(HASHES[:1]), "kvs-meta stored p1's first block",
                           until=lambda seen: seen == [["p1:device"]])
    late = await start_conductor(own_nats, policy="cache_aware")
    try:
        await eventually_async(lambda: late.seeded, "the late conductor was seeded from kvs-meta's dump")
        assert late.index.match(HASHES) == {"p1": 4} and kvs_meta.counters["dump_pages_total"] >= 2
        await announce(nc, late)
        decision = await schedule(nc, ScheduleRequest(request_id="b", n_tokens=100, block_hashes=HASHES, max_tokens=8))
        assert isinstance(decision, Placement) and decision.prefill_id == "p1" and decision.cached_tokens == 4 * 16
        assert kvs_meta.counters["queries_total"] == 0
    finally:
        await late.close()
        await nc.close()


async def test_without_kvs_meta_the_local_index_goes_live_from_events_alone(own_nats):
    conductor = await start_conductor(own_nats, policy="cache_aware", prefix_seed_patience_s=0.2)
    nc = await nats.connect(own_nats)
    try:
        await announce(nc, conductor)
        await store_blocks(nc, "p0", HASHES[:3])  # buffered while the seed is tried, applied when it goes live
        await eventually_async(lambda: conductor.pending is None, "the local index went live")
        assert not conductor.seeded and conductor.counters["prefix_seed_failures_total"] == 1
        await eventually_async(lambda: conductor.index.match(HASHES), "the event reached the index",
                               until=lambda match: match == {"p0": 3})
        decision = await schedule(nc, ScheduleRequest(request_id="c", n_tokens=100, block_hashes=HASHES, max_tokens=8))
        assert isinstance(decision, Placement) and decision.prefill_id == "p0" and decision.cached_tokens == 3 * 16
        assert 'kvc_prefix_index_seeded{role="conductor",instance="conductor-test"} 0.0' in await metrics(conductor)
    finally:
        await nc.close()
        await conductor.close()


async def test_a_bad_dump_page_and_a_bad_event_are_dropped_and_counted(own_nats):
    nc = await nats.connect(own_nats)

    async def garbage(msg) -> None:
        await msg.respond(b"\xc1 not msgpack")
    await nc.subscribe(Subjects.KVS_DUMP, cb=garbage)
    await nc.flush()
    conductor = await start_conductor(own_nats, policy="cache_aware", prefix_seed_patience_s=0.3)
    try:
        await eventually_async(lambda: conductor.pending is None, "the local index went live")
        assert conductor.counters["prefix_dump_failures_total"] >= 1 and not conductor.seeded
        await nc.publish(Subjects.kv_events("p0"), b"\x92\x01\x02")
        await store_blocks(nc, "p0", HASHES[:2])
        await eventually_async(lambda: conductor.index.match(HASHES), "the good event after the bad one",
                               until=lambda match: match == {"p0": 2})
        assert conductor.counters["bus_drops_total"] == 1
    finally:
        await conductor.close()
        await nc.close()


async def test_kvs_meta_answers_a_dump_query_on_the_bus(own_nats, kvs_meta):
    nc = await nats.connect(own_nats)
    try:
        await store_blocks(nc, "p2", HASHES[:2])

        async def first_page() -> KVSDump:
            return decode((await nc.request(Subjects.KVS_DUMP, encode(KVSDumpQuery()), timeout=2)).data, KVSDump)
        page = await eventually_async(first_page, "the dump holds both blocks",
                                      until=lambda page: sum(len(event.block_hashes) for event in page.events) == 2)
        assert page.cursor == 0 and [(e.node_id, e.tier, sorted(e.block_hashes)) for e in page.events] == \
            [("p2", "device", HASHES[:2])]
    finally:
        await nc.close()
