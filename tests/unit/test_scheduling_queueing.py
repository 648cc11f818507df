"""T_queue as the sum of the queued prefills' predicted times, load in uncached tokens, placements counted until
a report lists them, and the blocks expected at placement: hand-computed cases."""

import pytest

from factories import decode_report, make_conductor, prefill_report, schedule_request
from kvcentric.core.costmodel import CostModel
from kvcentric.core.protocol import Placement, Rejection, RequestOutcome
from kvcentric.core.scheduling.prefix import ExpectedBlocks
from kvcentric.core.scheduling.queueing import InFlight, QueuedPrefill, queue_seconds, uncached_tokens

# T_prefill = 0.1 + 0.001 n_new + 1e-6 n_new n_cached + 0 n_new^2, one pass per prompt
COST = CostModel(prefill=(0.1, 0.001, 1e-6, 0.0), decode=(0.01, 0.0, 0.0), kv_bytes_per_token=1)


def test_queue_time_is_the_sum_of_each_queued_prefills_predicted_time():
    queue = [QueuedPrefill("a", 1000, 0), QueuedPrefill("b", 600, 400), QueuedPrefill("c", 500, 500)]
    # a: 0.1 + 1.0 + 0 = 1.1; b: 0.1 + 0.2 + 1e-6*200*400 = 0.38; c: fully cached, nothing left = 0
    assert queue_seconds(COST, queue) == pytest.approx(1.48)
    assert uncached_tokens(queue) == 1000 + 200 + 0


def test_a_running_prompt_counts_only_its_chunks_still_to_compute():
    chunked = CostModel(prefill=(0.1, 0.001, 0.0, 0.0), decode=(0.0, 0.0, 0.0), kv_bytes_per_token=1,
                        prefill_chunk=256)
    # 1024 tokens with 512 done: two chunks of 256 left, p0 once each: 2 * 0.1 + 512 * 0.001
    assert queue_seconds(chunked, [QueuedPrefill("a", 1024, 512)]) == pytest.approx(0.712)
    assert queue_seconds(chunked, []) == 0.0


def test_placements_count_until_a_report_lists_them():
    flight = InFlight()
    flight.add("a", 1.0, 1000, now=0.0)
    flight.add("b", 0.5, 400, now=0.1)
    assert (flight.seconds, flight.tokens, len(flight)) == (1.5, 1400, 2)
    assert flight.reconcile({"a"}, computed_at=0.2) == 1  # the report shows a: its estimate covers it
    assert (flight.seconds, flight.tokens) == (0.5, 400)
    assert flight.reconcile(set(), computed_at=1.0) == 0  # b not listed yet, but only 0.9 s old: still on its way
    assert flight.reconcile(set(), computed_at=2.2) == 1  # 2.1 s old and never listed: done or refused meanwhile
    assert (flight.seconds, flight.tokens, len(flight)) == (0.0, 0, 0)


def test_a_report_that_lists_nothing_covers_every_placement():
    flight = InFlight()
    flight.add("a", 1.0, 1000, now=5.0)
    assert flight.reconcile(None, computed_at=0.0) == 1 and flight.seconds == 0.0


def test_the_same_request_placed_again_counts_once():
    flight = InFlight()
    flight.add("a", 1.0, 1000, now=0.0)
    flight.add("a", 2.0, 500, now=0.1)
    assert (flight.seconds, flight.tokens) == (2.0, 500)
    flight.discard("a")
    flight.discard("a")
    assert (flight.seconds, flight.tokens) == (0.0, 0)


def test_expected_blocks_extend_the_hits_until_they_lapse():
    expected = ExpectedBlocks()
    expected.expect("p0", ["h0", "h1", "h2"], until=10.0)
    expected.expect("p1", ["h0", "x1"], until=5.0)
    assert expected.merged(["h0", "h1", "h9"], {"p0": 1, "p2": 3}) == {"p0": 2, "p1": 1, "p2": 3}
    expected.expire(5.0)
    assert expected.merged(["h0", "x1"], {}) == {"p0": 1}
    expected.expire(10.0)
    assert expected.merged(["h0"], {}) == {} and len(expected) == 0


def test_an_expectation_named_twice_outlives_the_first():
    expected = ExpectedBlocks()
    expected.expect("p0", ["h0", "h1"], until=2.0)
    expected.expect("p0", ["h0"], until=1.0)
    expected.expire(1.5)
    assert expected.merged(["h0", "h1"], {}) == {"p0": 2}


# ---------------------------------------------------------------- the Conductor with them


def listing_report(instance_id: str, queue_s: float, ids: list[str], uncached: int, age_s: float = 0.0):
    import msgspec
    return msgspec.structs.replace(prefill_report(instance_id, queue_s=queue_s, queued_tokens=9999),
                                   prefill_ids=ids, queued_uncached_tokens=uncached, load_age_s=age_s)


def test_a_placement_the_report_does_not_list_yet_stays_in_t_queue():
    conductor = make_conductor(1, 1)  # simple_cost: 1 ms per token
    conductor.schedule(schedule_request(1000, "a"), {}, 0.0)
    conductor.schedule(schedule_request(500, "b"), {}, 0.0)
    state = conductor.registry.prefill["p0"]
    assert state.queue_s(0.0) == pytest.approx(1.5)
    # computed 0.05 s before it arrived: a is queued there (its 1 s is in the report's 1.2 s), b still on its way
    conductor.observe(listing_report("p0", 1.2, ["a"], uncached=1100, age_s=0.05), 0.25)
    assert state.queue_s(0.25) == pytest.approx(1.2 - 0.05 + 0.5)
    assert state.load_tokens == 1100 + 500  # uncached tokens, reported and in flight
    conductor.observe(listing_report("p0", 1.0, ["a", "b"], uncached=1000), 0.3)
    assert state.queue_s(0.3) == pytest.approx(1.0)


def test_the_tokens_mode_forgets_placements_at_each_report():
    conductor = make_conductor(1, 1, queue_time="tokens")
    conductor.schedule(schedule_request(1000, "a"), {}, 0.0)
    conductor.observe(listing_report("p0", 5.0, [], uncached=0), 0.1)
    state = conductor.registry.prefill["p0"]
    assert state.queue_s(0.1) == pytest.approx(9.999)  # the linear guess over raw tokens; its 5 s ignored
    assert state.dispatched_s == 0.0


def test_an_outcome_takes_the_request_out_of_the_queue():
    conductor = make_conductor(1, 1)
    conductor.schedule(schedule_request(1000, "a"), {}, 0.0)
    conductor.on_outcome(RequestOutcome(request_id="a", prefill_id="p0", decode_id="d0", finish_reason="stop",
                                        ttft_s=0.5, e2e_s=1.0, prompt_tokens=1000, completion_tokens=2), 0.6)
    assert conductor.registry.prefill["p0"].queue_s(0.6) == 0.0


def test_queued_placements_make_admission_reject_before_any_report():
    conductor = make_conductor(1, 1, ttft_slo_s=3.0)
    decisions = [conductor.schedule(schedule_request(1000, f"r{i}"), {}, 0.0) for i in range(5)]
    # TTFTs 1, 2, 3 s fit the 3 s SLO; the fourth would wait 3 s and take 1
    assert [type(d).__name__ for d in decisions] == ["Placement"] * 3 + ["Rejection"] * 2
    assert isinstance(decisions[3], Rejection) and decisions[3].retry_after_s == pytest.approx(1.0)


def test_a_prompt_placed_behind_the_same_prefix_goes_where_that_prefix_will_be():
    for expect, where, cached in ((True, "p0", 999), (False, "p1", 0)):
        conductor = make_conductor(2, 1, expect_cache=expect)
        conductor.observe(prefill_report("p1", queue_s=0.5), 0.0)
        first = conductor.schedule(schedule_request(1000, "a"), {}, 0.0)
        assert isinstance(first, Placement) and first.prefill_id == "p0"
        # p0: 1 s queued + 0.001 s for the last token, expected cached; p1: 0.5 s queued + 1 s, nothing to pull yet
        second = conductor.schedule(schedule_request(1000, "b"), {}, 0.0)
        assert isinstance(second, Placement)
        assert (second.prefill_id, second.cached_tokens, second.kv_source_id) == (where, cached, "")


def test_decode_room_counts_the_requests_still_in_prefill():
    conductor = make_conductor(1, 0, ttft_slo_s=100.0)
    conductor.observe(decode_report("d0", total_blocks=25), 0.0)  # 2500 tokens of room, no staging
    decisions = [conductor.schedule(schedule_request(1000, f"r{i}"), {}, 0.0) for i in range(3)]
    assert [type(d).__name__ for d in decisions] == ["Placement", "Placement", "Rejection"]
    assert decisions[2].stage == "decode"


def test_a_burst_is_refused_from_its_fourth_request_though_the_reports_lag_behind_it():
    """A step of load: the instance's reports, computed before the burst reached it, show an empty queue; the
    placements they do not list still count, so rejection starts as soon as the queue they make is too long."""
    conductor = make_conductor(1, 1, ttft_slo_s=3.0, ttft_correction=False)
    burst = [conductor.schedule(schedule_request(1000, f"r{i}"), {}, i / 100) for i in range(3)]
    assert [d.predicted_ttft_s for d in burst if isinstance(d, Placement)] == pytest.approx([1.0, 2.0, 3.0])
    conductor.observe(listing_report("p0", 0.0, [], uncached=0, age_s=0.05), 0.03)  # computed before the burst
    fourth = conductor.schedule(schedule_request(1000, "r3"), {}, 0.04)
    assert isinstance(fourth, Rejection) and fourth.retry_after_s == pytest.approx(1.0)  # 3 s queued + 1 s
    # the burst reaches the instance: r0 half done, r1 and r2 queued (2.5 s in all, its own estimate)
    conductor.observe(listing_report("p0", 2.5, ["r0", "r1", "r2"], uncached=2500), 0.5)
    assert isinstance(conductor.schedule(schedule_request(1000, "r4"), {}, 0.5), Rejection)  # 3.5 s
    assert isinstance(conductor.schedule(schedule_request(400, "r5"), {}, 0.5), Placement)  # 2.9 s
