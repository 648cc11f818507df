"""Bursts are queued, overload is refused (issue 48), in the Conductor core without servers: the leaky bucket of offered
prefill work, a burst the pool clears within --burst-s admitted whole where its SLO alone refuses most of it, a
sustained rate above capacity refused at the SLO once the bucket is full, and the decode's double-check asked for
only where the conductor judged no decode load at placement."""

from __future__ import annotations

import msgspec
import pytest

from factories import decode_report, prefill_report, schedule_request
from kvcentric.core.costmodel import CostModel
from kvcentric.core.dispatch import jobs
from kvcentric.core.protocol import DecodeJob, MeasuredCost, Placement, Rejection, SamplingParams
from kvcentric.core.scheduling.bursts import OfferedWork
from kvcentric.core.scheduling.conductor import Conductor
from kvcentric.core.scheduling.config import SchedulerConfig

PRIOR = CostModel((0.001, 1e-3, 0.0, 0.0), (10.0, 0.0, 0.0), 1000, "roofline")
PREFILL = MeasuredCost(prefill=[0.0, 1e-4, 0.0, 0.0], prefill_samples=12, model="m", device="cpu")
"""0.1 ms per prompt token: a 1000-token prompt takes 0.1 s unloaded, so its relative TTFT SLO is the 1 s floor."""
DECODE = MeasuredCost(decode=[0.01, 0.0, 0.0], decode_samples=12, model="m", device="cpu")


def cluster(burst_s: float, prefills: int = 1, **settings) -> Conductor:
    settings = {"block_size": 100, "expect_cache": False, "ttft_correction": False, "ttft_slo_s": 0.0,
                "tbt_slo_s": 0.0, **settings}
    core = Conductor(SchedulerConfig(burst_s=burst_s, **settings), PRIOR, stale_after_s=1e9, prior_trusted=False)
    for index in range(prefills):
        core.observe(msgspec.structs.replace(prefill_report(f"p{index}"), cost=PREFILL), 0.0)
    core.observe(msgspec.structs.replace(decode_report("d0", total_blocks=10**6), cost=DECODE), 0.0)
    return core


def burst(core: Conductor, count: int, now: float = 0.1, prefix: str = "r") -> list[Placement | Rejection]:
    return [core.schedule(schedule_request(1000, f"{prefix}{i}"), {}, now) for i in range(count)]


def test_the_bucket_holds_a_burst_it_drains_at_capacity_and_overflows_past_burst_s_per_instance():
    bucket = OfferedWork(burst_s=3.0)
    bucket.offer(5.0, now=0.0, instances=2)
    assert bucket.allowance_s(0.0, 2) == 3.0 and bucket.per_instance_s == 2.5  # 5 s of work: 2.5 s on each of two
    bucket.offer(2.0, now=0.0, instances=2)
    assert bucket.allowance_s(0.0, 2) == 0.0  # 7 s > 3 s x 2 instances: overload, the SLO judges
    assert bucket.allowance_s(0.5, 2) == 3.0  # two instances drained 1 s of it in 0.5 s
    assert bucket.allowance_s(100.0, 2) == 3.0 and bucket.level_s == 0.0
    assert OfferedWork(burst_s=0.0).allowance_s(0.0, 1) == 0.0  # no allowance: the paper's admission


@pytest.mark.parametrize("rate, fills", [(0.9, False), (2.0, True)])
def test_only_a_rate_above_capacity_fills_the_bucket(rate, fills):
    """One instance, 0.1 s of work per request: `rate` x capacity for 60 s. Below capacity the level stays at about
    a request's work; above, it grows by (rate - 1) s a second and overflows 3 s after about 3 s."""
    bucket, overflowed_at = OfferedWork(burst_s=3.0), None
    for step in range(int(60 * rate / 0.1)):
        now = step * 0.1 / rate
        bucket.offer(0.1, now, 1)
        if overflowed_at is None and bucket.allowance_s(now, 1) == 0.0:
            overflowed_at = now
    assert (overflowed_at is not None) == fills
    if fills:
        assert overflowed_at == pytest.approx(3.0 / (rate - 1.0), abs=0.2)


def test_a_burst_the_pool_clears_within_burst_s_is_queued_whole_where_its_slo_refuses_most_of_it():
    """32 prompts of 0.1 s each at once: the last waits 3.2 s for its first token, over its 1 s TTFT SLO (the floor).
    Held to the SLO alone, 10 are admitted (1 s of queue); with a 30 s allowance all 32 are, and the TTFT each
    is predicted is its place in the queue."""
    strict = burst(cluster(burst_s=0.0), 32)
    assert sum(isinstance(d, Placement) for d in strict) == 10
    assert all(d.stage == "prefill" and "TTFT SLO" in d.message for d in strict if isinstance(d, Rejection))
    core = cluster(burst_s=30.0)
    queued = burst(core, 32)
    assert all(isinstance(d, Placement) for d in queued), [d for d in queued if isinstance(d, Rejection)][:1]
    assert [d.predicted_ttft_s for d in queued] == pytest.approx([0.1 * (i + 1) for i in range(32)], rel=1e-3)
    assert queued[-1].ttft_slo_s == pytest.approx(1.0)  # the SLO the request is measured by stays the SLO
    assert core.stats["queued_burst"] == 32 - 10


def test_a_burst_larger_than_the_allowance_is_queued_up_to_it_and_the_rest_refused():
    """400 prompts of 0.1 s at once on one instance with a 30 s allowance: 40 s of work overflows the bucket after
    300, and the TTFT SLO judges the rest (all refused: the queue is far beyond it). Two instances take all 400."""
    decisions = burst(cluster(burst_s=30.0), 400)
    placed = [d for d in decisions if isinstance(d, Placement)]
    assert 270 <= len(placed) <= 300 and all(isinstance(d, Rejection) for d in decisions[300:])
    assert max(d.predicted_ttft_s for d in placed) <= 30.0
    two = burst(cluster(burst_s=30.0, prefills=2), 400)
    assert all(isinstance(d, Placement) for d in two)


def test_a_sustained_rate_above_capacity_is_refused_at_the_slo_and_one_below_it_is_not():
    """Arrivals for 120 s at 2x what the instance computes: after the bucket fills (about 30 s) requests are refused
    at the SLO, so the admitted rate falls to about capacity; at 0.8x capacity nothing is refused. Load reports
    say what the instance has queued (its T_queue falls as it computes)."""
    for rate, refused in ((2.0, True), (0.8, False)):
        core = cluster(burst_s=30.0)
        queue_s, now, decisions = 0.0, 0.0, []
        for step in range(int(120 * rate / 0.1)):
            arrival = step * 0.1 / rate
            queue_s = max(0.0, queue_s - (arrival - now))
            now = arrival
            core.observe(msgspec.structs.replace(prefill_report("p0", queue_s=queue_s), cost=PREFILL), now)
            decision = core.schedule(schedule_request(1000, f"r{step}"), {}, now)
            if isinstance(decision, Placement):
                queue_s += 0.1
            decisions.append((now, decision))
        late = [d for at, d in decisions if at > 60.0]
        late_refused = sum(isinstance(d, Rejection) for d in late)
        assert (late_refused > 0) == refused, (rate, late_refused)
        if refused:
            placed_late = sum(isinstance(d, Placement) for d in late)
            assert 0.8 <= placed_late * 0.1 / 60.0 <= 1.1  # about capacity (1 s of work a second) admitted


def test_only_the_rejection_mode_that_judges_no_decode_load_asks_the_decode_to_double_check():
    for mode, check in (("early", False), ("predictive", False), ("never", False), ("none", True)):
        decision = burst(cluster(burst_s=30.0, rejection=mode), 1)[0]
        assert isinstance(decision, Placement) and decision.decode_tbt_check == check, mode
        submits = jobs("r", decision, list(range(1000)), SamplingParams(max_tokens=4))
        decode_job = next(job for role, _, job in submits if role == "decode")
        assert isinstance(decode_job, DecodeJob) and decode_job.tbt_check == check
    assert Placement(request_id="r", prefill_id="p", decode_id="d", decode_kv_addr="a").decode_tbt_check


def test_the_conductor_queues_bursts_under_relative_slos_and_holds_an_operators_absolute_slo():
    from kvc_conductor.config import DEFAULT_BURST_S, ConductorConfig

    assert ConductorConfig().scheduler.burst_s == DEFAULT_BURST_S == 60.0  # the defaults: relative SLOs
    assert ConductorConfig(ttft_slo_s=2.0).scheduler.burst_s == 0.0  # an SLO the operator set holds
    assert ConductorConfig(ttft_slo_s=2.0, burst_s=10.0).scheduler.burst_s == 10.0
    assert ConductorConfig(burst_s=0.0).scheduler.burst_s == 0.0
