"""Rejection modes and priorities on hand-built clusters (decode step = 10 ms + 1 ms per sequence)."""

import msgspec
import pytest

from factories import decode_report, make_conductor, prefill_report, schedule_request
from kvcentric.core.protocol import Placement, Rejection


def schedule(conductor, n_tokens=1000, request_id="r", priority=0, now=0.1, hits=None):
    return conductor.schedule(schedule_request(n_tokens, request_id, priority), hits or {}, now)


def busy_decode(conductor, running=8):
    """Every decode instance reports `running` sequences: TBT with one more = 10 + running + 1 ms."""
    for instance_id in list(conductor.registry.decode):
        conductor.observe(decode_report(instance_id, running=running), 0.0)


def test_never_admits_whatever_the_load():
    conductor = make_conductor(1, 1, rejection="never", ttft_slo_s=1.0, tbt_slo_s=0.015)
    busy_decode(conductor)
    assert isinstance(schedule(conductor, n_tokens=50_000), Placement)


def test_none_rejects_on_the_prefill_stage_only():
    conductor = make_conductor(1, 1, rejection="none", ttft_slo_s=30.0, tbt_slo_s=0.015)
    busy_decode(conductor)
    assert isinstance(schedule(conductor), Placement)  # decode double-checks on arrival, not here
    decision = schedule(conductor, n_tokens=40_000, request_id="long")
    assert isinstance(decision, Rejection) and decision.reason == "overloaded" and decision.stage == "prefill"
    assert "TTFT" in decision.message and decision.load > 1


def test_prefill_rejection_asks_to_retry_after_the_excess_queue():
    conductor = make_conductor(1, 1, rejection="early", ttft_slo_s=30.0)
    conductor.observe(prefill_report("p0", queue_s=39.1), 0.0)
    decision = schedule(conductor)  # TTFT 39 + 1 = 40 s, 10 s over the SLO
    assert decision.stage == "prefill" and decision.retry_after_s == pytest.approx(10.0)


def test_early_rejects_on_the_current_decode_load():
    conductor = make_conductor(1, 1, rejection="early", tbt_slo_s=0.015)
    busy_decode(conductor)  # 19 ms > 15 ms now
    decision = schedule(conductor)
    assert isinstance(decision, Rejection) and decision.stage == "decode"
    assert decision.load == pytest.approx(0.019 / 0.015, rel=1e-3)
    assert 1.0 <= decision.retry_after_s <= 60.0


def test_early_ignores_requests_still_in_prefill_so_a_burst_overshoots():
    conductor = make_conductor(6, 1, rejection="early", tbt_slo_s=0.015)
    decisions = [schedule(conductor, request_id=f"r{i}") for i in range(6)]
    assert all(isinstance(d, Placement) for d in decisions)  # 6 + running 0 will exceed 4 at decode


def test_predictive_rejects_a_burst_that_will_reach_decode_together():
    conductor = make_conductor(6, 1, rejection="predictive", tbt_slo_s=0.0155)
    decisions = [schedule(conductor, request_id=f"r{i}") for i in range(6)]
    placed = [d for d in decisions if isinstance(d, Placement)]
    assert len(placed) == 5  # all arrive at 1.1 s: the sixth would make it 10 ms + 6 ms > 15.5 ms
    assert all(d.stage == "decode" for d in decisions if isinstance(d, Rejection))


def test_predictive_admits_when_the_current_decode_batch_will_be_gone_on_arrival():
    conductor = make_conductor(1, 1, rejection="predictive", tbt_slo_s=0.015, decode_time_s=1.0,
                               adapt_decode_time=False)
    busy_decode(conductor)  # overloaded now, but every running request ends within t_d = 1 s
    assert isinstance(schedule(conductor, n_tokens=1000), Placement)  # arrives at 1.1 s
    early = make_conductor(1, 1, rejection="early", tbt_slo_s=0.015)
    busy_decode(early)
    assert isinstance(schedule(early, n_tokens=1000), Rejection)


def test_predictive_averages_the_decode_pool():
    conductor = make_conductor(1, 2, rejection="predictive", tbt_slo_s=0.015, decode_time_s=100.0)
    conductor.observe(decode_report("d0", running=20), 0.0)
    decision = schedule(conductor)  # arrives at 1.1 s, when d0's 20 have faded by 1.1 / t_d
    assert isinstance(decision, Rejection) and decision.stage == "decode"
    d0, d1 = 0.010 + 0.001 * (20 * (1 - 1.1 / 100) + 1), 0.011
    assert decision.load == pytest.approx((d0 + d1) / 2 / 0.015, rel=1e-3)


def test_lower_priority_is_rejected_first():
    conductor = make_conductor(1, 1, rejection="early", ttft_slo_s=1.1, priority_step=0.2)
    assert isinstance(schedule(conductor, request_id="high", priority=0), Placement)  # load 0.91
    conductor = make_conductor(1, 1, rejection="early", ttft_slo_s=1.1, priority_step=0.2)
    low = schedule(conductor, request_id="low", priority=-1)
    assert isinstance(low, Rejection) and "0.80" in low.message


def test_a_top_priority_above_zero_makes_default_requests_a_lower_class():
    conductor = make_conductor(1, 1, rejection="early", ttft_slo_s=1.1, top_priority=2, priority_step=0.1)
    assert isinstance(schedule(conductor, priority=2), Placement)
    assert isinstance(schedule(conductor, request_id="b", priority=0), Rejection)  # threshold 0.8


def test_headroom_keeps_a_share_of_the_slo_spare_for_every_class():
    admitted = make_conductor(1, 1, rejection="early", ttft_slo_s=1.1)
    assert isinstance(schedule(admitted), Placement)  # load 0.91
    conductor = make_conductor(1, 1, rejection="early", ttft_slo_s=1.1, slo_headroom=0.1)
    decision = schedule(conductor)
    assert isinstance(decision, Rejection) and decision.stage == "prefill" and "0.90" in decision.message
    roomy = make_conductor(1, 1, rejection="early", ttft_slo_s=1.25, slo_headroom=0.1)
    assert isinstance(schedule(roomy), Placement)  # load 0.8 <= 0.9
    low = schedule(make_conductor(1, 1, rejection="early", ttft_slo_s=1.25, slo_headroom=0.1,
                                  priority_step=0.2), request_id="low", priority=-1)
    assert isinstance(low, Rejection) and "0.72" in low.message  # 0.8 x 0.9
    with pytest.raises(ValueError, match="slo-headroom"):
        make_conductor(1, 1, slo_headroom=1.0)


def test_a_decode_instance_whose_kv_is_full_is_never_chosen():
    conductor = make_conductor(1, 2, rejection="early")
    conductor.observe(decode_report("d0", used_blocks=995, total_blocks=1000), 0.0)  # 500 tokens free
    assert schedule(conductor, n_tokens=1000).decode_id == "d1"


def test_decode_choice_counts_requests_in_flight_so_a_burst_spreads():
    conductor = make_conductor(2, 2, rejection="early")
    first, second = schedule(conductor, request_id="a"), schedule(conductor, request_id="b")
    assert {first.decode_id, second.decode_id} == {"d0", "d1"}


def full_decode(conductor, instance_id="d0", staging_blocks=0):
    """The instance's cache is full; its host staging can take `staging_blocks` blocks' worth of KV."""
    report = msgspec.structs.replace(decode_report(instance_id, used_blocks=100, total_blocks=100),
                                     kv_staging_blocks_free=staging_blocks)
    conductor.observe(report, 0.0)


@pytest.mark.parametrize("mode", ["none", "early", "predictive"])
def test_a_request_no_decode_has_room_for_is_rejected_before_its_prefill(mode):
    conductor = make_conductor(1, 1, rejection=mode, ttft_slo_s=60.0, tbt_slo_s=10.0)
    full_decode(conductor)
    decision = schedule(conductor)
    assert isinstance(decision, Rejection) and decision.stage == "decode"
    assert "no decode instance has room" in decision.message and decision.retry_after_s == 1.0


@pytest.mark.parametrize("mode", ["none", "early", "predictive"])
def test_host_staging_counts_as_decode_room(mode):
    conductor = make_conductor(1, 1, rejection=mode, ttft_slo_s=60.0, tbt_slo_s=10.0)
    full_decode(conductor, staging_blocks=1000)
    assert isinstance(schedule(conductor), Placement)


def test_the_decode_with_room_is_chosen_over_a_full_one():
    conductor = make_conductor(1, 2, rejection="early", ttft_slo_s=60.0, tbt_slo_s=10.0)
    decodes = sorted(conductor.registry.decode)
    full_decode(conductor, decodes[0])
    conductor.observe(decode_report(decodes[1], running=30, used_blocks=10, total_blocks=1000), 0.0)
    decision = schedule(conductor)
    assert isinstance(decision, Placement) and decision.decode_id == decodes[1]
