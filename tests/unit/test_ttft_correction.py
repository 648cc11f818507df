"""The TTFT correction: its arithmetic on hand-computed cases, and the Conductor's admission with it."""

import pytest

import msgspec

from factories import decode_report, make_conductor, prefill_report, schedule_request
from kvcentric.core.protocol import MeasuredCost, Placement, Rejection, RequestOutcome
from kvcentric.core.scheduling.correction import TtftCorrection


def first_token(request_id: str, ttft_s: float, predicted_s: float, prefill_id: str = "p0") -> RequestOutcome:
    return RequestOutcome(request_id=request_id, prefill_id=prefill_id, decode_id="d0", finish_reason="",
                          ttft_s=ttft_s, e2e_s=ttft_s, prompt_tokens=1000, completion_tokens=1,
                          predicted_ttft_s=predicted_s)


def listing_report(instance_id: str, queue_s: float, ids: list[str]):
    return msgspec.structs.replace(prefill_report(instance_id, queue_s=queue_s), prefill_ids=ids)


def test_each_first_token_moves_the_factor_a_quarter_of_the_way_to_its_ratio():
    correction = TtftCorrection(min_predicted_s=0.5)
    assert correction.factor("p0", now=0.0) == 1.0  # nothing learned: the prediction as it is
    assert correction.learn("p0", "a", predicted_s=2.0, actual_s=4.0) == pytest.approx(1.25)  # 1 + (2 - 1) / 4
    assert correction.learn("p0", "b", predicted_s=2.0, actual_s=6.0) == pytest.approx(1.6875)  # + (3 - 1.25) / 4
    assert correction.learn("p0", "b", predicted_s=2.0, actual_s=6.0) is None  # its end after its first token
    assert correction.factor("p0", now=0.0) == pytest.approx(1.6875)
    assert correction.factor("p1", now=0.0) == 1.0  # per instance
    assert correction.observations == 2


def test_ratios_are_clamped_and_short_predictions_floored():
    correction = TtftCorrection(min_predicted_s=0.5)
    assert correction.ratio(predicted_s=0.1, actual_s=1.0) == 2.0  # 1.0 / 0.5, not 10
    assert correction.ratio(predicted_s=1.0, actual_s=100.0) == 4.0
    assert correction.ratio(predicted_s=10.0, actual_s=1.0) == 0.5
    assert correction.learn("p0", "a", predicted_s=1.0, actual_s=100.0) == pytest.approx(1.75)  # toward 4, not 100
    assert correction.learn("p1", "a2", predicted_s=10.0, actual_s=1.0) == pytest.approx(0.875)  # toward 0.5
    for i in range(100):
        correction.learn("p0", f"slow{i}", predicted_s=1.0, actual_s=100.0)
    assert correction.factor("p0", now=0.0) == pytest.approx(4.0) and correction.factor("p0", now=0.0) <= 4.0


def test_nothing_is_learned_without_a_prediction_or_a_first_token():
    correction = TtftCorrection(min_predicted_s=0.5)
    assert correction.learn("p0", "a", predicted_s=0.0, actual_s=3.0) is None
    assert correction.learn("p0", "b", predicted_s=1.0, actual_s=-1.0) is None
    assert correction.factor("p0", now=0.0) == 1.0 and correction.observations == 0


def test_a_late_placement_raises_the_factor_before_its_first_token_comes():
    correction = TtftCorrection(min_predicted_s=0.5, max_wait_s=10.0)
    correction.placed("p0", "x", predicted_s=2.0, now=0.0)
    assert correction.factor("p0", now=1.0) == 1.0  # not late yet
    assert correction.factor("p0", now=6.0) == pytest.approx(3.0)  # waited 6 s for a predicted 2: at least 3x
    assert correction.learn("p0", "x", predicted_s=2.0, actual_s=6.5) == pytest.approx(1.5625)  # 1 + (3.25 - 1) / 4
    assert correction.factor("p0", now=20.0) == pytest.approx(1.5625)  # it came: it bounds nothing any more


def test_a_placement_that_waited_past_the_limit_is_taken_as_lost():
    correction = TtftCorrection(min_predicted_s=0.5, max_wait_s=10.0)
    correction.placed("p0", "x", predicted_s=1.0, now=0.0)
    assert correction.factor("p0", now=9.0) == 4.0  # 9x, clamped
    assert correction.factor("p0", now=11.0) == 1.0 and correction.waiting == {}


def test_a_run_of_slow_first_tokens_turns_an_admission_into_a_429():
    # simple_cost: 1 s per 1000 tokens; a 1500-token prompt on an idle instance is predicted 1.5 s, SLO 3 s
    decisions = {}
    for enabled in (True, False):
        conductor = make_conductor(1, 1, ttft_slo_s=3.0, ttft_correction=enabled, ttft_correction_spread=0.0)
        for i in range(8):  # each predicted 1 s, each took 3 s
            placed = conductor.schedule(schedule_request(1000, f"w{i}"), {}, i / 10)
            assert isinstance(placed, Placement) and placed.predicted_ttft_s == pytest.approx(1.0)
            conductor.on_first_token(first_token(f"w{i}", 3.0, placed.predicted_ttft_s), i / 10)
            conductor.forget(f"w{i}")
        decisions[enabled] = conductor.schedule(schedule_request(1500, "next"), {}, 0.9)
    assert isinstance(decisions[False], Placement)
    rejected = decisions[True]
    # factor 3 - 2 * 0.75^8 = 2.7998: judged 1.5 * 2.7998 = 4.1997 s, 1.2 s over the SLO
    assert isinstance(rejected, Rejection) and rejected.stage == "prefill"
    assert rejected.retry_after_s == pytest.approx(1.2) and rejected.load == pytest.approx(4.1997 / 3, abs=1e-4)


def test_a_placement_late_for_its_first_token_makes_the_next_one_rejected():
    decisions = {}
    for enabled in (True, False):
        conductor = make_conductor(1, 1, ttft_slo_s=3.0, ttft_correction=enabled)
        assert isinstance(conductor.schedule(schedule_request(1000, "a"), {}, 0.0), Placement)  # predicted 1 s
        conductor.observe(listing_report("p0", 1.1, ["a"]), 2.4)  # a is still queued: 1.1 s of it left
        conductor.observe(decode_report("d0"), 2.4)
        # 2.5 s after a was placed it has no first token; b waits 1 s behind it: 2 s predicted, 2.5x corrected
        decisions[enabled] = conductor.schedule(schedule_request(1000, "b"), {}, 2.5)
    assert isinstance(decisions[False], Placement) and decisions[False].predicted_ttft_s == pytest.approx(2.0)
    assert isinstance(decisions[True], Rejection) and decisions[True].retry_after_s == pytest.approx(2.0)


def test_an_outcome_teaches_what_no_first_token_did_and_ends_the_wait():
    conductor = make_conductor(1, 1, ttft_slo_s=3.0, ttft_correction_spread=0.0)
    conductor.schedule(schedule_request(1000, "a"), {}, 0.0)
    outcome = RequestOutcome(request_id="a", prefill_id="p0", decode_id="d0", finish_reason="length", ttft_s=2.0,
                             e2e_s=4.0, prompt_tokens=1000, completion_tokens=16, predicted_ttft_s=1.0)
    conductor.on_outcome(outcome, 4.0)
    assert conductor.correction is not None and conductor.correction.waiting == {}
    assert conductor.correction.factor("p0", 4.0) == pytest.approx(1.25)
    conductor.on_first_token(first_token("a", 2.0, 1.0), 4.1)  # told twice: counted once
    assert conductor.correction.factor("p0", 4.1) == pytest.approx(1.25)


def chunk_factor(ratios: list[float], spread: float = 1.0, weight: float = 0.25) -> float:
    """The chunk part of the factor by hand: the weighted mean of the ratios (from 1) plus `spread` weighted mean
    absolute deviations from it, as the learned part."""
    mean, deviation = 1.0, 0.0
    for ratio in ratios:
        deviation += weight * (abs(ratio - mean) - deviation)
        mean += weight * (ratio - mean)
    return min(4.0, mean + spread * deviation)


def test_the_chunk_ratio_gets_the_spread_too():
    steady, scattered = (TtftCorrection(min_predicted_s=0.5, spread=1.0) for _ in range(2))
    for i in range(40):
        steady.learn_chunk("p0", samples=i + 1, predicted_s=1.0, measured_s=1.3)
        scattered.learn_chunk("p0", samples=i + 1, predicted_s=1.0, measured_s=1.1 if i % 2 else 1.5)
    assert steady.factor("p0", now=0.0) == pytest.approx(1.3, abs=1e-3)  # the ramp's deviation worn away
    assert scattered.factor("p0", now=0.0) == pytest.approx(chunk_factor([1.5, 1.1] * 20))
    assert scattered.factor("p0", now=0.0) > 1.3 + 0.15  # same mean, scattered: a margin of its deviation
    plain = TtftCorrection(min_predicted_s=0.5)
    plain.learn_chunk("p0", samples=1, predicted_s=1.0, measured_s=2.0)
    assert plain.factor("p0", now=0.0) == pytest.approx(1.25)  # spread 0: the mean alone


def test_each_new_prefill_chunk_moves_the_chunk_ratio_and_a_repeated_one_does_not():
    correction = TtftCorrection(min_predicted_s=0.5)
    assert correction.learn_chunk("p0", samples=12, predicted_s=0.2, measured_s=0.6) == pytest.approx(1.5)  # 3x
    assert correction.learn_chunk("p0", samples=12, predicted_s=0.2, measured_s=0.6) is None  # the same chunk
    assert correction.learn_chunk("p0", samples=13, predicted_s=0.2, measured_s=2.0) == pytest.approx(2.125)  # 10x: 4
    assert correction.factor("p0", now=0.0) == pytest.approx(2.125)  # over a learned TTFT ratio of 1
    correction.learn("p0", "a", predicted_s=1.0, actual_s=4.0)
    assert correction.factor("p0", now=0.0) == pytest.approx(2.125)  # the larger of 1.75 and 2.125
    correction.forget("p0")
    assert correction.factor("p0", now=0.0) == 1.0


def test_prefill_chunks_that_run_slower_than_the_model_turn_an_admission_into_a_429():
    # the instance's own model: 1 ms per token, its chunks of 1000 tokens timed at 3 s
    slow = MeasuredCost(prefill=[0.0, 1e-3, 0.0, 0.0], prefill_error=0.05, last_prefill=[1000.0, 0.0, 3.0])
    decisions = {}
    for enabled in (True, False):
        conductor = make_conductor(1, 1, ttft_slo_s=3.0, ttft_correction=enabled)
        for samples in range(1, 9):
            report = msgspec.structs.replace(prefill_report("p0"),
                                             cost=msgspec.structs.replace(slow, prefill_samples=samples))
            conductor.observe(report, samples / 10)
        decisions[enabled] = conductor.schedule(schedule_request(1500, "next"), {}, 0.9)
    assert isinstance(decisions[False], Placement) and decisions[False].predicted_ttft_s == pytest.approx(1.5)
    factor = chunk_factor([3.0] * 8)  # the mean 3 - 2 x 0.75^8 = 2.8 plus one mean deviation: 3.33
    assert isinstance(decisions[True], Rejection)  # 1.5 s x 3.33 = 5.0 s against the 3 s SLO
    assert decisions[True].retry_after_s == pytest.approx(round(1.5 * factor - 3.0, 1))


def test_a_slow_chunk_in_every_load_report_teaches_the_ratio_without_the_cost_model_being_resent():
    # The model travels once (refits come every few chunks); each later report carries only its latest chunk.
    model = MeasuredCost(prefill=[0.0, 1e-3, 0.0, 0.0], prefill_error=0.05)
    conductor = make_conductor(1, 1, ttft_slo_s=3.0)
    conductor.observe(msgspec.structs.replace(prefill_report("p0"), cost=model), 0.0)
    for samples in range(1, 9):  # chunks of 1000 tokens timed at 3 s: 3x the model's 1 s
        report = msgspec.structs.replace(prefill_report("p0"), last_prefill=[1000.0, 0.0, 3.0],
                                         prefill_samples=samples)
        conductor.observe(report, samples / 10)
        conductor.observe(report, samples / 10 + 0.05)  # the same chunk again in the next report: counted once
    assert conductor.correction is not None
    assert conductor.correction.factor("p0", 0.9) == pytest.approx(chunk_factor([3.0] * 8))
    assert isinstance(conductor.schedule(schedule_request(1500, "next"), {}, 0.9), Rejection)


def test_placement_ranks_on_corrected_predictions_and_returns_the_raw_one():
    for policy in ("kvcentric", "cache_aware"):
        conductor = make_conductor(2, 1, ttft_slo_s=10.0, policy=policy)
        conductor.observe(prefill_report("p1", queue_s=0.5), 0.0)  # p0 idle, p1 0.5 s queued
        assert conductor.correction is not None
        for i in range(8):  # p0's first tokens came 3x later than predicted: 1 s predicted counts as 2.8
            conductor.correction.learn("p0", f"w{i}", predicted_s=1.0, actual_s=3.0)
        placed = conductor.schedule(schedule_request(1000, "a"), {}, 0.1)
        # p1: 0.4 s left in its queue + 1 s = 1.4 s, uncorrected; p0: 1 s x 2.8
        assert isinstance(placed, Placement) and placed.prefill_id == "p1", policy
        assert placed.predicted_ttft_s == pytest.approx(1.4)


def test_the_spread_adds_mean_deviations_of_the_ratios_to_their_mean():
    """As TCP's retransmission timeout: mean plus `spread` mean deviations. Ratios 1 then 3: the mean moves to
    1.5 and the deviation to |3 - 1| / 4 = 0.5, so with spread 1 the factor is 2.0; steady ratios then wear the
    deviation away (a quarter a time) and the factor comes back to the mean."""
    plain, spread = TtftCorrection(min_predicted_s=0.5), TtftCorrection(min_predicted_s=0.5, spread=1.0)
    for correction in (plain, spread):
        correction.learn("p0", "a", predicted_s=2.0, actual_s=2.0)  # ratio 1: mean 1, deviation 0
        correction.learn("p0", "b", predicted_s=2.0, actual_s=6.0)  # ratio 3
    assert plain.factor("p0", now=0.0) == pytest.approx(1.5)
    assert spread.factor("p0", now=0.0) == pytest.approx(1.5 + 0.5)
    for i in range(60):
        spread.learn("p0", f"steady{i}", predicted_s=2.0, actual_s=3.0)  # ratio 1.5, the mean already
    assert spread.factor("p0", now=0.0) == pytest.approx(1.5, abs=1e-6)
    with pytest.raises(ValueError):
        TtftCorrection(min_predicted_s=0.5, spread=-1.0)


def test_scattered_first_tokens_make_the_conductor_reject_with_a_spread_where_the_mean_admits():
    # simple_cost: a 2200-token prompt on an idle instance is predicted 2.2 s; SLO 3 s. First tokens alternating
    # 0.5x and 1.5x their prediction: mean ratio about 1, deviation about 0.5.
    decisions = {}
    for spread in (0.0, 1.0):
        conductor = make_conductor(1, 1, ttft_slo_s=3.0, ttft_correction_spread=spread)
        for i in range(16):
            placed = conductor.schedule(schedule_request(1000, f"w{i}"), {}, i / 100)
            assert isinstance(placed, Placement)
            ratio = 0.5 if i % 2 else 1.5
            conductor.on_first_token(first_token(f"w{i}", ratio * placed.predicted_ttft_s, placed.predicted_ttft_s),
                                     i / 100)
            conductor.forget(f"w{i}")
        decisions[spread] = conductor.schedule(schedule_request(2200, "next"), {}, 0.17)
    assert isinstance(decisions[0.0], Placement)  # 2.2 s x ~0.94 is under 3 s
    assert isinstance(decisions[1.0], Rejection) and decisions[1.0].stage == "prefill"  # 2.2 s x ~1.43 is not


def test_a_rebase_carries_what_was_learned_over_to_a_new_model():
    correction = TtftCorrection(0.1, spread=1.0)
    for i in range(4):
        correction.learn("p0", f"r{i}", predicted_s=1.0, actual_s=1.6)
    correction.learn_chunk("p0", 1, predicted_s=1.0, measured_s=1.4)
    learned, speed = correction.learned_factor("p0"), correction.speed_factor("p0")
    correction.rebase("p0", 2.0)  # the new model predicts half what the old one did
    assert correction.learned_factor("p0") == pytest.approx(2 * learned)
    assert correction.speed_factor("p0") == pytest.approx(2 * speed)
    correction.rebase("p1", 2.0)  # nothing learned: the new model is trusted as the old one was
    assert correction.factor("p1", now=0.0) == 1.0
    correction.rebase("p0", 10.0)
    assert correction.learned_factor("p0") == correction.high  # still clamped


def test_a_refitted_model_does_not_make_a_corrected_prediction_jump():
    # p0's model first says 1 ms a token, and its first tokens came 1.5x later than predicted; then it refits to
    # 0.5 ms a token (say, a window of chunks timed while it ran alone). The queue is the same, so is the truth.
    old = MeasuredCost(prefill=[0.0, 1e-3, 0.0, 0.0], prefill_error=0.05, last_prefill=[1000.0, 0.0, 1.5],
                       prefill_samples=1)
    new = msgspec.structs.replace(old, prefill=[0.0, 5e-4, 0.0, 0.0], version=2)
    conductor = make_conductor(1, 1, ttft_slo_s=2.0)
    conductor.observe(msgspec.structs.replace(prefill_report("p0"), cost=old), 0.0)
    assert conductor.correction is not None
    for i in range(8):
        conductor.correction.learn("p0", f"w{i}", predicted_s=1.0, actual_s=1.5)
    before = conductor.correction.factor("p0", 0.1) * 1.0  # 1000 tokens: 1 s by the old model
    conductor.observe(msgspec.structs.replace(prefill_report("p0"), cost=new), 0.2)
    after = conductor.correction.factor("p0", 0.3) * 0.5  # 0.5 s by the new one
    assert after == pytest.approx(before, rel=0.02)
    # and admission sees it: 1000 tokens predicted at about 1.55 s against a 1.4 s SLO is still refused
    strict = make_conductor(1, 1, ttft_slo_s=1.4)
    strict.observe(msgspec.structs.replace(prefill_report("p0"), cost=old), 0.0)
    assert strict.correction is not None
    for i in range(8):
        strict.correction.learn("p0", f"w{i}", predicted_s=1.0, actual_s=1.5)
    strict.observe(msgspec.structs.replace(prefill_report("p0"), cost=new), 0.2)
    assert isinstance(strict.schedule(schedule_request(1000, "next"), {}, 0.3), Rejection)


def test_placements_from_before_a_rebase_teach_and_bound_in_the_new_models_terms():
    correction = TtftCorrection(0.1)
    correction.placed("p0", "old", predicted_s=2.0, now=0.0)  # predicted by the old model
    correction.rebase("p0", 2.0)  # the new model predicts half: that wait is worth 1 s of it
    correction.placed("p0", "new", predicted_s=1.0, now=0.0)
    # 3 s waited: 1.5x the old prediction, 3x in the new model's terms
    assert correction.overdue_ratio("p0", now=3.0) == pytest.approx(3.0)
    correction.learn("p0", "old", predicted_s=2.0, actual_s=3.0)  # ratio 1.5, carried: 3.0
    correction.learn("p0", "new", predicted_s=1.0, actual_s=3.0)  # ratio 3.0 as it is
    assert correction.factors["p0"] == pytest.approx(1.0 + 0.25 * 2.0 + 0.25 * (3.0 - 1.5))
