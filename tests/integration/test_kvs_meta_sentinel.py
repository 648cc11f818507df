"""kvs-meta follows a Redis failover: with --redis-sentinels it writes to the primary the Sentinels name, and once
that primary is killed and the Sentinels promote its replica, it keeps ingesting and answering, on the new primary.
Real redis-servers (a primary, a replica, three Sentinels), a real NATS server, the real kvs-meta service."""

from __future__ import annotations

import signal
import subprocess
import uuid

import nats
import pytest
import redis

from conftest import start_server, stop
from kvc_kvs_meta.config import KVSMetaConfig
from kvc_kvs_meta.service import KVSMetaService
from kvcentric.config import ConfigError
from kvcentric.runtime.kvs_store import BLOCK_PREFIX
from kvcentric.core.protocol import BlockStored, KVEventBatch, KVSQuery, KVSReply, Subjects, decode, encode
from kvcentric.tools.processes import free_port, redis_server_argv, redis_server_binary
from waiting import eventually, eventually_async

MASTER = "kvcentric"


def role(port: int) -> str:
    with redis.Redis(port=port, socket_timeout=1) as client:
        return client.info("replication")["role"]


def start_sentinel(folder, primary_port: int) -> tuple[subprocess.Popen, int]:
    port = free_port()
    conf = folder / f"sentinel-{port}.conf"  # a Sentinel rewrites its own file: one each, writable
    conf.write_text(f"port {port}\nbind 127.0.0.1\nsentinel monitor {MASTER} 127.0.0.1 {primary_port} 2\n"
                    f"sentinel down-after-milliseconds {MASTER} 1000\nsentinel failover-timeout {MASTER} 5000\n")
    return start_server([redis_server_binary(), str(conf), "--sentinel"], port), port


@pytest.fixture
def replicated_redis(tmp_path):
    """A primary, its replica and three Sentinels watching them: (primary process, primary port, replica port,
    Sentinels as host:port,...)."""
    primary_port, replica_port = free_port(), free_port()
    primary = start_server(redis_server_argv(primary_port), primary_port)
    replica = start_server([*redis_server_argv(replica_port), "--replicaof", "127.0.0.1", str(primary_port)],
                           replica_port)
    sentinels = [start_sentinel(tmp_path, primary_port) for _ in range(3)]
    try:
        eventually(lambda: role(replica_port) == "slave" and redis.Redis(port=primary_port).info("replication")[
            "connected_slaves"] == 1, "the replica follows the primary", timeout_s=10)
        yield primary, primary_port, replica_port, ",".join(f"127.0.0.1:{port}" for _, port in sentinels)
    finally:
        for process in [primary, replica, *(process for process, _ in sentinels)]:
            stop(process)


async def store_and_find(nc, node: str, hashes: list[str]) -> None:
    """Announce `node`'s blocks until kvs-meta lists them (an engine's events that reach kvs-meta while it has no
    primary are lost, and its digest heals that later: here, the next announcement does)."""
    events = encode(KVEventBatch(events=[BlockStored(node_id=node, block_hashes=hashes)]))

    async def holders() -> list[list[str]]:
        await nc.publish(Subjects.kv_events(node), events)
        reply = await nc.request(Subjects.KVS_QUERY, encode(KVSQuery(block_hashes=hashes)), timeout=2)
        return decode(reply.data, KVSReply).holders
    await eventually_async(holders, f"kvs-meta lists {node}'s blocks", timeout_s=60, every_s=0.5,
                           until=lambda seen: seen == [[f"{node}:dram"]] * len(hashes),
                           ignoring=(nats.errors.NoRespondersError, nats.errors.TimeoutError))


async def test_kvs_meta_writes_to_the_new_primary_after_the_sentinels_promote_the_replica(own_nats,
                                                                                          replicated_redis):
    primary, primary_port, replica_port, sentinels = replicated_redis
    service = KVSMetaService(KVSMetaConfig(nats_url=own_nats, instance_id="kvs-sentinel", lease_ttl_s=600.0,
                                           redis_url="redis://ignored:1/0", redis_sentinels=sentinels))
    await service.open()
    nc = await nats.connect(own_nats)
    run = uuid.uuid4().hex[:8]
    try:
        await store_and_find(nc, "engine-a", [f"{run}-a{i}" for i in range(3)])
        primary.send_signal(signal.SIGKILL)
        primary.wait()
        eventually(lambda: role(replica_port), "the Sentinels promote the replica", until=lambda r: r == "master",
                   timeout_s=30, every_s=0.2)
        await store_and_find(nc, "engine-b", [f"{run}-b{i}" for i in range(3)])
        with redis.Redis(port=replica_port) as promoted:  # written there, not just cached somewhere
            assert promoted.keys(f"{BLOCK_PREFIX}*{run}-b0*")
        reply = await nc.request(Subjects.KVS_QUERY, encode(KVSQuery(block_hashes=[f"{run}-a0"])), timeout=2)
        assert decode(reply.data, KVSReply).holders == [["engine-a:dram"]]  # what the replica had copied
    finally:
        await nc.close()
        await service.close()


def test_a_sentinel_that_is_not_host_port_names_its_flag():
    with pytest.raises(ConfigError, match="--redis-sentinels"):
        KVSMetaConfig(redis_sentinels="sentinel-0:26379,sentinel-1")
