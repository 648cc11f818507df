"""Mooncake §7's TBT double-check is on by default: a stack started without --tbt-slo-s (`kvcentric up`,
real nats-server, redis, kvs-meta, conductor with --rejection none, prefill, decode, gateway) holds decode to
0.1 s (§8.1's TBT SLO). The cost model is a profile file, so the cut is known: one sequence's decode step
lasts 10 ms + 0.2 ms per context token, so a lone prompt of up to 449 tokens joins and a longer one is
rejected after its prefill, with 429."""

from __future__ import annotations

import pytest

from kvcentric.core.costmodel import CostModel
from kvcentric.model.tokenizer import ByteTokenizer
from harness import UpProcess
from test_decode_tbt_reject import LONG, SHORT, argv, post

COST = CostModel((0.001, 1e-6, 0.0, 0.0), (0.01, 0.0, 2e-4), 4096, "test")
DEFAULT_SLO_S = 0.1


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    logs = tmp_path_factory.mktemp("up-tbt-default")
    profile = logs / "profile.json"
    COST.save(profile)
    up = UpProcess(str(logs), "--profile", str(profile), env={"KVC_REJECTION": "none"})
    try:
        yield up
    finally:
        up.stop()


def test_the_cut_falls_between_the_two_prompts():
    short, long = (len(ByteTokenizer().encode(p)) for p in (SHORT, LONG))
    assert COST.t_decode(1, short + 1) < DEFAULT_SLO_S < COST.t_decode(1, long + 1)


def test_without_the_flag_decode_rejects_a_request_over_0_1_s_and_serves_one_within(stack):
    decode = argv(stack, "decode-0")
    assert decode[decode.index("--tbt-slo-s") + 1] == str(DEFAULT_SLO_S)
    status, body = post(stack.url, SHORT)
    assert status == 200 and body["usage"]["completion_tokens"] == 4, body
    status, body = post(stack.url, LONG)
    assert status == 429 and "rejected by decode for TBT" in body["error"]["message"], body
    assert stack.health("decode-0")["stats"]["requests_rejected_tbt"] == 1
