"""The conductor hands placed requests to the engines itself (the gateway's default `--dispatch conductor`):
a real nats-server, conductor and gateway, with the engines played by NATS subscribers that report load and
record the jobs they get; and a real prefill engine for the job that comes after its cancel."""

from __future__ import annotations

import asyncio
import json
import math
import time
import urllib.request

import aiohttp
import msgspec
import nats
import pytest

from conftest import start_server, stop
from kvcentric.tools.processes import free_port, nats_server_argv
from harness import spawn_service as spawn
from kvcentric.core.protocol import (Cancel, DecodeJob, Dispatch, InstancesQuery, InstancesReply, LoadReport,
                                PrefillJob, Rejection, SamplingParams, ScheduleReply, ScheduleRequest, SubmitAck,
                                Subjects, TokenChunk, decode, encode)
from waiting import eventually_async

BODY = {"model": "tiny", "prompt": "hello, conductor", "max_tokens": 2}
ACCEPTED = SubmitAck.accepted()
SILENT = SubmitAck.refused("(never sent: the stand-in takes the job and does not answer)")


@pytest.fixture(scope="module")
def cluster():
    """nats-server, a conductor and a gateway (default dispatch); no engines."""
    port = free_port()
    server = start_server(nats_server_argv(port), port)
    url = f"nats://127.0.0.1:{port}"
    conductor, _ = spawn("conductor", url, "--stale-after-s", "600", "--submit-timeout-s", "1")
    gateway, gateway_port = spawn("gateway", url, "--request-timeout-s", "5")
    try:
        yield url, f"http://127.0.0.1:{gateway_port}"
    finally:
        stop(gateway)
        stop(conductor)
        stop(server)


class Engines:
    """A prefill "p" and a decode "d" played by NATS subscribers: they report load (so the conductor
    places on them), answer submits with the given acks, and record jobs and cancels."""

    def __init__(self, nc, prefill_ack: SubmitAck | None = ACCEPTED, decode_ack: SubmitAck | None = ACCEPTED) -> None:
        self.nc, self.prefill_ack, self.decode_ack = nc, prefill_ack, decode_ack
        self.prefill_jobs: list[PrefillJob] = []
        self.decode_jobs: list[DecodeJob] = []
        self.cancels: list[Cancel] = []
        self.first_tokens_sent: set[str] = set()
        self.subscriptions = []

    async def __aenter__(self) -> Engines:
        subjects = [(Subjects.CANCEL_ALL, self.on_cancel)]
        if self.prefill_ack is not None:  # None: registered by its load report, but nobody takes its jobs
            subjects.append((Subjects.submit("prefill", "p"), self.on_prefill))
        if self.decode_ack is not None:
            subjects.append((Subjects.submit("decode", "d"), self.on_decode))
        for subject, callback in subjects:
            self.subscriptions.append(await self.nc.subscribe(subject, cb=callback))
        reported = time.monotonic()
        for role, name in (("prefill", "p"), ("decode", "d")):
            report = LoadReport(instance_id=name, role=role, cluster="local", kv_addr="127.0.0.1:1", queued_requests=0,
                                queued_tokens=0, running=0, kv_blocks_total=1000, kv_blocks_free=1000, ts=0.0)
            await self.nc.publish(Subjects.load(role, name), encode(report))
        await self.nc.flush()
        # the conductor's last report of each is no older than ours (ages are rounded to the millisecond)
        await eventually_async(self.report_ages, "the conductor saw both reports", until=lambda ages: all(
            ages.get(name, math.inf) <= time.monotonic() - reported + 1e-3 for name in ("p", "d")))
        return self

    async def report_ages(self) -> dict[str, float]:
        """How long ago the conductor heard from each instance it knows."""
        reply = await self.nc.request(Subjects.INSTANCES, encode(InstancesQuery()), timeout=2)
        return {instance.instance_id: instance.age_s for instance in decode(reply.data, InstancesReply).instances}

    async def __aexit__(self, *exc) -> None:
        for subscription in self.subscriptions:
            await subscription.unsubscribe()

    async def on_prefill(self, msg) -> None:
        job = decode(msg.data, PrefillJob)
        self.prefill_jobs.append(job)
        await msg.respond(encode(self.prefill_ack))
        if self.prefill_ack.ok and self.decode_ack is not None and self.decode_ack.ok:  # as a prefill instance does
            first = TokenChunk(request_id=job.request_id, seq=0, token_ids=[104])
            await self.nc.publish(Subjects.out(job.request_id), encode(first))
            self.first_tokens_sent.add(job.request_id)

    async def on_decode(self, msg) -> None:
        job = decode(msg.data, DecodeJob)
        self.decode_jobs.append(job)
        if self.decode_ack == SILENT:
            return
        await msg.respond(encode(self.decode_ack))
        if self.decode_ack.ok and self.prefill_ack is not None and self.prefill_ack.ok:  # KV came: it decodes
            final = TokenChunk.final(job.request_id, "length", seq=1, token_ids=[105],
                                     prompt_tokens=job.n_prompt_tokens, completion_tokens=2)
            await eventually_async(lambda: self.first_tokens_sent, "the prefill stand-in sent the first token",
                                   until=lambda sent: job.request_id in sent)
            await self.nc.publish(Subjects.out(job.request_id), encode(final))

    async def on_cancel(self, msg) -> None:
        self.cancels.append(decode(msg.data, Cancel))

    async def cancelled(self, request_id: str) -> bool:
        await eventually_async(lambda: [c.request_id for c in self.cancels], f"a cancel of {request_id}",
                               until=lambda cancelled: request_id in cancelled)
        return True


@pytest.fixture
async def nc(cluster):
    client = await nats.connect(cluster[0])
    try:
        yield client
    finally:
        await client.close()


def bus_drops(port: int) -> float:
    """kvc_bus_drops_total on the /metrics of the service on `port` (0 before the first drop)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
        lines = [line for line in response.read().decode().splitlines() if line.startswith("kvc_bus_drops_total")]
    return float(lines[0].split()[-1]) if lines else 0.0


async def post(url: str, body: dict) -> tuple[int, dict, str]:
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/completions", json=body) as response:
            return response.status, {k.lower(): v for k, v in response.headers.items()}, await response.text()


async def test_the_conductor_hands_both_jobs_over_with_the_prompt(cluster, nc):
    async with Engines(nc) as engines:
        status, headers, text = await post(cluster[1], BODY)
    body = json.loads(text)
    assert status == 200 and body["choices"][0]["text"] == "hi" and body["choices"][0]["finish_reason"] == "length"
    assert headers["x-kvcentric-prefill"] == "p" and headers["x-kvcentric-decode"] == "d"
    [prefill], [decode_job] = engines.prefill_jobs, engines.decode_jobs
    assert prefill.request_id == decode_job.request_id == headers["x-request-id"]
    assert len(prefill.token_ids) == decode_job.n_prompt_tokens == body["usage"]["prompt_tokens"]
    assert prefill.decode_id == "d" and prefill.sampling.max_tokens == 2
    assert engines.cancels == []  # the engine ended the request itself


@pytest.mark.parametrize("stream", [False, True])
async def test_a_refused_job_is_503_and_the_side_that_took_it_is_cancelled(cluster, nc, stream):
    async with Engines(nc, decode_ack=SubmitAck.refused("no KV room")) as engines:
        status, headers, text = await post(cluster[1], {**BODY, "stream": stream})
        if stream:  # the stream opened when the request was placed: the 503 is its error event
            assert status == 200 and text.endswith("data: [DONE]\n\n"), text
            error = json.loads(text.split("data: ")[1])["error"]
        else:
            assert status == 503
            error = json.loads(text)["error"]
        assert "decode instance d refused the request: no KV room" in error["message"]
        assert error["type"] == "service_unavailable"
        assert await engines.cancelled(engines.prefill_jobs[-1].request_id)


async def test_a_job_for_an_instance_that_is_gone_is_503(cluster, nc):
    async with Engines(nc, prefill_ack=None):
        status, _, text = await post(cluster[1], BODY)
    assert status == 503 and "prefill instance p is gone" in json.loads(text)["error"]["message"]


async def test_a_job_not_taken_in_the_submit_timeout_is_503_and_the_other_side_is_cancelled(cluster, nc):
    async with Engines(nc, decode_ack=SILENT) as engines:
        status, _, text = await post(cluster[1], BODY)  # the conductor runs with --submit-timeout-s 1
        assert status == 503 and "decode instance d did not take the request in 1 s" in text
        assert await engines.cancelled(engines.prefill_jobs[-1].request_id)


async def test_a_dispatch_that_does_not_match_its_request_is_refused(cluster, nc):
    sampling = SamplingParams(max_tokens=2)
    bad = ScheduleRequest(request_id="r-bad", n_tokens=3, block_hashes=[], max_tokens=2,
                          dispatch=Dispatch(token_ids=[1, 2], sampling=sampling))
    reply = decode((await nc.request(Subjects.SCHEDULE, encode(bad), timeout=5)).data, ScheduleReply)
    assert isinstance(reply, Rejection) and reply.reason == "bad_request" and "n_tokens says 3" in reply.message
    bad = msgspec.structs.replace(bad, n_tokens=2, max_tokens=7)
    reply = decode((await nc.request(Subjects.SCHEDULE, encode(bad), timeout=5)).data, ScheduleReply)
    assert isinstance(reply, Rejection) and "max_tokens says 7" in reply.message
    for request_id in ("a.b", "a b", "*", ""):  # its tokens and cancels could not be addressed on NATS
        bad = ScheduleRequest(request_id=request_id, n_tokens=2, block_hashes=[], max_tokens=2,
                              dispatch=Dispatch(token_ids=[1, 2], sampling=sampling))
        reply = decode((await nc.request(Subjects.SCHEDULE, encode(bad), timeout=5)).data, ScheduleReply)
        assert isinstance(reply, Rejection) and reply.reason == "bad_request" and "request_id" in reply.message
    bad = ScheduleRequest(request_id="r-t", n_tokens=2, block_hashes=[], max_tokens=2,
                          dispatch=Dispatch(token_ids=[1, 2], sampling=SamplingParams(max_tokens=2, top_p=0.0)))
    reply = decode((await nc.request(Subjects.SCHEDULE, encode(bad), timeout=5)).data, ScheduleReply)
    assert isinstance(reply, Rejection) and "top_p" in reply.message


async def test_an_engine_refuses_a_job_that_comes_after_its_cancel(cluster, nc):
    """The gateway may cancel (client gone) while the conductor's job is still on its way: the engine
    remembers the cancel and refuses the job, so it computes nothing for nobody."""
    prefill, port = spawn("prefill", cluster[0], "--model", "tiny", "--instance-id", "p-late", "--num-kv-blocks", "64")
    try:
        async def cancel_then_barrier() -> float:
            """Send the cancel and a bad one after it, again until the engine has counted a bad one: it takes
            cancels one by one, in order, so then it has the cancel (being healthy may come before its cancel
            subscription, and a cancel sent before that reaches nobody)."""
            cancel = Cancel(request_id="r-late", reason="client disconnected")
            await nc.publish(Subjects.cancel("r-late"), encode(cancel))
            await nc.publish(Subjects.cancel("r-barrier"), b"\xc1 not a cancel")
            await nc.flush()
            await asyncio.sleep(0.05)
            return await asyncio.to_thread(bus_drops, port)

        await eventually_async(cancel_then_barrier, "the engine took the cancel", until=lambda drops: drops >= 1)
        job = PrefillJob(request_id="r-late", token_ids=[1, 2, 3, 4], sampling=SamplingParams(max_tokens=1),
                         decode_id="d", decode_kv_addr="127.0.0.1:1")
        reply = await nc.request(Subjects.submit("prefill", "p-late"), encode(job), timeout=5)
        ack = decode(reply.data, SubmitAck)
        assert not ack.ok and "cancelled before its job arrived" in ack.error
        for bad, why in ((msgspec.structs.replace(job, request_id="r-vocab", token_ids=[1, 99999]), "token ids"),
                         (msgspec.structs.replace(job, request_id="r.dot"), "request_id")):
            ack = decode((await nc.request(Subjects.submit("prefill", "p-late"), encode(bad), timeout=5)).data,
                         SubmitAck)
            assert not ack.ok and why in ack.error
        job = msgspec.structs.replace(job, request_id="r-on-time")
        ack = decode((await nc.request(Subjects.submit("prefill", "p-late"), encode(job), timeout=5)).data, SubmitAck)
        assert ack.ok
        await nc.publish(Subjects.cancel("r-on-time"), encode(Cancel(request_id="r-on-time")))
    finally:
        stop(prefill)
