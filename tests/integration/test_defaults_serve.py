"""Defaults that serve (issue 48), on real clusters (`kvcentric up --colocated 1` of `small`: nats-server, redis,
kvs-meta, conductor, gateway, one colocated engine). The engine's timed model calls are made slower on purpose
(`--slow-step-s` while `--slow-while-file` exists), as on a machine busy with other work:

- while they are slow it times them slow; within 10 s of the delay ending it serves again at absolute SLOs that
  the slow timings would break, and the conductor never predicts with the slow model as a measurement meanwhile
  (a calibration on a busy machine is a guess, measured again while idle);
- an engine whose every step takes longer than 100 ms serves a lone request at the default SLOs (relative to the
  unloaded speed, here a profile's 150 ms step), and its stream, longer than the gateway's --request-timeout-s,
  completes (a timeout of silence, not of length); the SLOs in force are in the conductor's /health and in `up`'s
  ready line."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

from harness import UpProcess
from kvcentric.core.costmodel import CostModel
from waiting import eventually

HEAL_S = 10.0


def post(url: str, max_tokens: int = 4, stream: bool = False) -> tuple[int, dict, str]:
    body = {"model": "small", "prompt": "a lone request", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": stream}
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, dict(response.headers), response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read().decode()


def view(up: UpProcess) -> dict:
    """The conductor's view of the colocated engine's model (where it comes from, its latest timings)."""
    return up.health("conductor-0")["instances"].get("colocated-0", {})


@pytest.fixture
def slow_switch(tmp_path):
    switch = tmp_path / "slow"
    switch.touch()
    return switch


def stale(shown: dict, slow_s: float) -> bool:
    """Whether the conductor judges the engine by a slow model as a measurement (a guess is not judged)."""
    trusted = all(source in ("measured", "peer", "prior") for source in shown.get("model_source", {}).values())
    predicted = [shown.get(part, {}).get("predicted_s", 0.0) for part in ("decode_step", "prefill_chunk")]
    return trusted and max(predicted) >= slow_s / 2


def test_an_engine_measured_slow_on_purpose_serves_again_within_10_s_of_the_delay_ending(tmp_path, slow_switch):
    slow_s = 0.4
    up = UpProcess(str(tmp_path / "up"), "--colocated", "1", "--model", "small", "--conductors", "1", timeout_s=240,
                   env={"KVC_SLOW_STEP_S": str(slow_s), "KVC_SLOW_WHILE_FILE": str(slow_switch),
                        "KVC_TTFT_SLO_S": "2.0", "KVC_TBT_SLO_S": "0.3"})
    try:
        slowed = eventually(lambda: view(up), "a model of the slowed engine", timeout_s=60, every_s=0.5,
                            until=lambda shown: "decode_step" in shown)
        assert slowed["decode_step"]["measured_s"] >= slow_s, slowed  # what it timed was slow
        slow_switch.unlink()
        ended = time.monotonic()
        served = eventually(lambda: post(up.url), "a request served after the delay ended", timeout_s=HEAL_S,
                            every_s=0.2, until=lambda answer: answer[0] == 200)
        assert time.monotonic() - ended < HEAL_S, served
        shown = view(up)
        assert not stale(shown, slow_s), shown
        answers = [post(up.url) for _ in range(3)]  # one after the other: none refused on a stale estimate
        assert [status for status, _, _ in answers] == [200, 200, 200], answers
    finally:
        up.stop()


def test_an_engine_slower_than_100_ms_a_step_serves_a_lone_request_and_a_stream_past_the_timeout(tmp_path,
                                                                                                 slow_switch):
    slow_s, silence_s, tokens = 0.15, 4.0, 60  # at least 9 s of stream
    profile = tmp_path / "profile.json"
    CostModel((0.05, 1e-4, 0.0, 0.0), (slow_s, 0.0, 0.0), 16384, "slow").save(profile)
    up = UpProcess(str(tmp_path / "up"), "--colocated", "1", "--model", "small", "--conductors", "1", "--profile",
                   str(profile), timeout_s=240,
                   env={"KVC_SLOW_STEP_S": str(slow_s), "KVC_SLOW_WHILE_FILE": str(slow_switch),
                        "KVC_REQUEST_TIMEOUT_S": str(silence_s)})
    try:
        assert "SLOs: TTFT 10x unloaded" in up.ready_line and "TBT 5x unloaded" in up.ready_line, up.ready_line
        slos = up.health("conductor-0")["slos"]
        assert slos["ttft"]["mode"] == slos["tbt"]["mode"] == "relative" and slos["tbt"]["s"] >= 5 * slow_s, slos
        status, headers, text = post(up.url)
        assert status == 200, (status, text)
        assert float(headers["x-kvcentric-tbt-slo-s"]) >= 5 * slow_s > 0.1, headers  # steps over the old 100 ms
        started = time.monotonic()
        status, headers, text = post(up.url, max_tokens=tokens, stream=True)
        took = time.monotonic() - started
        assert status == 200 and text.rstrip().endswith("data: [DONE]") and '"error"' not in text, (status, text)
        assert took > 2 * silence_s, took  # longer than the timeout, which only counts silence
    finally:
        up.stop()
