"""Mooncake §7's TBT double-check is on by default, relative to the decode instance's own speed (issue 48): a
stack started without --tbt-slo-s (`kvcentric up`, real nats-server, redis, kvs-meta, conductor with --rejection
none, prefill, decode, gateway) holds decode to 5x the unloaded step of each request, so a request alone is never
refused however slow its step. The cost model is a profile file, so the steps are known: one sequence's decode step
lasts 10 ms + 0.2 ms per context token, so the long prompt's lone step (over 0.1 s, the old absolute default that
refused it) is within 5x itself, and is served."""

from __future__ import annotations

import pytest

from kvcentric.core.costmodel import CostModel
from kvcentric.model.tokenizer import ByteTokenizer
from harness import UpProcess
from test_decode_tbt_reject import LONG, SHORT, argv, post

COST = CostModel((0.001, 1e-6, 0.0, 0.0), (0.01, 0.0, 2e-4), 4096, "test")
OLD_DEFAULT_SLO_S = 0.1


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


def test_the_long_prompt_alone_steps_slower_than_the_old_default():
    short, long = (len(ByteTokenizer().encode(p)) for p in (SHORT, LONG))
    assert COST.t_decode(1, short + 1) < OLD_DEFAULT_SLO_S < COST.t_decode(1, long + 1)


def test_without_the_flag_decode_checks_relative_to_its_speed_and_serves_a_request_alone(stack):
    decode = argv(stack, "decode-0")
    assert decode[decode.index("--tbt-slo-s") + 1] == "0.0"  # relative: 5x the unloaded step
    for prompt in (SHORT, LONG):
        status, body = post(stack.url, prompt)
        assert status == 200 and body["usage"]["completion_tokens"] == 4, body
    assert stack.health("decode-0")["stats"].get("requests_rejected_tbt", 0) == 0
