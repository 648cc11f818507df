"""docker-compose.prfaas.yml (Prefill-as-a-Service, two datacenters) secured by docker-compose.prfaas.secure.yml,
for real, on a Docker daemon: the block of docs/operations.md run as written (a long prompt over HTTPS with the API
key, prefilled in datacenter B), then a short prompt prefilled in datacenter A, the KV of the long one pushed
across to A's decode instance over mutual TLS, the NATS gateway between the datacenters over TLS both ways, and
each datacenter's nats-server taking no client without a certificate and credentials. What it measured goes to
build/compose-prfaas-secure-check.json for docs/operations.md.

Skipped as tests/deploy/test_compose_live.py is: where no Docker daemon answers, and unless KVC_COMPOSE_CHECK=1
(`make compose-check`). Pinned images can be pointed elsewhere with the variables docker-compose.yml names.
"""

from __future__ import annotations

import json
import os
import ssl
import time
import urllib.request

import pytest

from composing import (LIVE, ROOT, Project, as_owner_edits, doc_block, probe_nats, refused_all_but_the_user, run_block,
                       secured_project)

pytestmark = LIVE
REPORT = ROOT / "build" / "compose-prfaas-secure-check.json"
MATERIAL_BLOCK = "docker compose -f docker-compose.yml -f docker-compose.secure.yml up"
BLOCK = "docker compose -f docker-compose.prfaas.yml -f docker-compose.prfaas.secure.yml up"
"""The keys of the documented blocks this runs: the first makes the material (its `kvcentric certs` line only),
the second brings the two datacenters up and sends the long prompt."""


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    material = tmp_path_factory.mktemp("secure") / "out"
    project = secured_project("kvc-prfaas-secure", ["docker-compose.prfaas.yml", "docker-compose.prfaas.secure.yml"],
                              material)
    certs = [line for line in doc_block(MATERIAL_BLOCK).replace("\\\n", " ").splitlines()
             if line.startswith("kvcentric certs ")]
    owner = [line for line in doc_block(MATERIAL_BLOCK).splitlines() if line.startswith("export KVC_UID")]
    run_block("\n".join(certs + owner) + "\n", [("deploy/secure/out", str(material)), *as_owner_edits(material)],
              project.env, timeout_s=120)
    if os.getuid() != 0:  # the block above exported them in its own shell
        project.env.update(KVC_UID=str(os.getuid()), KVC_GID=str(os.getgid()))
    started = time.monotonic()
    project.compose("build", timeout_s=1800)
    project.measured["build_s"] = round(time.monotonic() - started, 1)
    try:
        output, took = run_block(doc_block(BLOCK), [("deploy/secure/out", str(material)),
                                                    ("localhost:8000", f"localhost:{project.gateway_port}")],
                                 project.env, timeout_s=900)
        project.measured["block_s"] = took
        project.measured["healthy_s"] = project.seconds_to_healthy()
        project.block_output = output
        yield project
    finally:
        project.measured["load_average"] = [round(x, 2) for x in os.getloadavg()]
        project.report(REPORT)
        project.down()


def complete(stack: Project, prompt: str) -> tuple[str, str]:
    with open(stack.material / "api-keys") as keys:
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {keys.readline().strip()}"}
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}).encode()
    context = ssl.create_default_context(cafile=str(stack.material / "ca.pem"))
    request = urllib.request.Request(stack.url + "/v1/completions", body, headers)
    with urllib.request.urlopen(request, timeout=120, context=context) as response:
        assert json.load(response)["usage"]["completion_tokens"] == 4
        return response.headers["x-kvcentric-prefill"], response.headers["x-kvcentric-decode"]


def test_the_documented_long_prompt_is_prefilled_in_the_other_datacenter(stack):
    expected = [line.lstrip("# ").strip() for line in doc_block(BLOCK).splitlines()
                if line.startswith("# x-kvcentric-prefill")]
    assert expected == ["x-kvcentric-prefill: prefill-prfaas-0"]
    assert stack.block_output.strip().splitlines()[-1].lower() == expected[0]  # after compose's own lines
    prfaas = stack.health("prefill-prfaas")
    assert prfaas["cluster"] == "prfaas" and prfaas["stats"]["push_bytes_streamed"] > 0  # to decode-pd, over mTLS


def test_short_prompts_prefill_at_home_and_long_ones_across_the_secured_link(stack):
    assert complete(stack, "Hello") == ("prefill-pd-0", "decode-pd-0")
    assert complete(stack, "a long and new prompt " * 30) == ("prefill-prfaas-0", "decode-pd-0")


def test_the_nats_gateway_between_the_datacenters_is_tls_both_ways(stack):
    read = "import urllib.request as u; print(u.urlopen('http://127.0.0.1:8222/gatewayz', timeout=5).read().decode())"
    for side, other in (("pd", "prfaas"), ("prfaas", "pd")):
        body = json.loads(stack.compose("exec", "-T", f"nats-{side}", "python3", "-c", read).stdout)
        assert body["outbound_gateways"][other]["connection"]["tls_version"], body
        assert all(c["connection"]["tls_version"] for c in body["inbound_gateways"][other]), body


def test_neither_datacenters_nats_takes_a_client_without_a_certificate_and_credentials(stack):
    refused_all_but_the_user(probe_nats(stack, "gateway", "nats-pd", "gateway"))
    refused_all_but_the_user(probe_nats(stack, "prefill-prfaas", "nats-prfaas", "engine"))
