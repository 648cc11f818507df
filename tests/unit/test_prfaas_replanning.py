"""The re-planning arithmetic around `Replanner`: which instances make the PD cluster's pools, and the t
re-planned once the split a role switch asked for shows."""

from __future__ import annotations

from pathlib import Path

from factories import make_conductor, make_two_cluster_conductor
from kvcentric.core.prfaas.planner import best_threshold
from kvcentric.core.prfaas.profile import PrfaasProfile
from kvcentric.core.prfaas.replanning import ThresholdRetuner, pd_pools, prfaas_instances
from kvcentric.core.prfaas.throughput import Counts
from kvcentric.core.prfaas.workload import LengthDistribution
from kvcentric.core.scheduling.registry import DecodeState

PROFILE = Path(__file__).resolve().parents[2] / "bench" / "papers" / "prfaas_profile_table5.json"


def ids(states) -> list[str]:
    return sorted(s.instance_id for s in states)


def test_without_a_topology_every_serving_instance_is_in_a_pool():
    registry = make_conductor(prefills=2, decodes=1).registry
    prefill, decode = pd_pools(registry.alive_prefill(0.0), registry.alive_decode(0.0), None)
    assert ids(prefill) == ["p0", "p1"] and ids(decode) == ["d0"]


def test_a_colocated_instance_is_in_neither_pool():
    registry = make_conductor(prefills=2, decodes=1).registry
    prefill, decode = registry.alive_prefill(0.0), registry.alive_decode(0.0)
    colocated = DecodeState(prefill[0].instance_id, prefill[0].kv_addr, seen_at=0.0)
    prefill_pool, decode_pool = pd_pools(prefill, [*decode, colocated], None)
    assert ids(prefill_pool) == ["p1"] and ids(decode_pool) == ["d0"]


def test_with_a_topology_only_the_pd_cluster_counts_and_prfaas_instances_are_counted_apart():
    conductor = make_two_cluster_conductor(pd_prefills=2, prfaas_prefills=3, decodes=1)
    prefill, decode = conductor.registry.alive_prefill(0.0), conductor.registry.alive_decode(0.0)
    pools = pd_pools(prefill, decode, conductor.router)
    assert ids(pools[0]) == ["a0", "a1"] and ids(pools[1]) == ["d0"]
    assert prfaas_instances(prefill, conductor.router) == 3 and prfaas_instances(prefill, None) is None


def test_t_is_replanned_only_once_the_expected_split_shows():
    retuner = ThresholdRetuner(PrfaasProfile.load(PROFILE))
    lengths = [2_000 + 1_500 * i for i in range(40)]
    for n in lengths:
        retuner.placed(n, 256)
    retuner.expect(1, 2)
    assert retuner.retune(2, 1, 1) is None and retuner.expected == (1, 2)
    point = retuner.retune(1, 2, 1)
    want = best_threshold(PrfaasProfile.load(PROFILE), LengthDistribution.from_samples(lengths, 256), Counts(1, 1, 2))
    assert point is not None and point.threshold == want.threshold and retuner.expected is None


def test_without_a_profile_or_prfaas_cluster_nothing_is_replanned_but_the_expectation_is_met():
    for retuner, n_prfaas in ((ThresholdRetuner(None), 1), (ThresholdRetuner(PrfaasProfile.load(PROFILE)), None)):
        retuner.placed(1_000, 64)
        retuner.expect(1, 1)
        assert retuner.retune(1, 1, n_prfaas) is None and retuner.expected is None


def test_the_workload_counts_an_uncached_length_of_zero_as_one():
    retuner = ThresholdRetuner(None, recent=2)
    for uncached, output in ((500, 10), (0, 30), (0, 50)):
        retuner.placed(uncached, output)
    workload = retuner.workload()
    assert list(workload.lengths) == [1.0] and workload.output_length == 40.0


# ---------------------------------------------------------------- short-term: t re-derived (§3.4.3)

def raise_trigger(current: float):
    from kvcentric.core.prfaas.routing import adjust_threshold
    change = adjust_threshold(current, current, egress_utilization=0.95, prfaas_queue_s=0.0)
    assert change.changed and "raise t" in change.reason
    return change


LENGTHS = [(2_000 + 1_500 * i, 256) for i in range(40)]


def test_a_trigger_re_derives_t_from_the_model_at_the_measured_bandwidth_instead_of_a_step():
    from kvcentric.core.prfaas.routing import rederive_threshold
    profile, counts = PrfaasProfile.load(PROFILE), Counts(1, 1, 2)
    workload = LengthDistribution.from_samples([n for n, _ in LENGTHS], 256)
    measured = 2e9 / 8  # 2 Gbit/s, far below the profile's 100
    change = rederive_threshold(20_000, raise_trigger(20_000), profile, LENGTHS, counts, measured)
    want = best_threshold(profile.with_egress(2.0), workload, counts).threshold
    assert change.threshold == want and change.threshold != 20_000 * 1.25
    assert "measured B_out 2 Gbps" in change.reason and "PrfaaS near its ceiling" in change.reason
    ample = rederive_threshold(20_000, raise_trigger(20_000), profile, LENGTHS, counts, 100e9 / 8)
    assert ample.threshold <= change.threshold  # less bandwidth: only longer requests are worth offloading


def test_returning_toward_the_plan_or_nothing_to_judge_by_keeps_the_step():
    from kvcentric.core.prfaas.routing import ThresholdChange, rederive_threshold
    profile, counts = PrfaasProfile.load(PROFILE), Counts(1, 1, 2)
    back = ThresholdChange(1000.0, True, "PrfaaS calm again: back toward the planned t")
    assert rederive_threshold(1250, back, profile, LENGTHS, counts, 1e9) is back
    trigger = raise_trigger(1000)
    assert rederive_threshold(1000, trigger, profile, [], counts, 1e9) is trigger
    assert rederive_threshold(1000, trigger, profile, LENGTHS, Counts(1, 0, 2), 1e9) is trigger


def test_the_router_re_derives_t_with_the_prfaas_instances_measured_push_rate():
    import dataclasses

    import msgspec

    from factories import decode_report, prefill_report, schedule_request, two_cluster_setup
    profile = PrfaasProfile.load(PROFILE)
    setup = dataclasses.replace(two_cluster_setup(adjust_s=1.0), profile=profile)
    conductor = make_two_cluster_conductor(setup=setup, rejection="never")
    for i, (n, out) in enumerate(LENGTHS):
        conductor.schedule(schedule_request(n, f"r{i}", max_tokens=out), {}, 0.0)
    rate = 8e9 / 8 * 0.9  # the link is 8 Gbit/s; r0 pushed at 90% of it and measured 3 Gbit/s per stream
    for t in (0.0, 1.0, 2.0):
        report = prefill_report("r0", cluster="prfaas", kv_bytes_sent=int(rate * t))
        conductor.observe(msgspec.structs.replace(report, link_bandwidth={"d0:7000": 3e9 / 8}), t)
    for report in (prefill_report("a0", cluster="pd"), decode_report("d0", cluster="pd")):
        conductor.observe(report, 2.0)
    conductor.router.tick(conductor.prefill_views(2.0), 2.0, decodes=1)
    workload = LengthDistribution.from_samples([n for n, _ in LENGTHS], 256)
    want = best_threshold(profile.with_egress(3.0), workload, Counts(1, 1, 1)).threshold
    assert conductor.router.threshold == want and conductor.router.stats["threshold_rederived"] == 1
    assert conductor.router.measured_egress("prfaas", conductor.prefill_views(2.0)) == 3e9 / 8
