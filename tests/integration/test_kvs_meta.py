"""kvs-meta on real NATS and Redis: events in, batch queries out, leases renewed by load reports, and a
node that stops reporting purged from every block it held."""

from __future__ import annotations

import json
import time
import urllib.request

import nats
import pytest

from conftest import stop
from harness import spawn_service
from kvcentric.core.protocol import (BlockEvicted, BlockStored, KVEventBatch, KVSQuery, KVSReply, LoadReport, Subjects,
                                decode, encode)
from waiting import eventually, eventually_async


@pytest.fixture
def kvs_meta(nats_url, redis_url):
    redis_db = redis_url.rsplit("/", 1)[0] + "/3"  # a database of its own: no other test's blocks
    process, port = spawn_service("kvs-meta", nats_url, "--redis-url", redis_db, "--lease-ttl-s", "2.0",
                                  "--startup-grace-s", "0")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(process)


def report(node: str, block_bytes: int = 0) -> LoadReport:
    return LoadReport(instance_id=node, role="prefill", cluster="local", kv_addr="127.0.0.1:1", queued_requests=0,
                      queued_tokens=0, running=0, kv_blocks_total=10, kv_blocks_free=10, ts=time.time(),
                      block_bytes=block_bytes)


async def holders(nc, hashes: list[str]) -> list[list[str]]:
    reply = await nc.request(Subjects.KVS_QUERY, encode(KVSQuery(block_hashes=hashes)), timeout=2)
    return decode(reply.data, KVSReply).holders


async def test_blocks_of_a_node_that_stops_heartbeating_are_purged(kvs_meta, nats_url):
    nc = await nats.connect(nats_url)
    try:
        events = KVEventBatch(events=[BlockStored(node_id="alive-node", block_hashes=["h1", "h2"]),
                                      BlockStored(node_id="dying-node", block_hashes=["h1"], tier="device")])
        await nc.publish(Subjects.kv_events("x"), encode(events))

        async def heartbeat_and_ask() -> list[list[str]]:
            await nc.publish(Subjects.load("prefill", "alive-node"), encode(report("alive-node")))
            return await holders(nc, ["h1", "h2", "h3"])
        # alive-node keeps reporting; dying-node never does, and its 2 s lease runs out
        purged = await eventually_async(heartbeat_and_ask, "dying-node purged, alive-node kept",
                                        until=lambda seen: seen == [["alive-node:dram"], ["alive-node:dram"], []],
                                        every_s=0.25)
        assert purged == [["alive-node:dram"], ["alive-node:dram"], []]
        evicted = KVEventBatch(events=[BlockEvicted(node_id="alive-node", block_hashes=["h2"])])
        await nc.publish(Subjects.kv_events("x"), encode(evicted))
        await nc.flush()
        await eventually_async(lambda: holders(nc, ["h2"]), "h2 evicted", until=lambda seen: seen == [[]], every_s=0.1)
        assert await holders(nc, ["h2"]) == [[]]
    finally:
        await nc.close()
    with urllib.request.urlopen(kvs_meta + "/metrics") as response:
        assert "nodes_purged_total" in response.read().decode()


async def test_the_http_batch_query_has_mooncakes_shape(kvs_meta, nats_url):
    nc = await nats.connect(nats_url)
    try:
        batch = KVEventBatch(events=[BlockStored(node_id="node-y", block_hashes=["k1"])])
        await nc.publish(Subjects.kv_events("y"), encode(batch))
        await nc.publish(Subjects.load("prefill", "node-y"), encode(report("node-y", block_bytes=4096)))
        await nc.flush()
    finally:
        await nc.close()

    def batch_query() -> dict:
        with urllib.request.urlopen(kvs_meta + "/batch_query_keys?keys=k1,missing") as response:
            return json.load(response)
    body = eventually(batch_query, "kvs-meta lists k1 with its holder's endpoint",
                      until=lambda body: body["data"]["k1"]["ok"] and body["data"]["k1"]["values"][0]["size_"])
    replica = {"size_": 4096, "buffer_address_": 0, "protocol_": "grpc", "transport_endpoint_": "127.0.0.1:1",
               "node_id": "node-y", "tier": "dram"}  # Mooncake's replica descriptor, and which node and tier
    assert body == {"success": True, "data": {"k1": {"ok": True, "values": [replica]},
                                              "missing": {"ok": False, "error": "OBJECT_NOT_FOUND"}}}
