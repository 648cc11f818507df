"""PutBlocks over real gRPC (a messenger on a free loopback port): the blocks a decode instance writes back land
in the messenger's host pool, to be announced and found there; a corrupt block is refused with those before it
kept; a messenger without a pool, or none at all, refuses with a TransferError (the writer drops the blocks), and
the writer keeps a bounded number of bytes waiting for one."""

from __future__ import annotations

import collections

import pytest

from kvcentric.engine.kvpool import HostBlockPool
from kvcentric.engine import writeback
from kvcentric.engine.writeback import FilledBlock, WriteBack
from kvcentric.proto import kv_pb2
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


async def test_put_blocks_land_in_the_peers_host_pool_and_are_announced_there():
    pool = HostBlockPool(8, BLOCK_BYTES)
    server, servicer, addr = await messenger(pool)
    pusher = KVPusher()
    try:
        taken = await put_blocks(pusher, addr, [block(3), block(4)])
    finally:
        await pusher.close()
        await server.stop(None)
    assert taken == 2 * BLOCK_BYTES and servicer.stats["blocks_put"] == 2
    assert pool.read("hash-4") == bytes([4]) * BLOCK_BYTES
    assert pool.drain_events() == (["hash-3", "hash-4"], [])


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
