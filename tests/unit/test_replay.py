"""The trace-replay tool without a cluster: hash ids to prompts, scaling, context fitting, SSE folding,
and the summary keys."""

from __future__ import annotations

import pytest

from kvcentric.config import ConfigError
from kvcentric.tools.replay import (ReplayConfig, block_tokens, plan, prompt_tokens, status_of, to_record, TOKEN_RANGE)
from kvcentric.tools.replay_http import Outcome, apply_event, completion_body
from kvcentric.core.sim.metrics import summarize
from kvcentric.core.sim.workload import SimRequest


def test_a_hash_id_always_becomes_the_same_block_and_different_ids_differ():
    assert block_tokens("7", 32, 0) == block_tokens("7", 32, 0)
    assert block_tokens("7", 32, 0) != block_tokens("8", 32, 0) != block_tokens("7", 32, 1)
    assert all(TOKEN_RANGE[0] <= t < TOKEN_RANGE[1] for t in block_tokens("7", 512, 0))


def test_prompts_share_exactly_the_blocks_their_hash_ids_share():
    a = prompt_tokens(["0", "1", "2"], 90, 32, 0)
    b = prompt_tokens(["0", "1", "5"], 96, 32, 0)
    assert len(a) == 90 and len(b) == 96
    assert a[:64] == b[:64] and a[64:90] != b[64:90]


def test_a_line_with_too_few_ids_is_padded_to_its_length():
    assert len(prompt_tokens(["0"], 100, 32, 0)) == 100


def test_scale_shrinks_blocks_and_prompts_and_the_prompt_gives_way_to_the_context():
    config = ReplayConfig(scale=16, output_scale=4)
    assert config.block_len == 32
    requests = [SimRequest("r0", 0.0, 6758, 500, [str(i) for i in range(14)]),
                SimRequest("r1", 0.5, 100_000, 400, [str(i) for i in range(196)])]
    short, long = plan(requests, config, max_model_len=2048)
    assert len(short.token_ids) == 423 and short.max_tokens == 125
    assert len(long.token_ids) == 2048 - 100 and long.max_tokens == 100
    assert short.token_ids[:32] == long.token_ids[:32]  # both start with hash id 0


def test_bad_settings_name_the_flag():
    with pytest.raises(ConfigError, match="--speed"):
        ReplayConfig(speed=0)
    with pytest.raises(ConfigError, match="--url"):
        ReplayConfig(url="localhost:8000")


def test_sse_events_fold_into_an_outcome():
    outcome = Outcome(sent=1.0)
    apply_event(outcome, {"choices": [{"text": "a", "finish_reason": None}]}, 1.5)
    apply_event(outcome, {"choices": [{"text": "b", "finish_reason": "length"}],
                          "usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11,
                                    "prompt_tokens_details": {"cached_tokens": 64}}}, 1.7)
    assert (outcome.first_token, outcome.finish, outcome.finish_reason) == (1.5, 1.7, "length")
    assert (outcome.completion_tokens, outcome.cached_tokens) == (2, 64)
    apply_event(outcome, {"error": {"message": "boom", "type": "server_error"}}, 1.8)
    assert outcome.error == "boom"


def test_completion_bodies_ask_for_exactly_the_trace_output_length():
    body = completion_body("tiny", [1, 2], 7)
    assert body["ignore_eos"] and body["max_tokens"] == 7 and body["stream_options"]["include_usage"]


def outcome(status=200, first=1.0, finish=2.0, tokens=11, error="", error_type="", cached=32) -> Outcome:
    return Outcome(0.0, first, finish, status, "length" if status == 200 and not error else "", tokens, 0, cached,
                   error, error_type)


def test_statuses_map_to_the_simulators_outcomes():
    assert status_of(outcome()) == "completed"
    assert status_of(outcome(429)) == "rejected_before_prefill"
    assert status_of(outcome(error="gone", error_type="rate_limit_exceeded")) == "rejected_after_prefill"
    assert status_of(outcome(504)) == status_of(outcome(error="boom")) == "failed"


def test_replayed_requests_summarize_with_the_simulators_keys():
    config = ReplayConfig(scale=16)
    planned = plan([SimRequest(f"r{i}", float(i), 64, 11, ["0", str(i + 1)]) for i in range(3)], config, 2048)
    outcomes = [outcome(first=0.5, finish=1.5), outcome(first=1.5, finish=3.5), outcome(429)]
    records = [to_record(p, o, 0.0, config.block_len) for p, o in zip(planned, outcomes)]
    summary = summarize(records, ttft_slo_s=1.0, tbt_slo_s=0.15)
    assert records[0].ttft_s == 0.5 and records[0].tbt_s == pytest.approx(0.1)
    assert summary["completed"] == 2 and summary["rejected_before_prefill"] == 1
    assert summary["completed_within_slo"] == 1  # the second one's TBT is 0.2 s
    assert summary["prefix_hit_ratio"] == pytest.approx(2 / 4)  # 32 cached tokens = one 32-token block of two
    for key in ("ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "tbt_p50_s", "tbt_p90_s", "tbt_p99_s",
                "slo_attainment", "goodput_rps", "requests", "rejected_after_prefill"):
        assert key in summary


def test_gaps_between_text_chunks_give_the_worst_gap_and_the_slow_ones():
    out = Outcome(sent=0.0)
    for now in (1.0, 1.05, 1.5, 1.55):
        apply_event(out, {"choices": [{"text": "x", "finish_reason": None}]}, now)
    apply_event(out, {"choices": [], "usage": {"completion_tokens": 4}}, 1.6)
    assert out.gaps == pytest.approx([0.05, 0.45, 0.05])
    record = to_record(plan([SimRequest("r", 0.0, 8, 4, ["0"])], ReplayConfig(), 2048)[0], out, 0.0, 512, 0.1)
    assert record.max_gap_s == pytest.approx(0.45) and record.slow_gaps == 1
