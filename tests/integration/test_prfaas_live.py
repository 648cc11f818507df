"""Prefill-as-a-Service across two datacenters on real servers: two nats-server processes joined by a NATS
gateway, the PrfaaS prefill (rate-limited KV push) on one, the PD cluster on the other (a small version of
bench/papers/prfaas_live.py). Long prompts must prefill remotely, short ones locally, and decode stays local."""

from __future__ import annotations

import json
import random
import urllib.request

import pytest

from twodc import TwoDatacenters, TwoDCConfig
from waiting import eventually

from kvcentric.core.prfaas.routing import ShortTermPolicy

THRESHOLD = 64


@pytest.fixture(scope="module")
def two_dcs(tmp_path_factory):
    config = TwoDCConfig(model="tiny", threshold=THRESHOLD, link_gbps=0.01, num_kv_blocks=256,
                         log_dir=str(tmp_path_factory.mktemp("2dc")))
    with TwoDatacenters(config) as dcs:
        yield dcs


def complete(url: str, n_tokens: int, seed: int) -> tuple[int, str, str]:
    rng = random.Random(seed)
    body = json.dumps({"model": "tiny", "prompt": [rng.randrange(256) for _ in range(n_tokens)],
                       "max_tokens": 4, "temperature": 0, "ignore_eos": True}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        answer = json.load(response)
        assert answer["usage"]["completion_tokens"] == 4
        return response.status, response.headers["x-kvcentric-prefill"], response.headers["x-kvcentric-decode"]


def test_the_two_nats_servers_are_joined_by_a_gateway_and_services_see_across_it(two_dcs):
    assert two_dcs.gateways_connected()
    assert two_dcs.health("prefill-prfaas-0")["cluster"] == "prfaas"
    conductor = two_dcs.health("conductor")
    assert conductor["prefill_alive"] == 2 and conductor["prfaas"]["local"] == "pd"


def test_long_prompts_prefill_in_the_prfaas_cluster_and_short_ones_locally(two_dcs):
    before = two_dcs.health("prefill-prfaas-0")["stats"].get("push_bytes_streamed", 0)
    results = {n: complete(two_dcs.url, n, seed) for seed, n in enumerate((200, 20, 300, 40))}
    assert all(status == 200 for status, _, _ in results.values())
    assert {n: prefill for n, (_, prefill, _) in results.items()} == {
        200: "prefill-prfaas-0", 20: "prefill-pd-0", 300: "prefill-prfaas-0", 40: "prefill-pd-0"}
    assert {decode for _, _, decode in results.values()} == {"decode-pd-0"}
    prfaas = two_dcs.health("prefill-prfaas-0")
    kv_bytes_per_token = 4 * 2 * 2 * 16 * 4  # tiny: layers x (K, V) x kv heads x head dim x fp32
    assert prfaas["stats"]["push_bytes_streamed"] - before == (200 + 300) * kv_bytes_per_token
    assert prfaas["link_bandwidth"]  # the measured egress rate to the PD decode instance
    routed = two_dcs.health("conductor")["prfaas"]["routed"]
    assert routed["routed_prfaas"] == 2 and routed["routed_pd"] == 2


def decode_counter(two_dcs, name: str) -> float:
    return two_dcs.metric("decode-pd-0", name) or 0.0


def conductor_gauge(two_dcs, name: str) -> float:
    return two_dcs.metric("conductor", name) or 0.0


def indexed(two_dcs, blocks: float) -> None:
    """Wait until the conductor's block index (`--prefix-index local`) holds at least `blocks` blocks."""
    eventually(lambda: conductor_gauge(two_dcs, "prefix_index_blocks"), f"{blocks:g} blocks in the index",
               until=lambda held: held >= blocks)


def link_drained(two_dcs) -> None:
    """Wait until no PrfaaS cluster's egress counts as scarce (`ShortTermPolicy.scarce_above`): the link's
    measured use decays once its pushes end."""
    scarce = ShortTermPolicy().scarce_above
    eventually(lambda: two_dcs.health("conductor")["prfaas"]["egress_utilization"], "the link's egress drained",
               until=lambda use: all(value <= scarce for value in use.values()))


def complete_tokens(url: str, token_ids: list[int]) -> tuple[str, str, list[int]]:
    body = json.dumps({"model": "tiny", "prompt": token_ids, "max_tokens": 6, "temperature": 0,
                       "ignore_eos": True, "logprobs": 1}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        answer = json.load(response)
        tokens = answer["choices"][0]["logprobs"]["tokens"]
        return response.headers["x-kvcentric-prefill"], response.headers["x-kvcentric-decode"], tokens


def test_only_the_uncached_part_of_a_prompts_kv_crosses_the_link(two_dcs):
    """PrfaaS §3.3: a 48-token prefix cached in the PD cluster stays there; the PrfaaS prefill ships only the
    200 tokens after it and the decode instance pulls the prefix from the PD prefill instance. The answer is
    the one the same prompt gets when it is prefilled locally afterwards."""
    rng = random.Random(99)
    prefix = [rng.randrange(256) for _ in range(48)]  # 3 blocks of 16, <= t: prefilled (and cached) in pd
    held = conductor_gauge(two_dcs, "prefix_index_blocks")
    assert complete_tokens(two_dcs.url, prefix)[0] == "prefill-pd-0"
    indexed(two_dcs, held + 3)  # announced from the PD instance's device cache; its host pool, which serves the
    # decode's pull, may take the blocks a little later (the pull asks again meanwhile: `transfer.FETCH_RETRIES_S`)
    prompt = prefix + [rng.randrange(256) for _ in range(200)]
    sent = two_dcs.health("prefill-prfaas-0")["stats"].get("push_bytes_streamed", 0)
    pulled = decode_counter(two_dcs, "prefix_tokens_pulled_total")
    prefill, decode, remote_answer = complete_tokens(two_dcs.url, prompt)
    assert (prefill, decode) == ("prefill-prfaas-0", "decode-pd-0")
    kv_bytes_per_token = 4 * 2 * 2 * 16 * 4  # tiny: layers x (K, V) x kv heads x head dim x fp32
    assert two_dcs.health("prefill-prfaas-0")["stats"]["push_bytes_streamed"] - sent == 200 * kv_bytes_per_token
    assert decode_counter(two_dcs, "prefix_tokens_pulled_total") - pulled == 48
    assert two_dcs.health("conductor")["prfaas"]["routed"]["kv_tokens_kept_local"] >= 48
    indexed(two_dcs, held + 3 + 12)  # the 12 new full blocks the PrfaaS prefill computed
    link_drained(two_dcs)  # a link still busy with that push would route by the PD cluster's prefix alone
    prefill, _, local_answer = complete_tokens(two_dcs.url, prompt)  # now cached in both clusters: l = 8 <= t
    assert prefill == "prefill-pd-0" and local_answer == remote_answer
