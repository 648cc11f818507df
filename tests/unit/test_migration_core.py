"""Request migration's decisions: which instances a request waits on, when one is silent, which error chunks
migrate, how many times, and the continuation that goes on after the tokens already streamed."""

from __future__ import annotations

import pytest

from kvcentric.core.migration import (Failure, InstanceWatch, MigrationPolicy, chunk_failure, continuation, history,
                                      culprit_search, silent_failure, waited_on)
from kvcentric.core.protocol import Placement, SamplingParams, ScheduleRequest, TokenChunk

PLACED = Placement(request_id="r1", prefill_id="p0", decode_id="d0", decode_kv_addr="a:1")


def watch_with(*heard: tuple[str, float], silent_after_s: float = 1.5) -> InstanceWatch:
    watch = InstanceWatch(silent_after_s)
    for instance_id, at in heard:
        watch.heard_from(instance_id, at)
    return watch


def test_a_request_waits_on_prefill_and_decode_before_its_first_token_and_on_decode_after():
    assert waited_on(PLACED, 0) == ("p0", "d0")
    assert waited_on(PLACED, 3) == ("d0",)


def test_a_colocated_placement_waits_on_its_one_instance_once():
    colocated = Placement(request_id="r1", prefill_id="c0", decode_id="c0", decode_kv_addr="a:1")
    assert waited_on(colocated, 0) == ("c0",)


def test_an_instance_not_heard_for_silent_after_s_while_others_are_is_silent():
    watch = watch_with(("d0", 10.0), ("p0", 12.0))
    assert not watch.silent("d0", 11.4)
    assert watch.silent("d0", 12.0)
    assert watch.silence_s("d0", 12.0) == pytest.approx(2.0)


def test_nobody_heard_is_not_silence_until_three_times_as_long():
    """A gateway whose loop stalled or that lost the bus hears nobody: that alone kills no instance."""
    watch = watch_with(("d0", 10.0), ("p0", 10.0))
    assert not watch.silent("d0", 13.0)
    assert watch.silent("d0", 14.6)


def test_an_instance_placed_on_but_never_heard_has_silent_after_s_from_its_placement():
    watch = watch_with(("p0", 10.0))
    watch.expect("d9", 10.0)
    watch.heard_from("p0", 11.0)
    assert not watch.silent("d9", 11.0)
    watch.heard_from("p0", 12.0)
    assert watch.silent("d9", 12.0)
    assert not watch.silent("never-placed", 100.0)


def test_a_silent_decode_fails_its_requests_and_a_silent_prefill_only_those_without_a_token():
    watch = watch_with(("p0", 10.0), ("d0", 10.0), ("p1", 12.0))
    failure = silent_failure(PLACED, 5, watch, 12.0)
    assert failure is not None and failure.reason == "decode_silent" and failure.instance_id == "d0"
    watch.heard_from("d0", 12.0)
    assert silent_failure(PLACED, 5, watch, 12.0) is None
    prefill_gone = silent_failure(PLACED, 0, watch, 12.0)
    assert prefill_gone is not None and prefill_gone.reason == "prefill_silent"
    assert prefill_gone.silence_s == pytest.approx(2.0)


def test_an_instance_restarted_faster_than_silence_fails_what_was_placed_on_it_before():
    """A supervisor (`kvcentric up`) may start a killed engine again within a second, under the same id: it is
    never silent for `silent_after_s`, but its heartbeat ticks begin again, and what the old process held is gone."""
    watch = InstanceWatch(1.5)
    for tick, at in enumerate((10.0, 10.1, 10.2), start=1):
        watch.heard_from("d0", at, tick)
        watch.heard_from("p0", at, tick)
    placed_at = 10.15
    assert silent_failure(PLACED, 5, watch, 10.3, placed_at) is None
    watch.heard_from("d0", 11.0, 1)  # a new process: its ticks count from 1 again
    failure = silent_failure(PLACED, 5, watch, 11.0, placed_at)
    assert failure is not None and failure.reason == "decode_silent" and failure.instance_id == "d0"
    assert "restarted" in failure.message and failure.silence_s == pytest.approx(0.85)
    assert silent_failure(PLACED, 5, watch, 11.1, placed_at=11.05) is None  # placed on the new process
    assert culprit_search(PLACED, 5, watch, since=10.9, now=11.0, placed_at=placed_at) == failure


def test_reports_without_ticks_or_with_rising_ticks_are_never_a_restart():
    watch = InstanceWatch(1.5)
    for at in (10.0, 10.1, 10.2):
        watch.heard_from("d0", at)  # a sender without a heartbeat thread: tick 0
    watch.heard_from("d0", 10.3, 7)
    watch.heard_from("d0", 10.4, 8)
    watch.heard_from("d0", 10.5)
    colocated = Placement(request_id="r1", prefill_id="c0", decode_id="c0", decode_kv_addr="a:1")
    for tick, at in ((1, 10.0), (2, 10.1), (3, 10.2)):  # one instance reporting as prefill and as decode
        watch.heard_from("c0", at, tick, "kvc.load.prefill.c0")
        watch.heard_from("c0", at, tick, "kvc.load.decode.c0")
    assert silent_failure(PLACED, 5, watch, 10.5, placed_at=9.0) is None
    assert silent_failure(colocated, 5, watch, 10.5, placed_at=9.0) is None


@pytest.mark.parametrize("status, migrates", [(500, True), (503, True), (429, False)])
def test_5xx_error_chunks_may_migrate_and_overload_does_not(status, migrates):
    chunk = TokenChunk.failed("r1", "KV transfer failed: push did not complete", prompt_tokens=5, status=status)
    failure = chunk_failure(chunk)
    assert (failure is not None) == migrates
    if failure is not None:
        assert failure.reason == "engine_error" and "KV transfer failed" in failure.message


def test_the_culprit_of_an_error_chunk_is_the_instance_that_goes_silent():
    watch = watch_with(("p0", 10.0), ("d0", 10.0), ("p1", 10.0))
    assert culprit_search(PLACED, 0, watch, since=10.05, now=10.5) == "wait"
    watch.heard_from("d0", 11.0)
    watch.heard_from("p1", 11.6)
    culprit = culprit_search(PLACED, 0, watch, since=10.05, now=11.6)
    assert isinstance(culprit, Failure) and culprit.instance_id == "p0"


def test_an_error_chunk_whose_instances_go_on_reporting_has_no_culprit():
    """A live engine's error (a failed step, a refused job) is passed on: both instances reported since."""
    watch = watch_with(("p0", 10.0), ("d0", 10.0))
    watch.heard_from("p0", 10.2)
    assert culprit_search(PLACED, 0, watch, since=10.1, now=10.2) == "wait"
    watch.heard_from("d0", 10.2)
    assert culprit_search(PLACED, 0, watch, since=10.1, now=10.2) is None


def test_no_culprit_is_looked_for_among_instances_never_heard_or_by_a_gateway_that_hears_nobody():
    watch = InstanceWatch(1.5)
    watch.expect("p0", 0.0)
    watch.expect("d0", 0.0)
    assert culprit_search(PLACED, 0, watch, since=0.1, now=0.2) is None
    watch.heard_from("p0", 0.5)
    assert culprit_search(PLACED, 0, watch, since=0.6, now=0.7) == "wait"
    assert culprit_search(PLACED, 0, watch, since=0.6, now=2.1) is None  # nobody heard for 1.5 s


def test_tokens_and_the_final_chunk_are_no_failure():
    assert chunk_failure(TokenChunk(request_id="r1", seq=1, token_ids=[7])) is None
    assert chunk_failure(TokenChunk.final("r1", "length", seq=2, token_ids=[8], prompt_tokens=3,
                                          completion_tokens=2)) is None


def test_a_request_is_migrated_at_most_max_migrations_times():
    policy = MigrationPolicy(max_migrations=2)
    sampling = SamplingParams(max_tokens=10)
    assert policy.refusal(sampling, 0, 3) == ""
    assert policy.refusal(sampling, 1, 3) == ""
    assert "--max-migrations 2" in policy.refusal(sampling, 2, 3)
    assert MigrationPolicy(max_migrations=0).refusal(sampling, 0, 0) != ""


def test_parallel_sampling_is_not_migrated():
    assert "n or best_of" in MigrationPolicy().refusal(SamplingParams(max_tokens=10, n=2), 0, 3)


def test_the_continuation_is_the_prompt_and_the_tokens_received_with_the_rest_of_max_tokens():
    sampling = SamplingParams(max_tokens=10, seed=3, presence_penalty=0.5, min_tokens=6, prompt_logprobs=1)
    prompt, resumed = continuation([1, 2, 3], [7, 8, 9, 7], sampling)
    assert prompt == [1, 2, 3, 7, 8, 9, 7]
    assert resumed.max_tokens == 6 and resumed.resumed_tokens == 4
    assert resumed.seed == 3 and resumed.min_tokens == 6 and resumed.presence_penalty == 0.5
    assert resumed.prompt_logprobs is None  # sent with the first token already


def test_a_continuation_before_any_token_is_the_request_itself():
    sampling = SamplingParams(max_tokens=10, prompt_logprobs=1)
    assert continuation([1, 2, 3], [], sampling) == ([1, 2, 3], sampling)


def test_a_second_migration_counts_every_token_received_since_the_start():
    sampling = SamplingParams(max_tokens=10)
    _, once = continuation([1, 2], [5, 6], sampling)
    prompt, twice = continuation([1, 2], [5, 6, 7, 8, 9], sampling)
    assert prompt == [1, 2, 5, 6, 7, 8, 9] and twice.max_tokens == 5 and twice.resumed_tokens == 5
    assert once.max_tokens + 2 == sampling.max_tokens


def test_the_engines_see_the_original_prompt_and_output_of_a_continuation():
    sampling = SamplingParams(max_tokens=10)
    prompt, resumed = continuation([1, 2, 3], [7, 8], sampling)
    assert history(resumed, prompt, [9]) == ([1, 2, 3], [7, 8, 9])
    assert history(sampling, [1, 2, 3], [7]) == ([1, 2, 3], [7])


def test_a_continuation_asks_the_conductor_to_avoid_the_instances_that_failed_it():
    request = ScheduleRequest(request_id="r1-m1", n_tokens=5, block_hashes=[], max_tokens=4, avoid=["d0"])
    assert request.avoid == ["d0"]
    assert Failure("decode_silent", "gone", "d0").instance_id == "d0"
