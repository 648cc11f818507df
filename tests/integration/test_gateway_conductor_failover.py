"""The gateway rides over a conductor that dies: when nobody answers kvc.conductor.schedule (a conductor
restarting) it asks again until --bus-timeout-s, and when the conductor that took the request goes silent
it cancels that request id and asks once more under a new id, whose tokens it then relays. It asks a replica
that heartbeats on its own subject, so a stopped replica (still subscribed) gets nothing. A stand-in conductor
and engines (plain NATS subscribers) play the other side on a real NATS server."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import nats
import pytest

from harness import spawn_service
from waiting import eventually_async

from kvcentric.core.protocol import (Cancel, ConductorAlive, Placement, PrefillJob, ScheduleRequest, SubmitAck,
                                     Subjects, TokenChunk, decode, encode)
from kvcentric.tools.processes import end

PLACED = Placement(request_id="", prefill_id="p", decode_id="d", decode_kv_addr="127.0.0.1:1", predicted_ttft_s=0.1)


class Cluster:
    """A conductor that stays silent on the first `silent` requests it gets, and engines that answer every job
    with two tokens; what reaches them is recorded."""

    def __init__(self, nc, silent: int = 0) -> None:
        self.nc, self.silent = nc, silent
        self.asked: list[str] = []
        self.cancelled: list[str] = []

    async def join(self) -> None:
        """Subscribe the conductor (in the queue group every conductor answers in) and the engines."""
        await self.nc.subscribe(Subjects.SCHEDULE, queue="conductor", cb=self.schedule)
        await self.nc.subscribe(Subjects.submit("prefill", "p"), cb=self.prefill)
        await self.nc.subscribe(Subjects.submit("decode", "d"), cb=self.ack)
        await self.nc.subscribe(Subjects.CANCEL_ALL, cb=self.cancel)
        await self.nc.flush()

    async def schedule(self, msg) -> None:
        self.asked.append(decode(msg.data, ScheduleRequest).request_id)
        if len(self.asked) > self.silent:
            await msg.respond(encode(PLACED))

    async def ack(self, msg) -> None:
        await msg.respond(encode(SubmitAck.accepted()))

    async def prefill(self, msg) -> None:
        await self.ack(msg)
        rid = decode(msg.data, PrefillJob).request_id
        await self.nc.publish(Subjects.out(rid), encode(TokenChunk.final(rid, "length", seq=0, token_ids=[72, 105],
                                                                         prompt_tokens=5, completion_tokens=2)))

    async def cancel(self, msg) -> None:
        self.cancelled.append(decode(msg.data, Cancel).request_id)


@pytest.fixture
def gateway(own_nats):
    process, port = spawn_service("gateway", own_nats, "--bus-timeout-s", "1.5", "--dispatch", "gateway")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        end(process)


@pytest.fixture
async def nc(own_nats):
    client = await nats.connect(own_nats)
    try:
        yield client
    finally:
        await client.close()


async def health(url: str) -> dict:
    async with aiohttp.ClientSession() as session, session.get(url + "/health") as response:
        return json.loads(await response.text())


async def complete(url: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session:
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
        async with session.post(url + "/v1/completions", json=body) as response:
            return response.status, json.loads(await response.text())


async def test_a_conductor_that_goes_silent_is_replaced_under_a_new_request_id(gateway, nc):
    cluster = Cluster(nc, silent=1)
    await cluster.join()
    status, body = await complete(gateway)
    assert status == 200 and body["usage"]["completion_tokens"] == 2
    first, second = cluster.asked
    assert first != second and body["id"] == second  # the answer is the new id's
    await eventually_async(lambda: cluster.cancelled, "the silent conductor's request was cancelled",
                           until=lambda cancelled: first in cancelled)


async def test_while_no_conductor_is_subscribed_the_gateway_asks_again(gateway, nc):
    cluster = Cluster(nc)
    asking = asyncio.ensure_future(complete(gateway))
    # nobody answers on the subject yet (a conductor restarting): the gateway asks again and again
    await eventually_async(lambda: health(gateway), "the gateway asked again after no responders",
                           until=lambda body: body["schedule_no_responders"] >= 2)
    assert not asking.done()
    await cluster.join()
    status, body = await asking
    assert status == 200 and body["usage"]["completion_tokens"] == 2 and len(cluster.asked) == 1


class StoppedConductor:
    """A replica that stopped (SIGSTOP): still subscribed in the queue group and on its own subject, it heard
    once and then never again; it answers nothing."""

    def __init__(self, nc, name: str) -> None:
        self.nc, self.name = nc, name
        self.asked: list[str] = []

    async def join(self) -> None:
        await self.nc.subscribe(Subjects.SCHEDULE, queue="conductor", cb=self.schedule)
        await self.nc.subscribe(Subjects.schedule_at(self.name), cb=self.schedule)
        await self.nc.publish(Subjects.CONDUCTORS, encode(ConductorAlive(instance_id=self.name)))

    async def schedule(self, msg) -> None:
        self.asked.append(decode(msg.data, ScheduleRequest).request_id)


async def heartbeat(nc, name: str) -> None:
    while True:
        await nc.publish(Subjects.CONDUCTORS, encode(ConductorAlive(instance_id=name)))
        await asyncio.sleep(0.5)


async def test_requests_go_to_a_replica_that_heartbeats_not_to_a_stopped_one(gateway, nc):
    stopped = StoppedConductor(nc, "conductor-0")
    await stopped.join()
    live = Cluster(nc)
    await live.join()
    await nc.subscribe(Subjects.schedule_at("conductor-1"), cb=live.schedule)
    beating = asyncio.ensure_future(heartbeat(nc, "conductor-1"))
    try:
        # the stopped replica's one heartbeat gets older than the gateway's lease: only the live one is left
        await eventually_async(lambda: health(gateway), "the stopped replica's lease ran out",
                               until=lambda body: body["conductors_heartbeating"] == ["conductor-1"], timeout_s=15)
        answers = await asyncio.gather(*(complete(gateway) for _ in range(8)))
    finally:
        beating.cancel()
    assert [status for status, _ in answers] == [200] * 8, answers
    assert stopped.asked == [] and len(live.asked) == 8
