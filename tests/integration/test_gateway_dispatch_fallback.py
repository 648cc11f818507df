"""When the conductor cannot dispatch, the gateway (default `--dispatch conductor`) sends the jobs itself: a
conductor from before dispatching answers a placement without `dispatched`, and a prompt whose schedule
request with the tokens would pass NATS's max_payload goes without them. A prompt too large for the bus
at all is a 400. Real nats-server (max_payload 6000 bytes here) and gateway; the conductor and engines are
NATS subscribers that record what reaches them."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import nats
import pytest

from conftest import start_server, stop
from kvcentric.core.hashing import BlockHasher, to_hex
from kvcentric.tools.processes import free_port, nats_server_argv
from harness import spawn_service as spawn
from kvcentric.core.protocol import (Cancel, Dispatch, Placement, PrefillJob, SamplingParams, ScheduleRequest,
                                SubmitAck, Subjects, TokenChunk, decode, encode)
from waiting import eventually_async

MAX_PAYLOAD = 6000
SLOW_PROMPT_TOKENS, SLOW_CONDUCTOR_S = 7, 1.0
"""The stand-in conductor answers a 7-token prompt after 1 s."""
# What a conductor that predates dispatching answers:
PLACED = Placement(request_id="", prefill_id="p", decode_id="d", decode_kv_addr="127.0.0.1:1")


@pytest.fixture(scope="module")
def bus(tmp_path_factory):
    config = tmp_path_factory.mktemp("nats") / "nats.conf"
    config.write_text(f"max_payload: {MAX_PAYLOAD}\n")
    port = free_port()
    server = start_server([*nats_server_argv(port), "-c", str(config)], port)
    url = f"nats://127.0.0.1:{port}"
    gateway, gateway_port = spawn("gateway", url, "--request-timeout-s", "5", "--bus-timeout-s", "2")
    try:
        yield url, f"http://127.0.0.1:{gateway_port}"
    finally:
        stop(gateway)
        stop(server)


@pytest.fixture
async def recorded(bus):
    """Stand-ins on the bus: an old conductor, a prefill that sends the only token, a decode that acks."""
    nc = await nats.connect(bus[0])
    asked: list[ScheduleRequest] = []
    jobs: list[PrefillJob] = []

    async def schedule(msg):
        asked.append(decode(msg.data, ScheduleRequest))
        await asyncio.sleep(SLOW_CONDUCTOR_S if asked[-1].n_tokens == SLOW_PROMPT_TOKENS else 0)  # deliberately slow
        await msg.respond(encode(PLACED))

    async def prefill(msg):
        job = decode(msg.data, PrefillJob)
        jobs.append(job)
        await msg.respond(encode(SubmitAck.accepted()))
        last = TokenChunk.final(job.request_id, "length", seq=0, token_ids=[104], prompt_tokens=0, completion_tokens=1)
        await nc.publish(Subjects.out(job.request_id), encode(last))

    async def decode_submit(msg):
        await msg.respond(encode(SubmitAck.accepted()))

    for subject, callback in ((Subjects.SCHEDULE, schedule), (Subjects.submit("prefill", "p"), prefill),
                              (Subjects.submit("decode", "d"), decode_submit)):
        await nc.subscribe(subject, cb=callback)
    await nc.flush()
    try:
        yield asked, jobs
    finally:
        await nc.close()


async def post(url: str, prompt: list[int]) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}) as response:
            return response.status, json.loads(await response.text())


def schedule_bytes(prompt: list[int], with_tokens: bool) -> int:
    hashes = [to_hex(h) for h in BlockHasher().hash_blocks(prompt)]
    ask = ScheduleRequest(request_id="cmpl-" + "0" * 32, n_tokens=len(prompt), block_hashes=hashes, max_tokens=1,
                          dispatch=Dispatch(token_ids=prompt, sampling=SamplingParams(max_tokens=1))
                          if with_tokens else None)
    return len(encode(ask))


async def test_an_old_conductors_placement_gets_its_jobs_from_the_gateway(bus, recorded):
    asked, jobs = recorded
    status, body = await post(bus[1], [65, 66, 67, 68])
    assert status == 200 and body["choices"][0]["text"] == "h"
    assert asked[-1].dispatch is not None  # the gateway asked the conductor to dispatch...
    assert jobs[-1].token_ids == [65, 66, 67, 68]  # ...and, not told it did, sent the jobs itself


async def test_a_prompt_too_large_to_dispatch_goes_without_its_tokens(bus, recorded):
    asked, jobs = recorded
    prompt = [200 + i % 50 for i in range(1200)]  # two bytes a token in msgpack
    assert schedule_bytes(prompt, True) > MAX_PAYLOAD >= schedule_bytes(prompt, False)
    status, body = await post(bus[1], prompt)
    assert status == 200, body
    assert asked[-1].dispatch is None and len(jobs[-1].token_ids) == 1200


async def test_a_prompt_too_large_for_the_bus_is_a_400(bus, recorded):
    status, body = await post(bus[1], [200 + i % 50 for i in range(1800)])
    assert status == 400 and body["error"]["code"] == "request_too_large"
    assert "max_payload 6000" in body["error"]["message"]


async def test_a_client_gone_before_the_conductor_answers_is_cancelled_on_the_engines(bus, recorded):
    """The conductor may have sent the jobs already: the gateway cancels the request even without an answer."""
    asked, _ = recorded
    nc = await nats.connect(bus[0])
    cancels = []

    async def on_cancel(msg):
        cancels.append(decode(msg.data, Cancel))

    await nc.subscribe(Subjects.CANCEL_ALL, cb=on_cancel)
    await nc.flush()
    try:
        with pytest.raises(asyncio.TimeoutError):
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.3)) as session:
                await session.post(bus[1] + "/v1/completions", json={"prompt": [65] * SLOW_PROMPT_TOKENS,
                                                                     "max_tokens": 1})
        await eventually_async(lambda: cancels, "the gateway cancelled the request")
        assert [c.request_id for c in cancels] == [asked[-1].request_id] and asked[-1].dispatch is not None
    finally:
        await nc.close()
