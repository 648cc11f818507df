"""PrfaaS §3.4.3 live: with the planner's profile (`--replan-profile`), a short-term trigger does not move t by
a fixed step but searches it again from the throughput model at the egress bandwidth the conductor measured.
Two datacenters on real servers (two nats-server processes joined by a gateway); the PrfaaS prefill's KV push
is held to a 0.01 Gbit/s link, so a few long prompts drive the link past its ceiling."""

from __future__ import annotations

import concurrent.futures
import json
import random
import urllib.request
from pathlib import Path

import pytest

from twodc import TwoDatacenters, TwoDCConfig
from waiting import eventually

PROFILE = Path(__file__).resolve().parents[2] / "bench" / "papers" / "prfaas_profile_table5.json"
PLANNED = 64


@pytest.fixture(scope="module")
def two_dcs(tmp_path_factory):
    config = TwoDCConfig(model="tiny", threshold=PLANNED, link_gbps=0.01, num_kv_blocks=512, adjust_s=0.5,
                         replan_profile=str(PROFILE), log_dir=str(tmp_path_factory.mktemp("2dc")))
    with TwoDatacenters(config) as dcs:
        yield dcs


def complete(url: str, n_tokens: int, seed: int) -> str:
    rng = random.Random(seed)
    body = json.dumps({"model": "tiny", "prompt": [rng.randrange(256) for _ in range(n_tokens)],
                       "max_tokens": 2, "temperature": 0, "ignore_eos": True}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        assert json.load(response)["usage"]["completion_tokens"] == 2
        return response.headers["x-kvcentric-prefill"]


def conductor_metric(two_dcs, name: str) -> float:
    value = two_dcs.metric("conductor", name)
    assert value is not None, f"kvc_{name} is not among the conductor's metrics"
    return value


def test_a_saturated_link_re_derives_t_from_the_model_at_the_measured_egress(two_dcs):
    assert conductor_metric(two_dcs, "prfaas_threshold_rederived_total") == 0
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # 12 x 600 KB at 1.25 MB/s: seconds of a full link
        prefills = list(pool.map(lambda seed: complete(two_dcs.url, 600, seed), range(12)))
    assert "prefill-prfaas-0" in prefills  # above the planned t: the long prompts went to PrfaaS at first
    changes = eventually(lambda: two_dcs.health("conductor")["prfaas"], "a short-term trigger re-derived t",
                         until=lambda prfaas: prfaas["routed"]["threshold_rederived"] >= 1, timeout_s=30)
    assert changes["routed"]["threshold_changes"] >= 1
    assert conductor_metric(two_dcs, "prfaas_threshold_rederived_total") >= 1
