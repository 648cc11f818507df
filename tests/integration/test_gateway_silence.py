"""The gateway times requests out for silence, not for length (issue 48), on a real NATS bus with a stand-in
conductor and engines (plain NATS subscribers, as in test_gateway_errors.py) and a gateway whose
--request-timeout-s is 1 s: a stream whose tokens keep coming runs several times that long and completes; a request
queued within its predicted first-token time is not cut; a stream that waits gets its status, headers and SSE
keep-alive comments before its first token; one that goes silent still ends with a 504."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import msgspec
import nats
import pytest

from conftest import start_server, stop
from harness import spawn_service as spawn
from kvcentric.core.protocol import (Cancel, Placement, PrefillJob, ScheduleRequest, SubmitAck, Subjects, TokenChunk,
                                     decode, encode)
from kvcentric.tools.processes import free_port, nats_server_argv

SILENCE_S = 1.0
KEEPALIVE_S = 0.3
BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 64}


@pytest.fixture(scope="module")
def bus():
    """A NATS server of its own and a gateway that cuts a request after 1 s without progress."""
    port = free_port()
    server = start_server(nats_server_argv(port), port)
    url = f"nats://127.0.0.1:{port}"
    gateway, gateway_port = spawn("gateway", url, "--request-timeout-s", str(SILENCE_S), "--keepalive-s",
                                  str(KEEPALIVE_S), "--bus-timeout-s", "1", "--dispatch", "gateway",
                                  "--silent-after-s", "60")  # the stand-ins send no load reports: never migrate
    try:
        yield url, f"http://127.0.0.1:{gateway_port}"
    finally:
        stop(gateway)
        stop(server)


@pytest.fixture
async def nc(bus):
    client = await nats.connect(bus[0])
    try:
        yield client
    finally:
        await client.close()


class Engines:
    """A conductor that places every request with `predicted_ttft_s`, and engines that send one token every
    `gap_s` after waiting `first_s`, `tokens` in all (the last one finishing the request)."""

    def __init__(self, nc, predicted_ttft_s: float, first_s: float, gap_s: float, tokens: int) -> None:
        self.nc, self.first_s, self.gap_s, self.tokens = nc, first_s, gap_s, tokens
        self.placed = Placement(request_id="", prefill_id="p", decode_id="d", decode_kv_addr="127.0.0.1:1",
                                predicted_ttft_s=predicted_ttft_s, ttft_slo_s=10.0, tbt_slo_s=0.5)
        self.cancels: list[Cancel] = []
        self.subscriptions: list = []
        self.sending: set[asyncio.Task] = set()

    async def __aenter__(self) -> Engines:
        for subject, callback in ((Subjects.SCHEDULE, self.schedule), (Subjects.submit("decode", "d"), self.ack),
                                  (Subjects.submit("prefill", "p"), self.submit_prefill),
                                  (Subjects.CANCEL_ALL, self.cancel)):
            self.subscriptions.append(await self.nc.subscribe(subject, cb=callback))
        await self.nc.flush()
        return self

    async def __aexit__(self, *exc) -> None:
        for subscription in self.subscriptions:
            await subscription.unsubscribe()
        for task in self.sending:
            task.cancel()

    async def schedule(self, msg) -> None:
        await msg.respond(encode(msgspec.structs.replace(self.placed,
                                                         request_id=decode(msg.data, ScheduleRequest).request_id)))

    async def ack(self, msg) -> None:
        await msg.respond(encode(SubmitAck.accepted()))

    async def submit_prefill(self, msg) -> None:
        await msg.respond(encode(SubmitAck.accepted()))
        task = asyncio.create_task(self.send(decode(msg.data, PrefillJob).request_id))
        self.sending.add(task)

    async def send(self, request_id: str) -> None:
        await asyncio.sleep(self.first_s)
        for seq in range(self.tokens):
            last = seq == self.tokens - 1
            chunk = TokenChunk(request_id=request_id, seq=seq, token_ids=[104],
                               finish_reason="length" if last else None, prompt_tokens=5, completion_tokens=seq + 1)
            await self.nc.publish(Subjects.out(request_id), encode(chunk))
            await asyncio.sleep(self.gap_s)

    async def cancel(self, msg) -> None:
        self.cancels.append(decode(msg.data, Cancel))


async def post(url: str, body: dict) -> tuple[int, dict, str, float]:
    started = time.monotonic()
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/completions", json=body) as response:
            return response.status, dict(response.headers), await response.text(), time.monotonic() - started


async def test_a_stream_whose_tokens_keep_coming_outlives_the_timeout_and_completes(bus, nc):
    async with Engines(nc, predicted_ttft_s=0.1, first_s=0.1, gap_s=0.1, tokens=40):  # about 4 s, 4x the timeout
        status, headers, text, took = await post(bus[1], {**BODY, "stream": True})
    assert status == 200 and took > 3 * SILENCE_S, (status, took, text[-300:])
    assert text.rstrip().endswith("data: [DONE]") and '"error"' not in text
    assert headers["x-kvcentric-ttft-slo-s"] == "10.000000" and headers["x-kvcentric-tbt-slo-s"] == "0.500000"
    async with aiohttp.ClientSession() as session:
        async with session.get(bus[1] + "/health") as response:
            health = await response.json()
    assert health["slos_last_placed"] == {"ttft_s": 10.0, "tbt_s": 0.5}  # the SLOs the conductor placed it under


async def test_a_request_queued_within_its_predicted_time_is_not_cut(bus, nc):
    async with Engines(nc, predicted_ttft_s=2.0, first_s=2.5, gap_s=0.01, tokens=3):  # first token at 2.5 s
        status, _, text, took = await post(bus[1], BODY)
    assert status == 200 and took > 2.5 and json.loads(text)["usage"]["completion_tokens"] == 3, text


async def test_a_waiting_stream_starts_with_its_headers_and_keep_alive_comments(bus, nc):
    async with Engines(nc, predicted_ttft_s=1.5, first_s=1.5, gap_s=0.01, tokens=2):
        async with aiohttp.ClientSession() as session:
            async with session.post(bus[1] + "/v1/completions", json={**BODY, "stream": True}) as response:
                first = await asyncio.wait_for(response.content.readline(), 1.0)  # long before the first token
                assert response.status == 200 and response.headers["Content-Type"] == "text/event-stream"
                rest = (await response.text()).splitlines()
    assert first == b": keep-alive\n"
    events = [line for line in rest if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) == 3, rest


async def test_a_request_that_goes_silent_is_still_cut_with_a_504(bus, nc):
    async with Engines(nc, predicted_ttft_s=0.2, first_s=0.1, gap_s=5.0, tokens=2) as engines:  # then silence
        status, _, text, took = await post(bus[1], BODY)
        await asyncio.sleep(0.2)
    error = json.loads(text)["error"]
    assert status == 504 and "--request-timeout-s" in error["message"] and error["type"] == "timeout"
    assert SILENCE_S <= took < SILENCE_S + 2.0 and len(engines.cancels) == 1
