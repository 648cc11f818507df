"""A run of failing, cancelled and successful requests leaves no KV block pinned anywhere and no pool over
its capacity (KV pushes striped over two connections, to exercise that path end to end)."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import nats
import pytest

from harness import UpProcess
from waiting import eventually_async, read_until_async

from kvcentric.tools.processes import free_port
from kvcentric.core.protocol import PrefillJob, SamplingParams, SubmitAck, Subjects, decode, encode


@pytest.fixture(scope="module")
def striped(tmp_path_factory):
    up = UpProcess(str(tmp_path_factory.mktemp("up-leaks")), "--num-kv-blocks", "96",
                   env={"KVC_KV_STRIPES": "2", "KVC_HOST_POOL_MB": "1"})
    try:
        yield up
    finally:
        up.stop()


def all_free(stats: dict) -> bool:
    return stats["kv_blocks_free"] == stats["kv_blocks_total"]


def post(url: str, body: dict) -> int:
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            response.read()
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


async def disconnect_mid_stream(port: int, prompt: str) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = json.dumps({"prompt": prompt, "max_tokens": 400, "ignore_eos": True, "stream": True}).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    await writer.drain()
    await read_until_async(reader, b"data: ", "the first event of the stream")
    writer.close()


async def prefill_to_nowhere(nats_url: str, request_id: str) -> None:
    nc = await nats.connect(nats_url)
    try:
        job = PrefillJob(request_id=request_id, token_ids=[256] + [7] * 40, sampling=SamplingParams(max_tokens=2),
                         decode_id="decode-x", decode_kv_addr=f"127.0.0.1:{free_port()}")
        reply = await nc.request(Subjects.submit("prefill", "prefill-0"), encode(job), timeout=5)
        assert decode(reply.data, SubmitAck).ok
    finally:
        await nc.close()


async def test_failing_and_cancelled_requests_leak_no_blocks(striped):
    loop = asyncio.get_running_loop()
    statuses = await asyncio.gather(
        *(loop.run_in_executor(None, post, striped.url, {"prompt": f"ok {i} " * 60, "max_tokens": 5})
          for i in range(4)),
        loop.run_in_executor(None, post, striped.url, {"prompt": "x" * 3000}),  # beyond the context: 400
        loop.run_in_executor(None, post, striped.url, {"prompt": "y" * 40, "max_tokens": "many"}),  # 400
        disconnect_mid_stream(striped.port, "cancel me " * 10),
        disconnect_mid_stream(striped.port, "and me " * 30),
        prefill_to_nowhere(striped.manifest["nats_url"], "nowhere-1"),
        prefill_to_nowhere(striped.manifest["nats_url"], "nowhere-2"),
    )
    assert statuses[:6] == [200, 200, 200, 200, 400, 400]
    decode_stats, prefill_stats = await eventually_async(
        lambda: (striped.health("decode-0")["stats"], striped.health("prefill-0")["stats"]),
        "every KV block free on decode and prefill", until=lambda both: all(all_free(stats) for stats in both),
        every_s=0.1)
    assert decode_stats["kv_blocks_free"] == decode_stats["kv_blocks_total"]
    assert prefill_stats["kv_blocks_free"] == prefill_stats["kv_blocks_total"]  # cached blocks count as free
    assert decode_stats["requests_aborted"] >= 2
    assert prefill_stats["host_blocks"] <= prefill_stats["host_blocks_capacity"]
    assert prefill_stats["host_blocks_evicted"] > 0  # the 1 MiB pool overflowed and evicted, as it should
    assert post(striped.url, {"prompt": "still serving", "max_tokens": 3}) == 200
