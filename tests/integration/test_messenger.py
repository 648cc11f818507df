"""The standalone messenger over real gRPC: push a request's KV, pull it back, read its stats."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest

from conftest import stop
from kvcentric.tools.processes import free_port, wait_for_port
from kvcentric.proto import kv_pb2, kv_pb2_grpc
from kvcentric.runtime.transfer import KVPusher, TransferError, checksum


@pytest.fixture
def messenger(nats_url):
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "kvcentric", "messenger", "--nats-url", nats_url,
                                "--kv-port", str(port), "--capacity-mb", "4"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_port("127.0.0.1", port, 30)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        stop(process)


def chunks(request_id: str, layers: int = 3, tokens: int = 5, corrupt: bool = False):
    async def generate():
        yield kv_pb2.KVChunk(header=kv_pb2.KVHeader(request_id=request_id, num_layers=layers, num_tokens=tokens,
                                                    num_kv_heads=2, head_dim=4, dtype="float32"))
        for layer in range(layers):
            key, value = bytes([layer]) * tokens * 32, bytes([layer + 1]) * tokens * 32
            crc = checksum(key, value) ^ (1 if corrupt else 0)
            yield kv_pb2.KVChunk(layer=kv_pb2.LayerChunk(layer=layer, token_start=0, token_end=tokens, key=key,
                                                         value=value, checksum=crc))
        yield kv_pb2.KVChunk(commit=kv_pb2.KVCommit(first_token=42, total_bytes=layers * tokens * 64))
    return generate()


async def test_pushed_kv_can_be_pulled_back_byte_for_byte(messenger):
    pusher = KVPusher()
    try:
        assert await pusher.push(messenger, chunks("r1")) == 3 * 5 * 64
        async with grpc.aio.insecure_channel(messenger) as channel:
            stub = kv_pb2_grpc.KVTransferStub(channel)
            pulled = [c async for c in stub.PullKV(kv_pb2.PullRequest(request_id="r1", wait_s=1.0))]
            stats = await stub.Stats(kv_pb2.StatsRequest())
    finally:
        await pusher.close()
    assert pulled[0].header.request_id == "r1" and pulled[-1].commit.first_token == 42
    layers = [c.layer for c in pulled[1:-1]]
    assert [layer.layer for layer in layers] == [0, 1, 2]
    assert all(layer.key == bytes([layer.layer]) * 160 for layer in layers)
    assert stats.bytes_received == 3 * 5 * 64 and stats.streams_sent == 1 and stats.stored_requests == 1


async def test_a_corrupted_layer_is_refused_and_nothing_is_kept(messenger):
    pusher = KVPusher()
    try:
        with pytest.raises(TransferError, match="checksum"):
            await pusher.push(messenger, chunks("bad", corrupt=True))
        async with grpc.aio.insecure_channel(messenger) as channel:
            stub = kv_pb2_grpc.KVTransferStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                [c async for c in stub.PullKV(kv_pb2.PullRequest(request_id="bad", wait_s=0.2))]
            assert caught.value.code() == grpc.StatusCode.NOT_FOUND
            stats = await stub.Stats(kv_pb2.StatsRequest())
            assert stats.checksum_failures == 1
    finally:
        await pusher.close()
