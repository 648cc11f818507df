"""Cancellation follows every ending, on a real `kvcentric up` cluster: clients that leave leave no prefill
work behind, and a decode that gives up waiting for KV (an error chunk) has the request's prefill job
cancelled, so the prefill drops what is queued for requests already over instead of computing it.

Prefill is slowed with small chunks (--prefill-chunk 16) so that a queue builds behind long prompts."""

from __future__ import annotations

import asyncio
import json
import random
import time

import aiohttp
import pytest

from harness import UpProcess
from waiting import eventually

CLIENTS = 8
PROMPT_TOKENS = 1500
LEFT_WITHIN_S = 1.0
"""The bound of the issue: no prefill work left this long after the last client's request ended."""
KV_WAIT_S = 0.5
"""The decode instance's --kv-wait-s in the second cluster: far below how long the queue takes."""


def long_prompt() -> list[int]:
    """A prompt of its own (no prefix shared with the others: each is computed in full)."""
    return [random.randrange(1, 250) for _ in range(PROMPT_TOKENS)]


def prefill_work(cluster: UpProcess) -> dict:
    stats = cluster.health("prefill-0")["stats"]
    return {key: stats[key] for key in ("requests_queued", "requests_running", "requests_cancelled",
                                        "requests_prefilled")}


def no_work_left(cluster: UpProcess, what: str) -> dict:
    return eventually(lambda: prefill_work(cluster), what, timeout_s=LEFT_WITHIN_S, every_s=0.02,
                      until=lambda work: work["requests_queued"] == 0 and work["requests_running"] == 0)


@pytest.fixture
def slow_prefill(tmp_path):
    up = UpProcess(str(tmp_path), "--prefill-chunk", "16")
    try:
        yield up
    finally:
        up.stop()


@pytest.fixture
def impatient_decode(tmp_path):
    # Every request admitted (the conductor's early rejection, with its TTFT correction, would refuse most of
    # this burst up front): what is under test is what follows when the decode gives up.
    up = UpProcess(str(tmp_path), "--prefill-chunk", "16", env={"KVC_KV_WAIT_S": str(KV_WAIT_S),
                                                                "KVC_REJECTION": "never"})
    try:
        yield up
    finally:
        up.stop()


async def first_token(session: aiohttp.ClientSession, url: str) -> None:
    """Stream a completion and return (closing the connection) at its first token."""
    body = {"model": "tiny", "prompt": long_prompt(), "max_tokens": 64, "stream": True, "ignore_eos": True}
    async with session.post(url + "/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            if line.startswith(b"data: {"):
                return


async def test_clients_that_leave_leave_no_prefill_work_behind(slow_prefill):
    async with aiohttp.ClientSession() as session:
        clients = [asyncio.create_task(first_token(session, slow_prefill.url)) for _ in range(CLIENTS)]
        done, waiting = await asyncio.wait(clients, timeout=120, return_when=asyncio.FIRST_COMPLETED)
        assert done and waiting, "one client had its first token while the others still waited"
        for client in waiting:  # everyone leaves at the first token
            client.cancel()
        await asyncio.gather(*clients, return_exceptions=True)
    work = await asyncio.to_thread(no_work_left, slow_prefill, "prefill-0 idle after the clients left")
    assert work["requests_cancelled"] >= 1, work


async def one_completion(session: aiohttp.ClientSession, url: str) -> tuple[int, dict]:
    body = {"model": "tiny", "prompt": long_prompt(), "max_tokens": 4}
    async with session.post(url + "/v1/completions", json=body) as response:
        return response.status, json.loads(await response.text())


async def test_a_decode_that_gives_up_on_kv_has_the_prefill_job_cancelled(impatient_decode):
    started = time.monotonic()
    async with aiohttp.ClientSession() as session:
        answers = await asyncio.gather(*(one_completion(session, impatient_decode.url) for _ in range(CLIENTS)))
    gave_up = [body for status, body in answers if status == 503 and "KV did not arrive" in str(body)]
    assert gave_up, (answers, time.monotonic() - started)
    work = await asyncio.to_thread(no_work_left, impatient_decode,
                                   "prefill-0 idle once the decode gave up on the requests")
    assert work["requests_cancelled"] >= 1, work
    assert work["requests_prefilled"] < CLIENTS, work
