"""Sending a placed request's jobs to its engines over the bus and reading their acks.

By default the conductor does this itself right after placing a request (`ScheduleRequest.dispatch`, as
Mooncake's Conductor dispatches a request to the pair it selects, §3), so the first token is three bus hops
from the gateway instead of four; with `kvcentric gateway --dispatch gateway` the gateway sends the jobs
once the conductor has answered. Both go through the functions here; which jobs a placement implies is
`kvcentric.core.dispatch`.
"""

from __future__ import annotations

import asyncio

import nats.errors

from kvcentric.core.dispatch import Submit
from kvcentric.core.protocol import BadMessage, SubmitAck, Subjects
from kvcentric.runtime.bus import Bus


async def submit(bus: Bus, submits: list[Submit], timeout_s: float) -> str:
    """Send every job at once (decode holds KV that overtakes its job until the job is in, so the two need no
    order) and wait for the acks. Returns "" when all were taken, else why the first one was not."""
    return await taken(bus, submits, await send(bus, submits), timeout_s)


async def send(bus: Bus, submits: list[Submit]) -> list[asyncio.Future]:
    """Publish the jobs (they are in the write buffer before this yields, ahead of whatever the caller
    publishes next); the futures of their acks."""
    return [await bus.send_request(Subjects.submit(role, instance), job) for role, instance, job in submits]


async def taken(bus: Bus, submits: list[Submit], sent: list[asyncio.Future], timeout_s: float) -> str:
    """Wait for the acks of `send`: "" when every job was taken, else why the first one was not."""
    acks = await asyncio.gather(*(bus.reply(future, SubmitAck, timeout_s) for future in sent),
                                return_exceptions=True)
    for (role, instance, _), ack in zip(submits, acks):
        why = refusal(role, instance, ack, timeout_s)
        if why:
            return why
    return ""


def refusal(role: str, instance: str, ack: SubmitAck | BaseException, timeout_s: float) -> str:
    """Why one job was not taken, from its ack or the error in its place; "" when it was taken. An error
    that is not the bus's is raised."""
    if isinstance(ack, nats.errors.NoRespondersError):
        return f"{role} instance {instance} is gone (nobody answers on {Subjects.submit(role, instance)})"
    if isinstance(ack, (nats.errors.TimeoutError, asyncio.TimeoutError)):
        return f"{role} instance {instance} did not take the request in {timeout_s:g} s"
    if isinstance(ack, (BadMessage, nats.errors.Error)):
        return f"{role} instance {instance} could not be reached: {type(ack).__name__}: {ack}"
    if isinstance(ack, BaseException):
        raise ack
    if not ack.ok:
        return f"{role} instance {instance} refused the request: {ack.error}"
    return ""
