"""Same-host KV pushes go through shared memory, over real gRPC between real processes: `kvcentric up` 1P+1D
moves all of a request's KV through a segment and decodes what one process does; a standalone messenger
gets the bytes intact; a peer that cannot open the segment is pushed to again inline, and from then on."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import grpc
import pytest

from conftest import stop
from harness import UpProcess
from kvcentric.core.block_pool import BlockPool
from kvcentric.core.protocol import SamplingParams
from kvcentric.engine.model.local import generate
from kvcentric.engine.model.runner import ModelRunner
from kvcentric.model.config import preset
from kvcentric.model.tokenizer import ByteTokenizer
from kvcentric.proto import kv_pb2, kv_pb2_grpc
from kvcentric.runtime.shm import SegmentPool
from kvcentric.runtime.transfer import KVPusher, checksum
from kvcentric.tools.processes import free_port, wait_for_port


def complete(url: str, body: dict) -> dict:
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.load(response)


def test_a_disaggregated_request_moves_its_kv_through_shared_memory(tmp_path):
    prompt, max_tokens = "layers through a shared memory segment, not the loopback", 8
    up = UpProcess(str(tmp_path), "--model", "tiny")
    try:
        before = up.health("decode-0")["stats"].get("shm_bytes_received", 0)
        body = complete(up.url, {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                 "ignore_eos": True})
        decode = up.health("decode-0")["stats"]
        prefill = up.health("prefill-0")["stats"]
    finally:
        up.stop()
    runner = ModelRunner(preset("tiny"), 64, 16, 0)
    token_ids = ByteTokenizer().encode(prompt)
    pool = BlockPool(runner.num_blocks, runner.block_size)
    expected = generate(runner, pool, token_ids, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                               ignore_eos=True))[0]
    assert body["choices"][0]["text"] == ByteTokenizer().decode(expected)
    config = preset("tiny")
    kv_bytes = config.num_layers * len(token_ids) * 2 * config.num_kv_heads * config.head_dim * 4
    assert decode["shm_bytes_received"] - before == kv_bytes == decode["bytes_received"]
    assert prefill["push_shm_bytes_sent"] == kv_bytes


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


def layers_of(request_id: str, layers: int = 4, tokens: int = 6):
    """make_chunks for push_with_retry: a header, `layers` distinct layers, a commit."""
    def make(attempt: int):
        async def generate():
            yield kv_pb2.KVHeader(request_id=request_id, num_layers=layers, num_tokens=tokens, num_kv_heads=2,
                                  head_dim=4, dtype="float32")
            for layer in range(layers):
                key, value = bytes(range(layer, layer + tokens * 32)), bytes([layer + 7]) * tokens * 32
                yield kv_pb2.KVChunk(layer=kv_pb2.LayerChunk(layer=layer, token_start=0, token_end=tokens, key=key,
                                                             value=value, checksum=checksum(key, value)))
            yield kv_pb2.KVCommit(first_token=5, total_bytes=layers * tokens * 64)
        return generate()
    return make


async def pulled(addr: str, request_id: str) -> list:
    async with grpc.aio.insecure_channel(addr) as channel:
        stub = kv_pb2_grpc.KVTransferStub(channel)
        chunks = [c async for c in stub.PullKV(kv_pb2.PullRequest(request_id=request_id, wait_s=1.0))]
    return [c.layer for c in chunks[1:-1]]


class UnreachableSegments(SegmentPool):
    """Segments whose names are gone before the receiver looks (as from another host's /dev/shm)."""

    def acquire(self, nbytes: int):
        segment = super().acquire(nbytes)
        segment.unlink()
        return segment


async def test_a_standalone_messenger_gets_shared_memory_pushes_byte_for_byte(messenger):
    pusher = KVPusher()
    try:
        assert await pusher.push_with_retry(messenger, layers_of("shm")) == 4 * 6 * 64
        layers = await pulled(messenger, "shm")
    finally:
        await pusher.close()
    assert pusher.stats["shm_bytes_sent"] == 4 * 6 * 64 and not pusher.inline_peers
    assert [(x.layer, x.key, x.value) for x in layers] == \
        [(n, bytes(range(n, n + 192)), bytes([n + 7]) * 192) for n in range(4)]


async def test_a_peer_that_cannot_open_the_segment_is_pushed_to_inline(messenger):
    pusher = KVPusher()
    pusher.segments = UnreachableSegments()
    try:
        assert await pusher.push_with_retry(messenger, layers_of("fallback")) == 4 * 6 * 64
        sent_through_shm = pusher.stats["shm_bytes_sent"]
        assert await pusher.push_with_retry(messenger, layers_of("after")) == 4 * 6 * 64
        layers = await pulled(messenger, "fallback") + await pulled(messenger, "after")
    finally:
        await pusher.close()
    assert pusher.inline_peers == {messenger} and pusher.stats["retries"] == 1
    assert pusher.stats["shm_bytes_sent"] == sent_through_shm  # the second push went inline from the start
    assert [(x.layer, x.value) for x in layers] == [(n, bytes([n + 7]) * 192) for n in list(range(4)) * 2]
