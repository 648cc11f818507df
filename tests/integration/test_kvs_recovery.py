"""The conductor gets prefix-aware placement back after kvs-meta comes back (`--prefix-index kvs-meta`), on a
real NATS server, a real kvs-meta and real redis-servers. test_conductor_service.py checks the way down (marked
down, load-only, no more asking); these tests check the way back: after `--kvs-down-duration-s` the
conductor asks again, and requests go to the instance that holds their prefix."""

from __future__ import annotations

import asyncio
import time
import uuid

import nats
import nats.errors
import pytest

from conftest import start_server, stop
from kvc_conductor.service import ConductorService
from kvc_kvs_meta.config import KVSMetaConfig
from kvc_kvs_meta.service import KVSMetaService
from kvcentric.tools.processes import free_port, redis_server_argv
from kvcentric.core.protocol import (BlockStored, KVEventBatch, KVSQuery, KVSReply, Placement, ScheduleRequest,
                                     Subjects, decode, encode)
from test_conductor_service import announce, metrics, schedule, start_conductor
from waiting import eventually_async

DOWN_S = 3.0
"""--kvs-down-duration-s of these tests: long enough to see the down period, short enough to wait it out."""
HELD_BLOCKS = 4
NO_EXPECTED_BLOCKS = False
"""These placements never run, so none leaves its blocks where it was placed: only kvs-meta's holders count."""
BLOCK_TOKENS = 16




async def start_kvs_meta(nats_url: str, redis_url: str) -> KVSMetaService:
    # a long lease: no load reports reach kvs-meta while it is down, and its blocks must outlive that
    service = KVSMetaService(KVSMetaConfig(nats_url=nats_url, instance_id="kvs-recovery", redis_url=redis_url,
                                           lease_ttl_s=600.0))
    await service.open()
    return service


async def store_blocks(nc, node: str, hashes: list[str]) -> None:
    """Announce `node`'s blocks as an engine does, and wait until kvs-meta answers with them."""
    batch = KVEventBatch(events=[BlockStored(node_id=node, block_hashes=hashes)])
    await nc.publish(Subjects.kv_events(node), encode(batch))

    async def holders() -> list[list[str]]:
        reply = await nc.request(Subjects.KVS_QUERY, encode(KVSQuery(block_hashes=hashes[:1])), timeout=2)
        return decode(reply.data, KVSReply).holders
    # NoRespondersError: a kvs-meta just started, and its subscription is on its way
    await eventually_async(holders, f"kvs-meta lists {node}'s blocks", until=lambda seen: seen == [[f"{node}:dram"]],
                           ignoring=(nats.errors.NoRespondersError,))


async def place(nc, conductor: ConductorService, hashes: list[str]) -> Placement:
    """Schedule a 100-token request on instances with empty queues (fresh load reports replace what the
    conductor placed before), so only prefix hits can tell the prefill instances apart."""
    await announce(nc, conductor)
    await eventually_async(lambda: {name: p.dispatched_s for name, p in conductor.registry.prefill.items()},
                           "the fresh load reports were taken",
                           until=lambda dispatched: all(s == 0 for s in dispatched.values()))
    decision = await schedule(nc, ScheduleRequest(request_id=f"r-{uuid.uuid4().hex[:8]}", n_tokens=100,
                                                  block_hashes=hashes, max_tokens=8))
    assert isinstance(decision, Placement), decision
    return decision


def unique_hashes(n: int = 6) -> list[str]:
    """Block hashes no other test on the session's Redis uses."""
    run = uuid.uuid4().hex[:12]
    return [f"kvs-recovery-{run}-{i}" for i in range(n)]


async def test_after_the_down_period_the_conductor_asks_kvs_meta_again_and_follows_the_prefix(own_nats, redis_url):
    kvs = await start_kvs_meta(own_nats, redis_url)
    conductor = await start_conductor(own_nats, policy="cache_aware", prefix_index="kvs-meta",
                                      kvs_down_duration_s=DOWN_S, expect_cache=NO_EXPECTED_BLOCKS)
    nc = await nats.connect(own_nats)
    try:
        hashes = unique_hashes()
        await store_blocks(nc, "p1", hashes[:HELD_BLOCKS])
        before = await place(nc, conductor, hashes)
        assert (before.prefill_id, before.cached_tokens) == ("p1", HELD_BLOCKS * BLOCK_TOKENS)

        await kvs.close()
        down = await place(nc, conductor, hashes)
        marked_down_at = time.monotonic()
        assert down.cached_tokens == 0 and conductor.gate.is_down(marked_down_at)
        assert conductor.counters["kvs_query_failures_total"] == 2 and conductor.gate.times_marked_down == 1
        assert conductor.counters["placements_load_only_total"] == 1

        kvs = await start_kvs_meta(own_nats, redis_url)  # back, with the same Redis behind it
        await store_blocks(nc, "p1", hashes[:HELD_BLOCKS])
        asked = kvs.counters["queries_total"]  # the test's own queries so far
        still_down = await place(nc, conductor, hashes)
        assert time.monotonic() < conductor.gate.down_until, "the test machine was too slow to see the down period"
        assert still_down.cached_tokens == 0 and kvs.counters["queries_total"] == asked  # not asked while down
        assert conductor.counters["placements_load_only_total"] == 2

        # deliberately let the down period run out: polling would place, and count, more requests
        await asyncio.sleep(max(0.0, conductor.gate.down_until - time.monotonic()) + 0.05)
        after = await place(nc, conductor, hashes)
        assert (after.prefill_id, after.cached_tokens) == ("p1", HELD_BLOCKS * BLOCK_TOKENS)
        assert kvs.counters["queries_total"] == asked + 1 and conductor.counters["kvs_query_failures_total"] == 2
        assert conductor.counters["placements_load_only_total"] == 2 and not conductor.gate.is_down(time.monotonic())
        assert 'kvc_kvs_metadata_down{role="conductor",instance="conductor-test"} 0.0' in await metrics(conductor)
    finally:
        await nc.close()
        await conductor.close()
        await kvs.close()


@pytest.fixture
def own_redis():
    """A redis-server of this test's own, to stop and start again on the same port."""
    port = free_port()
    servers = [start_server(redis_server_argv(port), port)]

    def restart() -> None:
        stop(servers[-1])
        servers.append(start_server(redis_server_argv(port), port))

    try:
        yield f"redis://127.0.0.1:{port}/0", servers, restart
    finally:
        stop(servers[-1])


async def test_when_the_redis_behind_kvs_meta_comes_back_prefix_placement_comes_back(own_nats, own_redis):
    redis_url, servers, restart = own_redis
    kvs = await start_kvs_meta(own_nats, redis_url)
    conductor = await start_conductor(own_nats, policy="cache_aware", prefix_index="kvs-meta",
                                      kvs_down_duration_s=DOWN_S, expect_cache=NO_EXPECTED_BLOCKS)
    nc = await nats.connect(own_nats)
    try:
        hashes = unique_hashes()
        await store_blocks(nc, "p1", hashes[:HELD_BLOCKS])
        assert (await place(nc, conductor, hashes)).prefill_id == "p1"

        stop(servers[-1])
        assert (await place(nc, conductor, hashes)).cached_tokens == 0  # kvs-meta is up, its Redis is not
        # kvs-meta answers that it cannot answer: that counts as a failure, so the gate marks it down
        assert conductor.gate.times_marked_down == 1 and conductor.counters["placements_load_only_total"] == 1

        restart()  # an empty Redis (no persistence): the blocks p0 stores from now on are known again
        await store_blocks(nc, "p0", hashes[:HELD_BLOCKS])
        decision = await eventually_async(lambda: place(nc, conductor, hashes), "prefix-aware placement came back",
                                          until=lambda placed: placed.cached_tokens > 0, timeout_s=DOWN_S + 10,
                                          every_s=0.1)
        assert (decision.prefill_id, decision.cached_tokens) == ("p0", HELD_BLOCKS * BLOCK_TOKENS)
    finally:
        await nc.close()
        await conductor.close()
        await kvs.close()
