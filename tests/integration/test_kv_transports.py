"""The KV transport of each link (`--kv-transport`), over real gRPC servers and real `kvcentric up` clusters:
1P+1D on one host over shm and over grpc decode what one process does, the decode computing no prompt and its
cache all free afterwards, and /health says which transport each link took; a prefill killed with SIGKILL
mid-push leaves no shared-memory segment behind and its request still ends; `auto` chooses from what the peer
advertises (another host without Mooncake: grpc); Mooncake's Transfer Engine over TCP carries a push byte for
byte, refuses a corrupt layer by its checksum, and pushes inline when its registered memory is full."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from harness import UpProcess
from kvcentric.core.block_pool import BlockPool
from kvcentric.core.kvlinks import Endpoint
from kvcentric.core.protocol import SamplingParams
from kvcentric.engine.model.local import generate
from kvcentric.engine.model.runner import ModelRunner
from kvcentric.model.config import preset
from kvcentric.model.tokenizer import ByteTokenizer
from kvcentric.proto import kv_pb2
from kvcentric.runtime import mooncake
from kvcentric.runtime.kvwire import LayerData
from kvcentric.runtime.shm import segment_prefix
from kvcentric.runtime.transfer import KVPusher, KVTransferServicer, TransferError, checksum, start_server
from test_migration import Stream
from test_same_host_kv import complete
from waiting import eventually

pytestmark = pytest.mark.integration

MOONCAKE_MISSING = mooncake.available()


def segments_of(pid: int) -> list[str]:
    return glob.glob(f"/dev/shm/{segment_prefix(pid)}*")


@pytest.mark.parametrize("transport", ["shm", "grpc"])
def test_1p1d_on_one_host_decodes_what_one_process_does_over_each_transport(tmp_path, transport):
    prompt, max_tokens = "the same tokens whichever way the KV went", 8
    up = UpProcess(str(tmp_path), "--model", "tiny", "--kv-transport", transport, "--restart", "never")
    try:
        body = complete(up.url, {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                 "ignore_eos": True})
        decode = eventually(lambda: up.health("decode-0")["stats"], "the decode's cache all free again",
                            until=lambda s: s["kv_blocks_free"] == s["kv_blocks_total"])
        prefill, decode_health = up.health("prefill-0"), up.health("decode-0")
    finally:
        up.stop()
    runner = ModelRunner(preset("tiny"), 64, 16, 0)
    token_ids = ByteTokenizer().encode(prompt)
    expected = generate(runner, BlockPool(runner.num_blocks, runner.block_size), token_ids,
                        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))[0]
    assert body["choices"][0]["text"] == ByteTokenizer().decode(expected)
    config = preset("tiny")
    kv_bytes = config.num_layers * len(token_ids) * 2 * config.num_kv_heads * config.head_dim * 4
    assert decode["bytes_received"] == kv_bytes  # the whole prompt's KV arrived: the decode computed none of it
    assert decode.get("shm_bytes_received", 0) == (kv_bytes if transport == "shm" else 0)
    assert prefill["kv_transport"] == transport and prefill["host_id"] == decode_health["host_id"] != ""
    assert [link["transport"] for link in prefill["kv_links"].values()] == [transport]
    assert prefill["stats"][f"push_links_{transport}"] == 1


def test_a_prefill_killed_mid_push_over_shm_leaks_no_segment_and_its_request_ends(tmp_path):
    """A long prompt of the small model in 8-token chunks keeps the push (and its segment) open for seconds; the
    prefill is killed once its segment exists and before the first token, i.e. mid-transfer."""
    up = UpProcess(str(tmp_path), "--model", "small", "--kv-transport", "shm", "--prefill-chunk", "8",
                   timeout_s=240.0)
    try:
        pid = up.manifest["services"]["prefill-0"]["pid"]
        body = {"prompt": [3 + (i * 11) % 250 for i in range(3000)], "max_tokens": 4, "temperature": 0,
                "ignore_eos": True}
        opened: list[Stream] = []
        first_events: list[dict] = []

        def open_and_read_one() -> None:
            """The stream opens once the request is placed; its first event comes with the first token."""
            opened.append(Stream(up.port, body))
            first_events.extend(event for _, event in zip(range(1), opened[0].events()))
        opener = threading.Thread(target=open_and_read_one)
        opener.start()
        eventually(lambda: segments_of(pid), "the prefill's push segment", timeout_s=60, every_s=0.01)
        os.kill(pid, signal.SIGKILL)
        assert not first_events, "the first token came before the kill: the push was not cut mid-transfer"
        eventually(lambda: not segments_of(pid), "the killed prefill's segments unlinked", timeout_s=15)
        opener.join(120)
        stream = opened[0].finish()
        ended_well = not stream.errors and stream.usage["completion_tokens"] == 4
        assert ended_well or stream.errors[0]["type"] == "service_unavailable", stream.errors
        eventually(lambda: up.health("decode-0").get("stats"), "the decode's cache all free again", timeout_s=60,
                   until=lambda s: s and s["kv_blocks_free"] == s["kv_blocks_total"], ignoring=(OSError, KeyError))
        pids = up.pids()
    finally:
        up.stop()
    assert not [name for p in pids for name in segments_of(p)]


class Sink:
    """A receiver's sink that keeps each layer's bytes."""

    copies_bytes = True

    def __init__(self) -> None:
        self.layers: dict[int, tuple[bytes, bytes]] = {}
        self.first_token = None

    async def begin(self, header) -> None:
        self.layers.clear()

    def write(self, request_id: str, chunk) -> None:
        self.layers[chunk.layer] = (bytes(chunk.key), bytes(chunk.value))

    def commit(self, request_id: str, commit) -> None:
        self.first_token = commit.first_token

    def abort(self, request_id: str, reason: str, retryable: bool = False) -> None:
        pass


def layers(corrupt: int | None = None):
    """make_chunks: 3 layers of 4 tokens x 2 heads x 4 floats, layer `corrupt` with a wrong checksum."""
    def make(attempt: int):
        async def chunks():
            yield kv_pb2.KVHeader(request_id="r", num_layers=3, num_tokens=4, num_kv_heads=2, head_dim=4,
                                  dtype="float32")
            for layer in range(3):
                key, value = bytes([layer]) * 128, bytes([layer + 9]) * 128
                yield LayerData(layer, 0, 4, key, value, checksum(key, value) + (layer == corrupt and attempt == 0))
            yield kv_pb2.KVCommit(first_token=7)
        return chunks()
    return make


EXPECTED = {layer: (bytes([layer]) * 128, bytes([layer + 9]) * 128) for layer in range(3)}


async def test_auto_pushes_over_grpc_to_a_peer_that_advertises_another_host_without_mooncake():
    sink = Sink()
    servicer = KVTransferServicer(sink)
    servicer.endpoint = Endpoint("another-boot@another-host", (), ("grpc", "shm"))
    server, port = await start_server(servicer, "127.0.0.1", 0)
    pusher = KVPusher()
    try:
        assert await pusher.push_with_retry(f"127.0.0.1:{port}", layers()) == 768
    finally:
        await pusher.close()
        await server.stop(0)
    assert pusher.links[f"127.0.0.1:{port}"].transport == "grpc" and sink.layers == EXPECTED
    assert servicer.stats["shm_bytes_received"] == 0 and pusher.stats["links_grpc"] == 1


@pytest.fixture
async def mooncake_pair():
    if MOONCAKE_MISSING:
        pytest.skip(f"Mooncake's Transfer Engine is not usable here ({MOONCAKE_MISSING}); "
                    "install the [mooncake] extra and libibverbs1")
    sending, receiving = mooncake.open_mooncake("127.0.0.1", 1 << 20), mooncake.open_mooncake("127.0.0.1", 1 << 20)
    assert sending and receiving, "the Transfer Engine imports but does not start over TCP on loopback"
    sink = Sink()
    servicer = KVTransferServicer(sink, mooncake=receiving[1])
    server, port = await start_server(servicer, "127.0.0.1", 0)
    pusher = KVPusher(transport="mooncake", mooncake=sending[0])
    try:
        yield pusher, servicer, sink, f"127.0.0.1:{port}"
    finally:
        await pusher.close()
        await server.stop(0)
        receiving[1].close()


async def test_mooncake_over_tcp_carries_a_push_byte_for_byte_to_a_peer_on_another_host(mooncake_pair):
    pusher, servicer, sink, addr = mooncake_pair
    servicer.endpoint = Endpoint("another-boot@another-host", (), ("grpc", "shm", "mooncake"))
    pusher.transport = "auto"
    assert await pusher.push_with_retry(addr, layers()) == 768
    assert pusher.links[addr].transport == "mooncake" and sink.layers == EXPECTED and sink.first_token == 7
    assert servicer.stats["mooncake_bytes_received"] == 768 == pusher.stats["mooncake_bytes_sent"]
    assert pusher.mooncake.region.free == [(0, 1 << 20)]  # every place given back once acknowledged


async def test_a_corrupt_layer_read_over_mooncake_is_refused_by_its_checksum_and_sent_again(mooncake_pair):
    pusher, servicer, sink, addr = mooncake_pair
    assert await pusher.push_with_retry(addr, layers(corrupt=1)) == 768
    assert servicer.stats["checksum_failures"] == 1 and pusher.stats["retries"] == 1 and sink.layers == EXPECTED
    with pytest.raises(TransferError, match="checksum"):
        await pusher.push_with_retry(addr, layers(corrupt=1), retries=0)


async def test_a_push_that_finds_no_room_in_the_registered_memory_goes_inline(mooncake_pair):
    pusher, servicer, sink, addr = mooncake_pair
    taken = pusher.mooncake.region.take((1 << 20) - 100)
    assert await pusher.push_with_retry(addr, layers()) == 768
    pusher.mooncake.region.give(taken, (1 << 20) - 100)
    assert sink.layers == EXPECTED and pusher.stats["mooncake_no_room"] == 1
    assert servicer.stats.get("mooncake_bytes_received", 0) == 0


def test_the_killed_process_check_sees_a_segment_made_here():
    """`segments_of` finds what `SegmentPool` makes (so the leak check above cannot pass vacuously)."""
    from kvcentric.runtime.shm import SegmentPool
    pool = SegmentPool()
    segment = pool.acquire(1)
    try:
        assert segments_of(os.getpid()) == [f"/dev/shm/{segment.name}"]
    finally:
        pool.release(segment)
        pool.close()
    assert segments_of(os.getpid()) == []


@pytest.mark.parametrize("delay_s", [0.0, 0.002, 0.02, 0.2])
def test_a_process_killed_while_it_makes_its_segment_leaves_none(delay_s):
    """Killed right as the segment's name shows in /dev/shm (before SharedMemory has told the resource tracker of
    it, where the name is not registered first) or a little after: nothing stays behind."""
    code = ("import time; from kvcentric.runtime.shm import SegmentPool; "
            "SegmentPool().acquire(64 << 20); time.sleep(60)")
    process = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.DEVNULL)
    try:
        eventually(lambda: segments_of(process.pid), "the segment made", timeout_s=30, every_s=0.001)
        time.sleep(delay_s)
    finally:
        process.kill()
        process.wait()
    eventually(lambda: not segments_of(process.pid), "the killed process's segment unlinked", timeout_s=10)
