"""`kvcentric up` keeps its cluster serving through a child's death: a decode instance or a conductor
killed with SIGKILL is started again (and `up` says so), killing one of the two conductors under load loses
no request, a nats-server killed and restarted is rejoined by every service (requests caught in the gap
end at once with a 503), and kvs-meta reconnects to a restarted redis-server."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest

from harness import UpProcess
from waiting import eventually

from kvcentric.tools.processes import get_json

BOUND_S = 20.0
"""No request may take longer than this, fault or not (the gateway's own timeout is 120 s)."""


def post(url: str, max_tokens: int = 4, timeout_s: float = 60.0) -> tuple[int, dict, float]:
    body = json.dumps({"prompt": "keep serving", "max_tokens": max_tokens, "temperature": 0}).encode()
    request = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, json.load(response), time.monotonic() - started
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc), time.monotonic() - started


class Load:
    """`clients` threads sending one request after another until stopped; every answer is kept."""

    def __init__(self, url: str, clients: int = 2) -> None:
        self.url, self.answers = url, []
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self.client, daemon=True) for _ in range(clients)]
        for thread in self.threads:
            thread.start()

    def client(self) -> None:
        while not self.stopping.is_set():
            self.answers.append(post(self.url))

    def __enter__(self) -> Load:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def stop(self) -> list[tuple[int, dict, float]]:
        self.stopping.set()
        for thread in self.threads:
            thread.join(BOUND_S + 60)
        return self.answers


def serving(up: UpProcess) -> bool:
    return post(up.url)[0] == 200


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    cluster = UpProcess(str(tmp_path_factory.mktemp("up-restarts")), "--prefill", "1", "--decode", "2")
    try:
        yield cluster
    finally:
        cluster.stop()


def kill(up: UpProcess, name: str) -> int:
    """SIGKILL the child `name`; its pid."""
    pid = up.reload()["services"][name]["pid"]
    os.kill(pid, signal.SIGKILL)
    return pid


def wait_restarted(up: UpProcess, name: str, said_before: int) -> None:
    up.wait_said(rf"{name} exited with code -9; restarting it in 0.5 s", after=said_before)
    up.wait_said(rf"{name} restarted \(pid \d+\)", after=said_before)


def test_a_killed_decode_instance_is_started_again_and_the_cluster_serves_it(up):
    said, old = len(up.said), kill(up, "decode-0")
    wait_restarted(up, "decode-0", said)
    eventually(lambda: up.reload()["services"]["decode-0"]["pid"] != old and up.health("decode-0"),
               "decode-0 runs again", until=lambda health: health and health["status"] == "ok",
               timeout_s=60, ignoring=(OSError,))
    eventually(lambda: up.health("gateway")["decode_alive"], "the conductor sees both decode instances again",
               until=lambda alive: alive == 2, timeout_s=30)
    assert serving(up)


def test_killing_one_of_two_conductors_under_load_loses_no_request(up):
    assert up.health("conductor-0")["conductors"] == ["conductor-0", "conductor-1"]
    with Load(up.url) as load:
        eventually(lambda: len(load.answers), "some requests answered", until=lambda n: n >= 4, timeout_s=60)
        said = len(up.said)
        kill(up, "conductor-0")
        wait_restarted(up, "conductor-0", said)
        eventually(lambda: up.health("conductor-0"), "the conductor is back", timeout_s=60,
                   until=lambda health: health and health["decode_alive"] == 2, ignoring=(OSError,))
        answered = len(load.answers)
        eventually(lambda: len(load.answers), "requests after its return", until=lambda n: n >= answered + 4)
    answers = load.answers
    assert [(status, body) for status, body, _ in answers if status != 200] == []
    assert max(seconds for _, _, seconds in answers) < BOUND_S


def test_a_killed_nats_server_is_restarted_and_every_service_rejoins_it(up):
    with Load(up.url) as load:
        eventually(lambda: len(load.answers), "some requests answered", until=lambda n: n >= 4, timeout_s=60)
        said = len(up.said)
        kill(up, "nats-server")
        wait_restarted(up, "nats-server", said)
        answered = len(load.answers)
        eventually(lambda: [status for status, _, _ in load.answers[answered:]], "requests succeed again",
                   until=lambda statuses: statuses[-4:] == [200] * 4, timeout_s=60)
    answers = load.answers
    failed = [body["error"] for status, body, _ in answers if status != 200]
    assert all(error["type"] == "service_unavailable" for error in failed), failed  # failed fast and said so
    assert max(seconds for _, _, seconds in answers) < BOUND_S
    assert eventually(lambda: up.health("gateway"), "the gateway sees every engine again",
                      until=lambda health: (health["prefill_alive"], health["decode_alive"]) == (1, 2))


def test_kvs_meta_reconnects_to_a_restarted_redis_server(up):
    said = len(up.said)
    kill(up, "redis-server")
    wait_restarted(up, "redis-server", said)
    kvs_meta = up.reload()["services"]["kvs-meta"]["health_url"].replace("/health", "/ready")
    eventually(lambda: get_json(kvs_meta)[0], "kvs-meta answers /ready again", until=lambda status: status == 200,
               timeout_s=30, ignoring=(OSError,))
    assert serving(up)
