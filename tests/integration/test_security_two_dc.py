"""The two-datacenter PrfaaS layout secured, on real servers: each datacenter's nats-server with TLS and the users
of `kvcentric up --secure`, the NATS gateway between them over mutual TLS, the KV pushed from the PrfaaS cluster to
the PD decode instance over mutual TLS, the gateway on HTTPS with an API key. Long prompts still prefill remotely
and short ones locally (as tests/integration/test_prfaas_live.py checks on the plain layout)."""

from __future__ import annotations

import json
import os
import random
import urllib.request

import pytest

from kvcentric.tools.processes import get_json
from twodc import PD, PRFAAS, TwoDatacenters, TwoDCConfig

pytestmark = pytest.mark.timeout(300)
THRESHOLD = 64


@pytest.fixture(scope="module")
def two_dcs(tmp_path_factory):
    config = TwoDCConfig(model="tiny", threshold=THRESHOLD, link_gbps=0.01, num_kv_blocks=256,
                         log_dir=str(tmp_path_factory.mktemp("2dc-secure")), secure=True)
    with TwoDatacenters(config) as dcs:
        yield dcs


def complete(dcs: TwoDatacenters, n_tokens: int, seed: int) -> tuple[str, str]:
    rng = random.Random(seed)
    body = json.dumps({"model": "tiny", "prompt": [rng.randrange(256) for _ in range(n_tokens)], "max_tokens": 4,
                       "temperature": 0, "ignore_eos": True}).encode()
    with open(dcs.secure.api_keys) as keys:
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {keys.readline().strip()}"}
    request = urllib.request.Request(f"{dcs.url}/v1/completions", body, headers)
    with urllib.request.urlopen(request, timeout=60, context=dcs.tls) as response:
        assert json.load(response)["usage"]["completion_tokens"] == 4
        return response.headers["x-kvcentric-prefill"], response.headers["x-kvcentric-decode"]


def test_the_datacenters_nats_servers_are_joined_over_mutual_tls(two_dcs):
    assert two_dcs.url.startswith("https://") and all(url.startswith("tls://") for url in two_dcs.nats_urls.values())
    assert two_dcs.gateways_connected()
    for name, other in ((PD, PRFAAS), (PRFAAS, PD)):
        body = get_json(f"{two_dcs.monitor_urls[name]}/gatewayz", timeout_s=5.0)[1]
        connection = body["outbound_gateways"][other]["connection"]
        assert connection.get("tls_version"), connection  # the link between the datacenters is TLS
    config = open(os.path.join(two_dcs.log_dir, "nats-pd.conf")).read()
    assert "verify: true" in config.split("gateways: [")[0]  # each side takes only the deployment CA's peers


def test_long_prompts_prefill_across_the_secured_link_and_short_ones_locally(two_dcs):
    routed = {n: complete(two_dcs, n, seed) for seed, n in enumerate((200, 20))}
    assert routed == {200: ("prefill-prfaas-0", "decode-pd-0"), 20: ("prefill-pd-0", "decode-pd-0")}
    prfaas = two_dcs.health("prefill-prfaas-0")
    assert prfaas["stats"]["push_bytes_streamed"] > 0  # its KV crossed to the PD decode instance, over mutual TLS
