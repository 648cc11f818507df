"""Failure paths on real servers: no engines, bad bus messages, client disconnects, an unreachable decode."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import nats
import pytest

from conftest import start_server, stop
from harness import spawn_service
from kvcentric.tools.processes import free_port, nats_server_argv
from waiting import eventually_async, read_until_async
from kvcentric.core.protocol import (InstancesQuery, InstancesReply, PrefillJob, Rejection, SamplingParams,
                                     ScheduleReply, SubmitAck, Subjects, TokenChunk, decode, encode)


@pytest.fixture
def bare_bus():
    """A NATS server of its own with only a conductor and a gateway: no engines at all."""
    port = free_port()
    server = start_server(nats_server_argv(port), port)
    url = f"nats://127.0.0.1:{port}"
    conductor, conductor_port = spawn_service("conductor", url)
    gateway, gateway_port = spawn_service("gateway", url)
    try:
        yield url, f"http://127.0.0.1:{gateway_port}", f"http://127.0.0.1:{conductor_port}"
    finally:
        for process in (gateway, conductor, server):
            stop(process)


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def test_no_engine_alive_is_503_with_an_error_object(bare_bus):
    _, gateway, _ = bare_bus
    status, body = post(gateway, {"prompt": "hello", "max_tokens": 2})
    assert status == 503
    assert "no prefill and decode instance" in body["error"]["message"]


async def test_bad_bus_messages_are_answered_or_dropped_and_counted(bare_bus):
    url, _, conductor = bare_bus
    nc = await nats.connect(url)
    try:
        reply = await nc.request(Subjects.SCHEDULE, b"\x93garbage", timeout=2)
        rejection = decode(reply.data, ScheduleReply)
        assert isinstance(rejection, Rejection) and rejection.reason == "bad_request"
        await nc.publish("kvc.load.prefill.x", b"not a load report")
        await nc.flush()
        reply = await nc.request(Subjects.INSTANCES, encode(InstancesQuery()), timeout=2)
        assert decode(reply.data, InstancesReply).instances == []  # the conductor is still serving
    finally:
        await nc.close()
    with urllib.request.urlopen(conductor + "/metrics") as response:
        metrics = response.read().decode()
    drops = [line for line in metrics.splitlines() if line.startswith("kvc_bus_drops_total")]
    assert drops and float(drops[0].split()[-1]) == 2


async def test_client_disconnect_cancels_and_frees_kv_on_decode(cluster):
    reader, writer = await asyncio.open_connection("127.0.0.1", cluster.port)
    body = json.dumps({"prompt": "cancel me", "max_tokens": 1500, "temperature": 0, "ignore_eos": True,
                       "stream": True}).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    await writer.drain()
    await read_until_async(reader, b"data: ", "the first event of the stream")
    writer.close()  # the client goes away mid-stream
    stats = await eventually_async(lambda: cluster.health("decode-0")["stats"], "the request aborted and its KV freed",
                                   until=lambda stats: stats["kv_blocks_free"] == stats["kv_blocks_total"]
                                   and stats["requests_aborted"] >= 1, every_s=0.1)
    assert stats["requests_aborted"] >= 1
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


async def test_prefill_to_an_unreachable_decode_fails_the_request_cleanly(cluster, nats_url):
    nc = await nats.connect(nats_url)
    try:
        request_id = "unreachable-decode"
        outputs = await nc.subscribe(Subjects.out(request_id))
        dead_addr = f"127.0.0.1:{free_port()}"
        job = PrefillJob(request_id=request_id, token_ids=[256, 1, 2, 3], sampling=SamplingParams(max_tokens=2),
                         decode_id="decode-x", decode_kv_addr=dead_addr)
        ack = decode((await nc.request(Subjects.submit("prefill", "prefill-0"), encode(job), timeout=5)).data,
                     SubmitAck)
        assert ack.ok
        chunk = decode((await outputs.next_msg(timeout=30)).data, TokenChunk)
        assert chunk.finish_reason == "error" and dead_addr in chunk.error
    finally:
        await nc.close()
    stats = cluster.health("prefill-0")["stats"]
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]  # nothing pinned (cached blocks are free)
