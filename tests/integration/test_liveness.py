"""Busy is not dead: a prefill pushing a 16K-token prompt's KV to a slow decode instance stays alive in
the conductor's view and requests sent meanwhile are placed; an engine whose event loop is held stays
alive (its heartbeat thread reports); a stopped process is dead after --stale-after-s and back once it
goes on."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest

from checkpoints import build_checkpoint
from harness import UpProcess, spawn_service
from kvcentric.engine.config import EngineConfig
from kvcentric.tools.processes import get_json
from kvc_prefill.service import PrefillService

pytestmark = pytest.mark.integration

PROMPT_TOKENS = 16384


def complete(url: str, body: dict, timeout_s: float = 300.0) -> tuple[int, str]:
    """(HTTP status, error message or "") of one completion."""
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            json.load(response)
            return response.status, ""
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}").get("error", {}).get("message", "")


class AliveWatch:
    """Polls a conductor's /health in a thread: the fewest prefill instances it counted alive."""

    def __init__(self, health_url: str, period_s: float = 0.05) -> None:
        self.health_url, self.period_s = health_url, period_s
        self.counts: list[int] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self) -> None:
        while not self.done.is_set():
            self.counts.append(get_json(self.health_url, timeout_s=2.0)[1]["prefill_alive"])
            time.sleep(self.period_s)

    def stop(self) -> list[int]:
        self.done.set()
        self.thread.join(5)
        return self.counts


def wait_prefill_alive(health_url: str, alive: bool, timeout_s: float = 15.0) -> float:
    """Seconds until the conductor counts (or no longer counts) a prefill instance alive."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if bool(get_json(health_url)[1]["prefill_alive"]) == alive:
            return time.monotonic() - started
        time.sleep(0.05)
    raise AssertionError(f"the conductor did not see the prefill {'alive' if alive else 'dead'} in {timeout_s} s")


@pytest.fixture(scope="module")
def slow_link_cluster(tmp_path_factory):
    """1 prefill + 1 decode serving a tiny checkpoint with a 16K+ context, KV pushes capped at 0.02 Gbit/s
    (the 12 MiB of a 16K prompt take about 5 s to reach the decode instance)."""
    checkpoint = build_checkpoint(tmp_path_factory.mktemp("ckpt-16k"), "llama",
                                  max_position_embeddings=PROMPT_TOKENS + 256)
    blocks = str(PROMPT_TOKENS // 16 + 256)
    up = UpProcess(str(tmp_path_factory.mktemp("up-liveness")), "--model", str(checkpoint),
                   "--num-kv-blocks", blocks, env={"KVC_KV_RATE_LIMIT_GBPS": "0.02", "KVC_HOST_POOL_MB": "0",
                                                  "KVC_TTFT_SLO_S": "3600"})  # liveness, not admission
    try:
        yield up
    finally:
        up.stop()


def test_a_prefill_pushing_16k_tokens_to_a_slow_decode_stays_alive_and_requests_meanwhile_are_placed(
        slow_link_cluster):
    up = slow_link_cluster
    watch = AliveWatch(up.manifest["services"]["conductor-0"]["health_url"])
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        started = time.monotonic()
        long = pool.submit(complete, up.url, {"prompt": [3 + i % 250 for i in range(PROMPT_TOKENS)],
                                              "max_tokens": 1})
        short = []
        while not long.done():
            time.sleep(0.4)
            short.append(pool.submit(complete, up.url, {"prompt": "busy is not dead", "max_tokens": 2}))
        took_s = time.monotonic() - started
        outcomes = [f.result() for f in short]
    counts = watch.stop()
    assert long.result() == (200, "")
    assert took_s > 3.0, f"the push took {took_s:.1f} s: the receiver was not slow, nothing was tested"
    assert min(counts) == 1, f"the conductor counted no prefill alive in {counts.count(0)} of {len(counts)} polls"
    assert outcomes and all(status == 200 for status, _ in outcomes), sorted(set(outcomes))
    stats = up.health(next(n for n in up.manifest["services"] if n.startswith("prefill")))["stats"]
    assert stats["heartbeats_total"] > 0


def test_a_stopped_prefill_is_dead_after_stale_after_s_and_alive_again_once_it_goes_on(slow_link_cluster):
    up = slow_link_cluster
    health_url = up.manifest["services"]["conductor-0"]["health_url"]
    prefill = next(s for name, s in up.manifest["services"].items() if name.startswith("prefill"))
    os.kill(prefill["pid"], signal.SIGSTOP)
    try:
        assert wait_prefill_alive(health_url, alive=False) < 5.0
        assert complete(up.url, {"prompt": "anyone there", "max_tokens": 2}) == \
            (503, "no prefill instance is alive")
    finally:
        os.kill(prefill["pid"], signal.SIGCONT)
    wait_prefill_alive(health_url, alive=True)
    assert complete(up.url, {"prompt": "back again", "max_tokens": 2})[0] == 200


async def test_an_engine_whose_event_loop_is_held_stays_alive_in_the_conductors_view(own_nats):
    """The loop held for 3 s (as by a long copy or serialization on it): without a heartbeat thread of
    its own the prefill would miss two --stale-after-s windows."""
    conductor, port = spawn_service("conductor", own_nats, "--stale-after-s", "1.0")
    health_url = f"http://127.0.0.1:{port}/health"
    try:
        service = PrefillService(EngineConfig(nats_url=own_nats, model="tiny", num_kv_blocks=64))
        try:
            await service.open()
            await asyncio.to_thread(wait_prefill_alive, health_url, True)
            watch = AliveWatch(health_url)
            time.sleep(3.0)  # holds this event loop, the service's
            counts = watch.stop()
            assert counts and min(counts) == 1, f"prefill dead in {counts.count(0)} of {len(counts)} polls"
        finally:
            await service.close()
        assert await asyncio.to_thread(wait_prefill_alive, health_url, False) < 3.0
    finally:
        conductor.terminate()
        conductor.wait(10)
