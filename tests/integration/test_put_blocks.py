"""PutBlocks over real gRPC (a messenger on a free loopback port): the blocks a decode instance writes back land
in the messenger's host pool, through shared memory or inline, to be announced and found there; a corrupt
block is refused with those before it kept; a messenger without a pool, or none at all, refuses with a
TransferError (the writer drops the blocks), and the writer keeps a bounded number of bytes waiting for one."""

from __future__ import annotations

import collections

import pytest

from kvcentric.engine.kv.kvpool import HostBlockPool
from kvcentric.engine.service import writeback
from kvcentric.engine.service.writeback import FilledBlock, WriteBack
from kvcentric.proto import kv_pb2
from kvcentric.runtime.shm import UNAVAILABLE, SharedMemoryUnavailable
from kvcentric.runtime.transfer import KVPusher, KVTransferServicer, TransferError, checksum, put_blocks, start_server
from kvcentric.tools.processes import free_port
from waiting import eventually_async

pytestmark = pytest.mark.integration

BLOCK_BYTES = 64


class NoSink:
    async def begin(self, header): ...
    def write(self, request_id, chunk): ...
    def commit(self, request_id, commit): ...
    def abort(self, request_id, reason, retryable=False): ...


async def messenger(pool: HostBlockPool | None):
    servicer = KVTransferServicer(NoSink(), pool=pool)
    server, port = await start_server(servicer, "127.0.0.1", 0)
    return server, servicer, f"127.0.0.1:{port}"


def block(index: int) -> tuple[str, int, bytes]:
    return f"hash-{index}", index, bytes([index]) * BLOCK_BYTES


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shared-memory", "inline"])
async def test_put_blocks_land_in_the_peers_host_pool_and_are_announced_there(shared_memory):
    pool = HostBlockPool(8, BLOCK_BYTES)
    server, servicer, addr = await messenger(pool)
    pusher = KVPusher(shared_memory=shared_memory)
    try:
        taken = await put_blocks(pusher, addr, [block(3), block(4)])
        taken += await put_blocks(pusher, addr, [block(5)])  # the segment again, reused
    finally:
        await pusher.close()
        await server.stop(None)
    assert taken == 3 * BLOCK_BYTES and servicer.stats["blocks_put"] == 3
    assert servicer.stats["shm_bytes_received"] == (3 * BLOCK_BYTES if shared_memory else 0)
    assert pool.read("hash-4") == bytes([4]) * BLOCK_BYTES and pool.read("hash-5") == bytes([5]) * BLOCK_BYTES
    assert pool.drain_events() == (["hash-3", "hash-4", "hash-5"], [])


async def test_a_peer_that_cannot_open_the_segment_gets_the_blocks_inline_from_then_on(monkeypatch):
    pool = HostBlockPool(8, BLOCK_BYTES)
    server, servicer, addr = await messenger(pool)

    def unavailable(name):
        raise SharedMemoryUnavailable(f"{UNAVAILABLE}: cannot open segment {name}: another host")
    monkeypatch.setattr(servicer.segments, "attach", unavailable)
    pusher = KVPusher()
    try:
        assert await put_blocks(pusher, addr, [block(1)]) == BLOCK_BYTES
    finally:
        await pusher.close()
        await server.stop(None)
    assert addr in pusher.inline_peers and pool.read("hash-1") == bytes([1]) * BLOCK_BYTES


async def test_a_corrupt_block_is_refused_and_those_before_it_are_kept():
    pool = HostBlockPool(8, BLOCK_BYTES)
    server, _, addr = await messenger(pool)
    pusher = KVPusher()
    good, bad = kv_pb2.BlockChunk(block_hash="a", data=b"a" * BLOCK_BYTES, checksum=checksum(b"a" * BLOCK_BYTES)), \
        kv_pb2.BlockChunk(block_hash="b", data=b"b" * BLOCK_BYTES, checksum=1)
    try:
        ack = await pusher.stub(addr).PutBlocks(iter([good, bad]), timeout=10)
    finally:
        await pusher.close()
        await server.stop(None)
    assert not ack.ok and "checksum" in ack.error
    assert "a" in pool and "b" not in pool


async def test_a_messenger_without_a_pool_or_none_at_all_refuses_and_the_writer_counts_the_loss():
    server, _, addr = await messenger(None)
    pusher = KVPusher()
    try:
        with pytest.raises(TransferError, match="no pool"):
            await put_blocks(pusher, addr, [block(0)])
        counters: collections.Counter[str] = collections.Counter()
        writer = WriteBack(pusher, counters)
        writer.send([FilledBlock(f"127.0.0.1:{free_port()}", *block(1))])  # nobody listens there
        await eventually_async(lambda: counters["kv_write_back_failed_total"] == 1, "the lost block counted",
                               timeout_s=20)
        assert not writer.sending
    finally:
        await pusher.close()
        await server.stop(None)


async def test_blocks_beyond_what_a_lagging_pool_may_have_waiting_are_dropped(monkeypatch):
    monkeypatch.setattr(writeback, "MAX_PENDING_BYTES", 2 * BLOCK_BYTES)
    pusher, counters = KVPusher(), collections.Counter()
    writer = WriteBack(pusher, counters)
    addr = f"127.0.0.1:{free_port()}"
    try:
        writer.send([FilledBlock(addr, *block(index)) for index in range(3)])
        assert counters["kv_write_back_dropped_total"] == 1
        await eventually_async(lambda: not writer.sending, "the send given up", timeout_s=20)
        assert counters["kv_write_back_failed_total"] == 2
    finally:
        await pusher.close()
