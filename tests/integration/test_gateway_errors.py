"""The gateway's error answers on a real NATS bus, with stand-in conductor and engines answering there
(plain NATS subscribers in this test): 429 with Retry-After, 500, 503, 504, and the Cancel and
RequestOutcome it publishes when a request ends early. The gateway here sends the jobs itself
(`--dispatch gateway`); test_dispatch.py has the same failures with the real conductor dispatching."""

from __future__ import annotations

import json

import aiohttp
import msgspec
import nats
import pytest

from conftest import start_server, stop
from kvcentric.tools.processes import free_port, nats_server_argv
from kvcentric.core.protocol import (Cancel, Placement, PrefillJob, Rejection, RequestOutcome, ScheduleRequest,
                                SubmitAck, Subjects, TokenChunk, decode, encode)
from harness import spawn_service as spawn
from waiting import eventually_async

BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 4}


@pytest.fixture(scope="module")
def bus():
    """A NATS server of its own and a gateway that times out after 1 s; no conductor, no engines."""
    port = free_port()
    server = start_server(nats_server_argv(port), port)
    url = f"nats://127.0.0.1:{port}"
    gateway, gateway_port = spawn("gateway", url, "--request-timeout-s", "1", "--bus-timeout-s", "1",
                                  "--dispatch", "gateway")
    try:
        yield url, f"http://127.0.0.1:{gateway_port}"
    finally:
        stop(gateway)
        stop(server)


ACCEPTED = SubmitAck.accepted()


class StandIns:
    """A conductor and two engines played by NATS subscribers; they record what reaches them."""

    def __init__(self, nc, decision, decode_ack=ACCEPTED, tokens: list[TokenChunk] = ()) -> None:
        self.nc, self.decision, self.decode_ack, self.tokens = nc, decision, decode_ack, tokens
        self.cancels: list[Cancel] = []
        self.outcomes: list[RequestOutcome] = []
        self.asked: list[ScheduleRequest] = []
        self.subscriptions = []

    async def __aenter__(self) -> StandIns:
        for subject, callback in ((Subjects.SCHEDULE, self.schedule),
                                  (Subjects.submit("decode", "d"), self.submit_decode),
                                  (Subjects.submit("prefill", "p"), self.submit_prefill),
                                  (Subjects.CANCEL_ALL, self.cancel), (Subjects.OUTCOME, self.outcome)):
            self.subscriptions.append(await self.nc.subscribe(subject, cb=callback))
        await self.nc.flush()
        return self

    async def __aexit__(self, *exc) -> None:
        for subscription in self.subscriptions:
            await subscription.unsubscribe()

    async def schedule(self, msg) -> None:
        self.asked.append(decode(msg.data, ScheduleRequest))
        await msg.respond(encode(self.decision))

    async def submit_decode(self, msg) -> None:
        await msg.respond(encode(self.decode_ack))

    async def submit_prefill(self, msg) -> None:
        await msg.respond(encode(SubmitAck.accepted()))
        request_id = decode(msg.data, PrefillJob).request_id
        for chunk in self.tokens:
            chunk = msgspec.structs.replace(chunk, request_id=request_id)
            await self.nc.publish(Subjects.out(request_id), encode(chunk))

    async def cancel(self, msg) -> None:
        self.cancels.append(decode(msg.data, Cancel))

    async def outcome(self, msg) -> None:
        self.outcomes.append(decode(msg.data, RequestOutcome))

    async def settle(self, cancels: int = 1, outcomes: int = 1) -> None:
        """Until the gateway has published at least these many cancels and outcomes."""
        await eventually_async(lambda: (len(self.cancels), len(self.outcomes)),
                               f"{cancels} cancel(s) and {outcomes} outcome(s)",
                               until=lambda seen: seen[0] >= cancels and seen[1] >= outcomes)


PLACED = Placement(request_id="", prefill_id="p", decode_id="d", decode_kv_addr="127.0.0.1:1", predicted_ttft_s=0.25)


async def post(url: str, body: dict) -> tuple[int, dict, str]:
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/completions", json=body) as response:
            return response.status, dict(response.headers), await response.text()


@pytest.fixture
async def nc(bus):
    client = await nats.connect(bus[0])
    try:
        yield client
    finally:
        await client.close()


async def test_a_conductor_rejection_is_429_with_retry_after(bus, nc):
    async with StandIns(nc, Rejection.overloaded("", "prefill queue too long", retry_after_s=2.6)):
        status, headers, text = await post(bus[1], BODY)
    error = json.loads(text)["error"]
    assert status == 429 and headers["Retry-After"] == "3"
    assert error["type"] == "rate_limit_exceeded" and error["code"] == "overloaded"


async def test_the_conductor_is_asked_with_the_negated_vllm_priority(bus, nc):
    async with StandIns(nc, Rejection.overloaded("", "busy")) as standins:
        await post(bus[1], {**BODY, "priority": 2})
        await post(bus[1], BODY)
    assert [asked.priority for asked in standins.asked] == [-2, 0]
    assert standins.asked[0].dispatch is None  # --dispatch gateway


async def test_a_conductor_failure_is_500_not_the_clients_fault(bus, nc):
    async with StandIns(nc, Rejection(request_id="", reason="bad_request", message="KeyError: 'x'")):
        status, _, text = await post(bus[1], BODY)
    assert status == 500 and "conductor failed" in json.loads(text)["error"]["message"]


async def test_a_request_past_the_timeout_is_504_and_cancelled_everywhere(bus, nc):
    async with StandIns(nc, PLACED) as standins:
        status, _, text = await post(bus[1], BODY)
        await standins.settle()
    assert status == 504 and "--request-timeout-s" in json.loads(text)["error"]["message"]
    assert len(standins.cancels) == 1
    outcome = standins.outcomes[0]
    assert outcome.request_id == standins.cancels[0].request_id and outcome.finish_reason == "504"
    assert outcome.ttft_s == -1.0 and outcome.predicted_ttft_s == 0.25 and outcome.prefill_id == "p"


async def test_a_refused_submit_is_503_and_the_accepted_side_is_cancelled(bus, nc):
    async with StandIns(nc, PLACED, decode_ack=SubmitAck.refused("no KV room")) as standins:
        status, _, text = await post(bus[1], BODY)
        await standins.settle()
    assert status == 503 and "no KV room" in json.loads(text)["error"]["message"]
    assert len(standins.cancels) == 1


async def test_an_engine_error_is_500_whole_and_an_error_event_when_streaming(bus, nc):
    chunks = [TokenChunk(request_id="", seq=0, token_ids=[104]),
              TokenChunk.failed("", "decode failed: boom", prompt_tokens=5, completion_tokens=1, seq=1)]
    async with StandIns(nc, PLACED, tokens=chunks) as standins:
        status, _, text = await post(bus[1], BODY)
        assert status == 500 and "boom" in json.loads(text)["error"]["message"]
        status, _, text = await post(bus[1], {**BODY, "stream": True})
        await standins.settle(cancels=2, outcomes=2)
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert status == 200 and json.loads(events[0])["choices"][0]["text"] == "h"
    assert "boom" in json.loads(events[-2])["error"]["message"] and events[-1] == "[DONE]"
    # an error chunk ends only the engine that sent it: the other one is told to drop the request too
    assert [cancel.reason for cancel in standins.cancels] == ["gateway: 500", "gateway: 500"]


async def test_a_stream_that_stalls_ends_with_a_504_event(bus, nc):
    async with StandIns(nc, PLACED, tokens=[TokenChunk(request_id="", seq=0, token_ids=[104])]) as standins:
        status, _, text = await post(bus[1], {**BODY, "stream": True})
        await standins.settle()
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert status == 200 and json.loads(events[-2])["error"]["type"] == "timeout" and events[-1] == "[DONE]"
    assert len(standins.cancels) == 1


async def test_metrics_count_outcomes_and_openapi_lists_the_endpoints(bus, nc):
    async with StandIns(nc, Rejection.overloaded("", "busy")):
        await post(bus[1], BODY)
    async with aiohttp.ClientSession() as session:
        async with session.get(bus[1] + "/metrics") as response:
            metrics = await response.text()
        async with session.get(bus[1] + "/openapi.json") as response:
            document = await response.json()
    assert 'outcome="429"' in metrics and 'kvc_rejections_total{' in metrics
    assert "# TYPE kvc_ttft_seconds histogram" in metrics and "kvc_tbt_seconds_bucket" in metrics
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health"} <= set(document["paths"])
