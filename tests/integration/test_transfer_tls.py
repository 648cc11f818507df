"""The KV transfer and the prefill stages' hand-off over mutual TLS, on real gRPC servers on free loopback ports:
blocks put and layers pushed (inline and through shared memory) with the deployment's certificates arrive; a
client without a certificate, with one of a foreign CA, or a server whose certificate lacks the name peers check,
gets nothing through and the sink sees nothing."""

from __future__ import annotations

import datetime

import pytest

from kvcentric.engine.kv.kvpool import HostBlockPool
from kvcentric.engine.service.pipeline import StageClient, stage_handler
from kvcentric.proto import kv_pb2
from kvcentric.runtime.kvwire import LayerData
from kvcentric.runtime.security import TransferTls
from kvcentric.runtime.transfer import KVPusher, KVTransferServicer, TransferError, checksum, put_blocks, start_server
from kvcentric.tools import certs

pytestmark = pytest.mark.integration

NOW = datetime.datetime.now(datetime.UTC)
BLOCK_BYTES = 64


def tls_of(ca: certs.Issued, name: str, hosts=("127.0.0.1", "kvcentric-kv")) -> TransferTls:
    issued = certs.issue(ca, name, list(hosts), NOW)
    return TransferTls(ca.cert_pem, issued.cert_pem, issued.key_pem)


DEPLOYMENT = certs.new_ca("deployment", NOW)
FOREIGN = certs.new_ca("someone else", NOW)


class CountingSink:
    copies_bytes = False

    def __init__(self) -> None:
        self.layers, self.commits = 0, 0

    async def begin(self, header) -> None: ...
    def write(self, request_id, chunk) -> None:
        self.layers += 1
    def commit(self, request_id, commit) -> None:
        self.commits += 1
    def abort(self, request_id, reason, retryable=False) -> None: ...


async def serve(tls: TransferTls, more=()):
    sink, pool = CountingSink(), HostBlockPool(8, BLOCK_BYTES)
    servicer = KVTransferServicer(sink, pool=pool)
    server, port = await start_server(servicer, "127.0.0.1", 0, more, tls=tls)
    return server, servicer, sink, f"127.0.0.1:{port}"


async def layers(request_id: str, count: int = 2):
    yield kv_pb2.KVHeader(request_id=request_id, num_layers=count, num_tokens=1, num_kv_heads=1, head_dim=8,
                          dtype="float32", token_ids=[1])
    for index in range(count):
        data = bytes([index]) * 32
        yield LayerData(index, 0, 1, data, data, checksum(data, data))
    yield kv_pb2.KVCommit(first_token=0, total_bytes=count * 64)


@pytest.mark.parametrize("shared_memory", [False, True], ids=["inline", "shared-memory"])
async def test_a_push_and_a_put_with_the_deployments_certificates_arrive(shared_memory):
    server, servicer, sink, addr = await serve(tls_of(DEPLOYMENT, "decode"))
    pusher = KVPusher(shared_memory=shared_memory, tls=tls_of(DEPLOYMENT, "prefill"))
    try:
        assert await pusher.push(addr, layers("r1")) == 128
        assert await put_blocks(pusher, addr, [("hash-1", 0, b"\x07" * BLOCK_BYTES)]) == BLOCK_BYTES
    finally:
        await pusher.close()
        await server.stop(None)
    assert (sink.layers, sink.commits, servicer.stats["blocks_put"]) == (2, 1, 1)
    assert servicer.stats["shm_bytes_received"] == (128 + BLOCK_BYTES if shared_memory else 0)  # layers, block


@pytest.mark.parametrize("client", ["no certificate", "a foreign CA's certificate"])
async def test_a_client_without_a_certificate_of_the_deployment_gets_nothing_through(client):
    server, servicer, sink, addr = await serve(tls_of(DEPLOYMENT, "decode"))
    pusher = KVPusher(shared_memory=False, tls=None if client == "no certificate" else tls_of(FOREIGN, "intruder"))
    try:
        with pytest.raises(TransferError, match="UNAVAILABLE"):
            await pusher.push(addr, layers("intruder"), timeout_s=5.0)
        with pytest.raises(TransferError, match="UNAVAILABLE"):
            await put_blocks(pusher, addr, [("hash-x", 0, b"\x00" * BLOCK_BYTES)], timeout_s=5.0)
    finally:
        await pusher.close()
        await server.stop(None)
    assert (sink.layers, sink.commits, servicer.stats["blocks_put"]) == (0, 0, 0)


async def test_a_server_whose_certificate_lacks_the_checked_name_is_not_trusted():
    server, _, sink, addr = await serve(tls_of(DEPLOYMENT, "decode", hosts=("127.0.0.1",)))
    pusher = KVPusher(shared_memory=False, tls=tls_of(DEPLOYMENT, "prefill"))
    try:
        with pytest.raises(TransferError, match="UNAVAILABLE"):
            await pusher.push(addr, layers("r2"), timeout_s=5.0)
    finally:
        await pusher.close()
        await server.stop(None)
    assert sink.layers == 0


async def test_a_prefill_stage_hands_its_hidden_states_on_over_mutual_tls_only():
    received: list[kv_pb2.HiddenChunk] = []

    async def on_chunk(chunk: kv_pb2.HiddenChunk) -> None:
        received.append(chunk)
    server, _, _, addr = await serve(tls_of(DEPLOYMENT, "stage-1"), [stage_handler(on_chunk)])
    member, stranger = StageClient(tls_of(DEPLOYMENT, "stage-0")), StageClient()
    chunk = kv_pb2.HiddenChunk(request_id="r3", token_start=0, token_end=1, dtype="float32", hidden=b"\x01" * 16,
                               checksum=checksum(b"\x01" * 16))
    try:
        await member.send(addr, chunk, timeout_s=5.0)
        with pytest.raises(ConnectionError, match="UNAVAILABLE"):
            await stranger.send(addr, chunk, timeout_s=5.0)
    finally:
        await member.close()
        await stranger.close()
        await server.stop(None)
    assert [c.request_id for c in received] == ["r3"]
