"""The conductor predicts from what the engines measure (`kvcentric up`: nats-server, redis, kvs-meta, conductor,
prefill, decode, gateway). The conductor's prior is a profile that says a decode step takes 10 s, so with the
default early rejection and a 0.1 s TBT SLO it would reject every request that joins a running batch: with that prior
alone (`--cost-source prior`) it predicts by it (a request alone is still served: the conductor never refuses TBT at
an idle decode instance, and under early rejection the decode instance does not double-check once the KV is there,
so what shows the prior is the conductor's predicted step against the one measured); by default the engines'
calibrated models replace it and the request is served, and /health shows each instance's measured model against
the prior. With calibration off and no profile the roofline prior only ranks: requests are placed, and the model
moves from the prior to the measured one as the engines serve."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from harness import UpProcess
from kvcentric.core.costmodel import CostModel
from kvcentric.model.config import preset
from waiting import eventually

TERRIBLE = CostModel((0.001, 1e-6, 0.0, 0.0), (10.0, 0.0, 0.0), preset("tiny").kv_bytes_per_token(4), "terrible")


def post(url: str, prompt: str = "Measured, not guessed", max_tokens: int = 8) -> tuple[int, dict]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def metrics(up: UpProcess, service: str) -> dict[str, float]:
    url = up.manifest["services"][service]["health_url"].replace("/health", "/metrics")
    with urllib.request.urlopen(url, timeout=5) as response:
        lines = response.read().decode().splitlines()
    return {line.split("{")[0].split()[0]: float(line.split()[-1]) for line in lines
            if line and not line.startswith("#")}


def conductor_metric(up: UpProcess, suffix: str) -> float:
    return next((v for k, v in metrics(up, "conductor-0").items() if k.endswith(suffix)), -1.0)


def models(up: UpProcess) -> dict[str, dict]:
    return up.health("conductor-0")["instances"]


@pytest.fixture(scope="module")
def terrible_profile(tmp_path_factory):
    path = tmp_path_factory.mktemp("profile") / "terrible.json"
    TERRIBLE.save(path)
    return str(path)


def test_with_only_the_terrible_prior_the_conductor_predicts_by_it(tmp_path, terrible_profile):
    up = UpProcess(str(tmp_path), "--conductors", "1", "--profile", terrible_profile, "--tbt-slo-s", "0.1",
                   env={"KVC_COST_SOURCE": "prior"})
    try:
        status, body = post(up.url)
        assert status == 200 and body["usage"]["completion_tokens"] == 8, body  # alone at an idle decode instance
        assert models(up)["decode-0"]["model_source"] == {"decode": "prior"}
        eventually(lambda: conductor_metric(up, "tbt_outcomes_total"), "the conductor compared predicted TBT",
                   until=lambda n: n >= 1)
        assert conductor_metric(up, "tbt_prediction_error_mean_s") > 9.0  # 10 s predicted, milliseconds measured
    finally:
        up.stop()


def test_the_measured_models_replace_the_prior_and_the_request_is_placed(tmp_path, terrible_profile):
    # The decode instances' TBT double-check (on by default) judges by `up`'s --profile, never by their own
    # measurement: with this deliberately terrible profile it would refuse every request. What is tested here
    # is the conductor replacing its prior, so the double-check is off.
    up = UpProcess(str(tmp_path), "--conductors", "1", "--profile", terrible_profile, "--tbt-slo-s", "0")
    try:
        # a calibration timed while the machine was busy is a guess until the engine measures itself again
        view = eventually(lambda: models(up), "both engines' measured models reached the conductor", timeout_s=90,
                          until=lambda v: all("fit_error" in v.get(i, {}) for i in ("prefill-0", "decode-0"))
                          and v["decode-0"]["model_source"] == {"decode": "measured"}
                          and v["prefill-0"]["model_source"] == {"prefill": "measured"})
        assert view["decode-0"]["model_source"] == {"decode": "measured"}
        assert view["prefill-0"]["model_source"] == {"prefill": "measured"}
        step = view["decode-0"]["decode_step"]
        assert step["prior_s"] >= 10.0 and 0 < step["predicted_s"] < 1.0 and step["measured_s"] < 1.0, step
        assert view["decode-0"]["samples"]["decode"] >= 3 and view["decode-0"]["device"] == "cpu"
        assert view["prefill-0"]["prefill_chunk"]["measured_s"] > 0
        for _ in range(3):
            status, body = post(up.url)
            assert status == 200 and body["usage"]["completion_tokens"] == 8, body
        eventually(lambda: conductor_metric(up, "tbt_outcomes_total"), "the conductor compared predicted TBT",
                   until=lambda n: n >= 3)
        assert conductor_metric(up, "tbt_prediction_rel_error_mean") >= 0
        assert conductor_metric(up, "ttft_prediction_rel_error_mean") >= 0
        python = [name for name, started in up.manifest["services"].items() if started.get("health_url")]
        assert {"gateway", "conductor-0", "kvs-meta", "prefill-0", "decode-0"} <= set(python), python
        for service in python:  # each froze what it had built at start (`freeze_heap`), and counts its faults
            gauges = metrics(up, service)
            assert gauges["kvc_gc_frozen_objects"] > 10_000, service
            assert gauges["kvc_minor_page_faults_total"] > 0, service
    finally:
        up.stop()


def test_without_calibration_the_prior_only_ranks_until_the_engines_have_measured(tmp_path):
    up = UpProcess(str(tmp_path), "--conductors", "1", env={"KVC_CALIBRATE": "0"})
    try:
        before = models(up)
        assert before["decode-0"] == {"model_source": {"decode": "guess"}}
        assert before["prefill-0"] == {"model_source": {"prefill": "guess"}}
        for _ in range(4):
            status, body = post(up.url, max_tokens=6)
            assert status == 200, body
        assert conductor_metric(up, "placements_unjudged_total") >= 1
        after = eventually(lambda: models(up), "the engines' models measured from serving reached the conductor",
                           until=lambda v: v["decode-0"]["model_source"] == {"decode": "measured"}
                           and v["prefill-0"]["model_source"] == {"prefill": "measured"})
        assert after["prefill-0"]["samples"]["prefill"] >= 3 and after["decode-0"]["fit_error"]["decode"] >= 0
    finally:
        up.stop()
