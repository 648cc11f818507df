"""Every HTTP error is an OpenAI error object, in the failure modes that used to give aiohttp's plain-text
500 page: kvs-meta's /batch_query_keys with its Redis stopped (a 503 with Retry-After), and the gateway
answering while its NATS connection drains at shutdown. Real redis-server, NATS and services."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
import urllib.error
import urllib.request

import nats
import pytest

from conftest import start_server, stop
from harness import spawn_service
from kvcentric.core.protocol import Subjects
from kvcentric.tools.processes import free_port, redis_server_argv


def call(url: str, data: bytes | None = None, timeout_s: float = 30) -> tuple[int, dict, dict]:
    """(status, headers, JSON body) of a GET, or of a POST of `data`; fails if the body is not JSON."""
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, dict(response.headers), json.load(response)
    except urllib.error.HTTPError as exc:
        assert exc.headers.get_content_type() == "application/json", (exc.code, exc.read()[:200])
        return exc.code, dict(exc.headers), json.load(exc)


@pytest.fixture
def kvs_meta_on_own_redis(nats_url):
    """kvs-meta on a redis-server of the test's own (which the test stops); yields (url, the redis)."""
    port = free_port()
    redis = start_server(redis_server_argv(port), port)
    process, http_port = spawn_service("kvs-meta", nats_url, "--redis-url", f"redis://127.0.0.1:{port}/0")
    try:
        yield f"http://127.0.0.1:{http_port}", redis
    finally:
        stop(process)
        stop(redis)


def test_kvs_meta_with_redis_stopped_answers_a_503_in_json(kvs_meta_on_own_redis):
    url, redis = kvs_meta_on_own_redis
    status, _, body = call(url + "/batch_query_keys?keys=k1,k2")
    assert status == 200 and body["success"] is True
    stop(redis)
    status, headers, body = call(url + "/batch_query_keys?keys=k1,k2")
    assert status == 503, body
    assert headers["Retry-After"] == "1"
    assert body["error"]["type"] == "service_unavailable" and "Redis" in body["error"]["message"]


def test_kvs_meta_refuses_a_bad_query_in_json(kvs_meta_on_own_redis):
    url, _ = kvs_meta_on_own_redis
    status, _, body = call(url + "/batch_query_keys")
    assert status == 400 and body["error"]["param"] == "keys" and body["success"] is False


async def test_a_request_in_flight_while_the_gateway_drains_nats_gets_json(own_nats):
    """A conductor that takes the schedule request and never answers keeps a request in flight; the
    gateway is then stopped (its NATS connection drains before HTTP closes) and the answer is JSON. On a NATS
    of its own: a real conductor heartbeating on the session's would be asked instead of the silent one."""
    nc = await nats.connect(own_nats)
    asked = asyncio.Event()

    async def silent_conductor(msg) -> None:
        asked.set()
    await nc.subscribe(Subjects.SCHEDULE, cb=silent_conductor)
    # The unanswered ask ends at --bus-timeout-s, while the gateway is stopping: the signal goes at once, seconds
    # before (the answer is checked to come after it), and the test waits no longer than that timeout.
    process, port = spawn_service("gateway", own_nats, "--bus-timeout-s", "5")
    answers: list = []
    body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 2}).encode()
    client = threading.Thread(target=lambda: answers.append(
        (call(f"http://127.0.0.1:{port}/v1/completions", body), time.monotonic())))
    try:
        client.start()
        await asyncio.wait_for(asked.wait(), 60)
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        await asyncio.to_thread(client.join, 60)
    finally:
        stop(process)
        await nc.close()
    ((status, headers, answer), answered), = answers
    assert answered > signalled, "the answer came before the gateway was told to stop"
    assert status == 503, answer
    assert headers.get("Retry-After") == "1" and answer["error"]["type"] == "service_unavailable", (headers, answer)
