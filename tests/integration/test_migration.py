"""Request migration on a real cluster (`kvcentric up --prefill 2 --decode 2`, fp32, greedy): a decode
instance killed with SIGKILL mid-stream, or a prefill instance killed during a long prefill, and the client
still gets one uninterrupted stream of exactly max_tokens tokens, the same text as an undisturbed run; the
continuation of a killed decode's stream computes neither its prompt nor its output again."""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time
import urllib.request

import pytest

from harness import UpProcess, spawn_service
from kvcentric.tools.processes import get_json
from waiting import eventually

pytestmark = pytest.mark.integration

MAX_TOKENS = 1200
DETECTION_BOUND_S = 1.5 * 3 + 5.0
"""The gateway's --silent-after-s at its worst (nobody heard at all) plus the 5 s a migration may take."""
ALIVE_ERRORS = (OSError, ValueError, KeyError)
BLOCK_SIZE = 16
"""Tokens per KV block (up's --block-size default)."""


class Stream:
    """One streaming completion read event by event: the text, the usage, when each event arrived."""

    def __init__(self, port: int, body: dict) -> None:
        self.connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        payload = {**body, "stream": True, "stream_options": {"include_usage": True}}
        self.connection.request("POST", "/v1/completions", json.dumps(payload),
                                {"Content-Type": "application/json"})
        self.response = self.connection.getresponse()
        self.text, self.usage, self.errors, self.times = "", None, [], []
        if self.response.status != 200:  # failed before its stream opened: an error object, no events
            self.errors.append(json.loads(self.response.read() or b"{}").get("error", self.response.status))

    @property
    def decode_id(self) -> str:
        return self.response.getheader("x-kvcentric-decode", "")

    def events(self):
        """Each event's JSON as it comes (after its arrival time is noted), until [DONE]."""
        while True:
            line = self.response.readline()
            if not line:
                return
            if not line.startswith(b"data: "):
                continue
            data = line[len(b"data: "):].strip()
            if data == b"[DONE]":
                return
            self.times.append(time.monotonic())
            event = json.loads(data)
            self.take(event)
            yield event

    def take(self, event: dict) -> None:
        if "error" in event:
            self.errors.append(event["error"])
        for choice in event.get("choices", []):
            self.text += choice.get("text", "")
        if event.get("usage"):
            self.usage = event["usage"]

    def finish(self) -> Stream:
        for _ in self.events():
            pass
        self.connection.close()
        return self


def request(prompt: list[int]) -> dict:
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}


def metric(up: UpProcess, name: str, **labels: str) -> float:
    """A counter of the gateway's /metrics, summed over the series that carry `labels`."""
    with urllib.request.urlopen(f"{up.url}/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    wanted = [f'{key}="{value}"' for key, value in labels.items()]
    return sum(float(line.split()[-1]) for line in lines
               if line.split("{")[0].split(" ")[0] == name and all(label in line for label in wanted))


def engines_alive(up: UpProcess) -> bool:
    conductor = up.reload()["services"]["conductor-0"]["health_url"]
    health = get_json(conductor)[1]
    return health.get("prefill_alive") == 2 and health.get("decode_alive") == 2


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    """2 prefill + 2 decode instances of the tiny model in fp32; KV pushes capped at 0.005 Gbit/s, so a
    1,500-token prompt's KV takes seconds to reach its decode instance (a prefill can be killed mid-way); host
    pools of 8 MiB (1,024 blocks of the tiny model), where the decode instances write back their output's KV."""
    cluster = UpProcess(str(tmp_path_factory.mktemp("up-migration")), "--prefill", "2", "--decode", "2",
                        "--model", "tiny", "--prefill-chunk", "64",
                        env={"KVC_KV_RATE_LIMIT_GBPS": "0.005", "KVC_HOST_POOL_MB": "8"}, timeout_s=240.0)
    try:
        yield cluster
    finally:
        cluster.stop()


def kill(up: UpProcess, name: str) -> float:
    os.kill(up.reload()["services"][name]["pid"], signal.SIGKILL)
    return time.monotonic()


def test_a_stream_whose_decode_instance_is_killed_goes_on_elsewhere_with_the_same_tokens(up):
    prompt = [3 + (i * 7) % 250 for i in range(100)]
    reference = Stream(up.port, request(prompt)).finish()
    assert reference.errors == [] and reference.usage["completion_tokens"] == MAX_TOKENS
    before = metric(up, "kvc_migrations_total", reason="decode_silent")

    stream = Stream(up.port, request(prompt))
    events = stream.events()
    next(events)  # the first token is out: the decode instance is generating
    killed_at = kill(up, stream.decode_id)
    for _ in events:
        pass
    stream.connection.close()

    assert stream.errors == []
    assert stream.usage["completion_tokens"] == MAX_TOKENS
    assert stream.text == reference.text
    assert metric(up, "kvc_migrations_total", reason="decode_silent") == before + 1
    after_kill = [killed_at, *(t for t in stream.times if t > killed_at)]
    stall_s = max(later - earlier for earlier, later in zip(after_kill, after_kill[1:]))
    print(f"decode killed: the stream stalled {stall_s:.2f} s (detection + migration)")
    assert stall_s < DETECTION_BOUND_S
    eventually(lambda: engines_alive(up), "the killed decode instance restarted", timeout_s=60, ignoring=ALIVE_ERRORS)


def prefill_tokens_computed(up: UpProcess) -> int:
    """Prompt tokens the prefill instances computed (not found cached), together."""
    return sum(up.health(name)["stats"]["prefill_tokens_computed"] for name in ("prefill-0", "prefill-1"))


def test_a_killed_decode_instances_migrated_stream_resumes_without_recomputing_the_prompt(up):
    """Nor its output: the decode instance wrote the blocks its tokens filled back to the prefill's host pool, so
    the continuation (prompt + every token streamed) computes only what follows the last of them."""
    eventually(lambda: engines_alive(up), "every engine alive", timeout_s=60, ignoring=ALIVE_ERRORS)
    body = {**request([5 + (i * 13) % 240 for i in range(1000)]), "max_tokens": 200}  # a prompt no test sent
    before = prefill_tokens_computed(up)

    stream = Stream(up.port, body)
    events = stream.events()
    while len(stream.text) < 80:  # 80 tokens out at least (one character is one byte token or more): 5 blocks
        next(events)
    prompt_computed = prefill_tokens_computed(up) - before
    killed_at = kill(up, stream.decode_id)
    for _ in events:
        pass
    stream.connection.close()
    continuation_computed = prefill_tokens_computed(up) - before - prompt_computed

    assert stream.errors == [] and stream.usage["completion_tokens"] == 200
    assert prompt_computed == 1000
    # What follows the last block written back: the partial block, and at most one block still on its way.
    assert continuation_computed < 3 * BLOCK_SIZE, continuation_computed
    after_kill = [killed_at, *(t for t in stream.times if t > killed_at)]
    stall_s = max(later - earlier for earlier, later in zip(after_kill, after_kill[1:]))
    print(f"decode killed: the continuation computed {continuation_computed} tokens; the stream stalled "
          f"{stall_s:.2f} s")
    assert stream.text == Stream(up.port, body).finish().text  # the KV written back is the KV it had
    eventually(lambda: engines_alive(up), "the killed decode instance restarted", timeout_s=60, ignoring=ALIVE_ERRORS)


def start_in_background(port: int, body: dict) -> tuple[threading.Thread, list[Stream]]:
    """A streaming request opened in a thread (its response opens once the request is placed)."""
    opened: list[Stream] = []
    opener = threading.Thread(target=lambda: opened.append(Stream(port, body)))
    opener.start()
    return opener, opened


def prefill_chunks(up: UpProcess) -> dict[str, int]:
    return {name: up.health(name)["stats"]["prefill_chunks"] for name in ("prefill-0", "prefill-1")}


def kill_busy_prefill(up: UpProcess, before: dict[str, int]) -> float:
    """SIGKILL the prefill instance that has computed a chunk since `before`; when."""
    busy = eventually(lambda: next((name for name, chunks in prefill_chunks(up).items() if chunks > before[name]),
                                   None), "a prefill instance took the request", timeout_s=30, every_s=0.02)
    return kill(up, busy)


def test_a_request_whose_prefill_instance_is_killed_mid_prefill_is_prefilled_again_elsewhere(up):
    eventually(lambda: engines_alive(up), "every engine alive", timeout_s=60, ignoring=ALIVE_ERRORS)
    before = metric(up, "kvc_migrations_total")
    before_decode = metric(up, "kvc_migrations_total", reason="decode_silent")
    chunks = prefill_chunks(up)
    body = {**request([3 + (i * 11) % 250 for i in range(1500)]), "max_tokens": 64}  # uncached: computed whole

    started = time.monotonic()
    opener, opened = start_in_background(up.port, body)
    killed_at = kill_busy_prefill(up, chunks)
    opener.join(60)
    stream = opened[0].finish()

    assert stream.errors == [], stream.errors
    assert stream.usage["completion_tokens"] == 64
    assert metric(up, "kvc_migrations_total") == before + 1
    assert metric(up, "kvc_migrations_total", reason="decode_silent") == before_decode
    print(f"prefill killed {killed_at - started:.2f} s into the request; first token "
          f"{stream.times[0] - killed_at:.2f} s after the kill")
    assert stream.times[0] - killed_at < DETECTION_BOUND_S + 10  # the whole prompt is computed and pushed again
    undisturbed = Stream(up.port, body).finish()
    assert stream.text == undisturbed.text


def test_a_request_that_may_not_be_migrated_ends_soon_with_a_503_and_retry_after(up):
    """A gateway of its own with --max-migrations 0 on the same cluster: the request whose prefill dies gets
    its 503 within the detection bound instead of waiting for --request-timeout-s: the stream opened when the
    request was placed (status 200), so the 503 is its error event (`service_unavailable`)."""
    eventually(lambda: engines_alive(up), "every engine alive", timeout_s=60, ignoring=ALIVE_ERRORS)
    gateway, port = spawn_service("gateway", up.manifest["nats_url"], "--max-migrations", "0")
    try:
        chunks = prefill_chunks(up)
        opener, opened = start_in_background(port, {**request([7 + (i * 5) % 240 for i in range(1500)]),
                                                    "max_tokens": 64})
        killed_at = kill_busy_prefill(up, chunks)
        opener.join(60)
        response = opened[0].response
        stream = opened[0].finish()
        answered_s = time.monotonic() - killed_at
        assert response.status == 200 and stream.errors, stream.errors
        # Two reports race: the gateway's (the prefill went silent, and this request may not move) and the
        # decode's (the push it was waiting for broke off). Either is a clean 503 error event.
        assert stream.errors[0]["type"] == "service_unavailable", stream.errors
        message = stream.errors[0]["message"]
        assert "not migrated" in message or "KV transfer failed" in message, message
        print(f"not migrated: 503 {answered_s:.2f} s after the kill")
        assert answered_s < DETECTION_BOUND_S
    finally:
        gateway.terminate()
        gateway.wait(10)
