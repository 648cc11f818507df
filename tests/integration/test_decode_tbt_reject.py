"""The decode instance's TBT double-check on a real stack (`kvcentric up`: nats-server, redis, kvs-meta,
conductor with --rejection none, prefill, decode, gateway): a request whose KV has arrived and that would
push the predicted decode step over --tbt-slo-s is rejected after prefill with 429, its blocks freed, and
counted; a request within the SLO is served. `up` passes --tbt-slo-s, --prefill-chunk and --max-batch on.

The cost model is a profile file, so the cut is known: a decode step of one sequence lasts
10 ms + 0.1 ms per context token, so with the SLO at 50 ms a lone prompt of up to 399 tokens joins."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import pytest

from kvcentric.core.costmodel import CostModel
from harness import UpProcess
from kvcentric.model.config import preset
from kvcentric.model.tokenizer import ByteTokenizer

COST = CostModel((0.001, 1e-6, 0.0, 0.0), (0.01, 0.0, 1e-4), 4096, "test")
SLO_S = 0.05
SHORT = "Within the SLO"
LONG = "Mooncake rejects after prefill when decode is overloaded. " * 12
KV_BYTES_PER_TOKEN = preset("tiny").kv_bytes_per_token(4)
"""Of one token over all layers, in the engines' dtype (fp32 on CPU)."""


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    logs = tmp_path_factory.mktemp("up-tbt")
    profile = logs / "profile.json"
    COST.save(profile)
    up = UpProcess(str(logs), "--tbt-slo-s", str(SLO_S), "--profile", str(profile), "--prefill-chunk", "64",
                   "--max-batch", "8", env={"KVC_REJECTION": "none"})
    try:
        yield up
    finally:
        up.stop()


def post(url: str, prompt: str, stream: bool = False) -> tuple[int, dict]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "ignore_eos": True, "stream": stream}
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, {} if stream else json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def metrics(up: UpProcess, service: str) -> str:
    url = up.manifest["services"][service]["health_url"].replace("/health", "/metrics")
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


def argv(up: UpProcess, service: str) -> list[str]:
    """The service's command line as `ps` shows it (a service `up` forked carries it as its title, one string)."""
    with open(f"/proc/{up.manifest['services'][service]['pid']}/cmdline", "rb") as cmdline:
        return cmdline.read().decode().replace("\0", " ").split()


def test_the_cut_falls_between_the_two_prompts():
    short, long = (len(ByteTokenizer().encode(p)) for p in (SHORT, LONG))
    assert COST.t_decode(1, short + 1) < SLO_S < COST.t_decode(1, long + 1)


def test_up_passes_the_engine_flags_on(stack):
    decode, prefill = argv(stack, "decode-0"), argv(stack, "prefill-0")
    for flags in (decode, prefill):
        assert flags[flags.index("--prefill-chunk") + 1] == "64" and flags[flags.index("--max-batch") + 1] == "8"
    assert decode[decode.index("--tbt-slo-s") + 1] == str(SLO_S) and "--tbt-slo-s" not in prefill


def test_a_request_over_the_tbt_slo_is_rejected_after_its_kv_arrived_and_frees_its_blocks(stack):
    status, body = post(stack.url, SHORT)
    assert status == 200 and body["usage"]["completion_tokens"] == 4, body
    before = stack.health("decode-0")["stats"]
    computed_before = stack.health("prefill-0")["stats"]["prefill_tokens_computed"]

    status, body = post(stack.url, LONG)
    assert status == 429, body
    assert body["error"]["type"] == "rate_limit_exceeded"
    assert "rejected by decode for TBT" in body["error"]["message"] and f"{SLO_S:.3g} s" in body["error"]["message"]
    status, body = post(stack.url, LONG, stream=True)  # nothing was sent yet: the status holds for SSE too
    assert status == 429 and body["error"]["type"] == "rate_limit_exceeded", body

    n_long = len(ByteTokenizer().encode(LONG))
    after = stack.health("decode-0")["stats"]
    assert after["kv_blocks_free"] == after["kv_blocks_total"]
    assert after["requests_rejected_tbt"] - before["requests_rejected_tbt"] == 2
    assert after["kv_streams_committed"] == before["kv_streams_committed"]  # neither joined the batch
    assert after["kv_bytes_received"] - before["kv_bytes_received"] == 2 * n_long * KV_BYTES_PER_TOKEN
    # the prefill's work was done, and wasted
    assert stack.health("prefill-0")["stats"]["prefill_tokens_computed"] - computed_before >= n_long
    text = metrics(stack, "decode-0")
    assert re.search(r'^kvc_rejections_total\{[^}]*reason="tbt"[^}]*\} 2$', text, re.M), text

