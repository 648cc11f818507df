"""Handing a placed request to its engines: the jobs a placement implies, and sending them.

By default the conductor does this itself right after placing a request (`ScheduleRequest.dispatch`, as
Mooncake's Conductor dispatches a request to the pair it selects, §3), so the first token is three bus hops
from the gateway instead of four; with `kvcentric gateway --dispatch gateway` the gateway sends the jobs
once the conductor has answered. Both go through the functions here.
"""

from __future__ import annotations

import asyncio

import nats.errors

from kvcentric.core.protocol import BadMessage, DecodeJob, Placement, PrefillJob, SamplingParams, SubmitAck, Subjects

Submit = tuple[str, str, PrefillJob | DecodeJob]
"""(role, instance id, job)."""


def jobs(request_id: str, placement: Placement, token_ids: list[int], sampling: SamplingParams) -> list[Submit]:
    """The prefill job, and the decode job unless one colocated instance does both (it takes its decode
    job from the prefill job)."""
    prefill = PrefillJob(request_id=request_id, token_ids=token_ids, sampling=sampling,
                         decode_id=placement.decode_id, decode_kv_addr=placement.decode_kv_addr,
                         kv_source_addr=placement.kv_source_addr, pull_block_hashes=placement.pull_block_hashes)
    submits: list[Submit] = [("prefill", placement.prefill_id, prefill)]
    if placement.decode_id != placement.prefill_id:
        decode = DecodeJob(request_id=request_id, n_prompt_tokens=len(token_ids), sampling=sampling)
        submits.append(("decode", placement.decode_id, decode))
    return submits


async def submit(service, submits: list[Submit], timeout_s: float) -> str:
    """Send every job at once (decode holds KV that overtakes its job until the job is in, so the two need no
    order) and wait for the acks. Returns "" when all were taken, else why the first one was not.
    `service` is a `kvcentric.runtime.service.Service`."""
    return await taken(service, submits, await send(service, submits), timeout_s)


async def send(service, submits: list[Submit]) -> list[asyncio.Future]:
    """Publish the jobs (they are in the write buffer before this yields, ahead of whatever the caller
    publishes next); the futures of their acks."""
    return [await service.send_request(Subjects.submit(role, instance), job) for role, instance, job in submits]


async def taken(service, submits: list[Submit], sent: list[asyncio.Future], timeout_s: float) -> str:
    """Wait for the acks of `send`: "" when every job was taken, else why the first one was not."""
    acks = await asyncio.gather(*(service.reply(future, SubmitAck, timeout_s) for future in sent),
                                return_exceptions=True)
    for (role, instance, _), ack in zip(submits, acks):
        subject = Subjects.submit(role, instance)
        if isinstance(ack, nats.errors.NoRespondersError):
            return f"{role} instance {instance} is gone (nobody answers on {subject})"
        if isinstance(ack, (nats.errors.TimeoutError, asyncio.TimeoutError)):
            return f"{role} instance {instance} did not take the request in {timeout_s:g} s"
        if isinstance(ack, (BadMessage, nats.errors.Error)):
            return f"{role} instance {instance} could not be reached: {type(ack).__name__}: {ack}"
        if isinstance(ack, BaseException):
            raise ack
        if not ack.ok:
            return f"{role} instance {instance} refused the request: {ack.error}"
    return ""
