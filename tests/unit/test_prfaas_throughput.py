"""Equations (3)–(6) of PrfaaS §3.4.1 on hand-computed cases."""

import numpy as np
import pytest

from kvcentric.core.prfaas.profile import PrfaasProfile
from kvcentric.core.prfaas.throughput import Counts, operating_point, route_workload, throughputs
from kvcentric.core.prfaas.workload import LengthDistribution

MIB = 2 ** 20


def toy_profile(egress_gbps=1.0) -> PrfaasProfile:
    """PrfaaS: 1 ms per token, 1 MiB of KV per 1000 tokens; PD-P twice as slow; decode 100 tokens/s."""
    return PrfaasProfile.from_dict({
        "prfaas": {"lengths": [1000, 4000], "prefill_s": [1.0, 4.0], "kv_mib": [1.0, 4.0]},
        "pd_prefill": {"lengths": [1000, 4000], "prefill_s": [2.0, 8.0]},
        "decode": {"tokens_per_s": 100}, "egress_gbps": egress_gbps})


TWO = LengthDistribution.from_samples([1000, 3000], output_length=10)


def point(profile, workload, threshold, counts):
    routed = route_workload(profile, workload, [threshold])
    return operating_point(profile, routed, counts, workload.output_length)


def test_each_equation_on_a_hand_computed_split():
    op = point(toy_profile(), TWO, 2000, Counts(2, 1, 1))
    assert (op.p, op.l_long, op.l_short) == pytest.approx((0.5, 3000, 1000))
    assert op.theta_prfaas_compute == pytest.approx(2 / 3.0)            # N_prfaas / T(l_long)       (3)
    assert op.theta_prfaas_bandwidth == pytest.approx(125e6 / (3 * MIB))  # B_out / S_kv(l_long)   (3)
    assert op.theta_prfaas == pytest.approx(2 / 3.0)
    assert op.theta_pd_p == pytest.approx(1 / 2.0)                       # N_p / T(l_short)           (4)
    assert op.theta_pd_d == pytest.approx(1 * 100 / 10)                  # N_d BS/(T_dec L_out)       (5)
    assert op.lambda_max == pytest.approx(min((2 / 3) / 0.5, 0.5 / 0.5, 10))  # (6)
    assert op.bottleneck == "pd-p"
    assert op.egress_gbps == pytest.approx(0.5 * 1.0 * 3 * MIB * 8 / 1e9)
    assert op.egress_utilization == pytest.approx(op.egress_gbps / 1.0)


def test_a_thin_link_makes_prfaas_bandwidth_bound():
    op = point(toy_profile(egress_gbps=0.01), TWO, 2000, Counts(2, 1, 1))
    assert op.theta_prfaas == pytest.approx(1.25e6 / (3 * MIB))
    assert op.bottleneck == "prfaas-bandwidth"
    assert op.lambda_max == pytest.approx(op.theta_prfaas / 0.5)
    assert op.egress_utilization == pytest.approx(1.0)  # at Λ_max the link is exactly full


def test_a_stage_without_traffic_sets_no_limit():
    everything_local = point(toy_profile(), TWO, 5000, Counts(2, 1, 1))
    assert everything_local.p == 0 and everything_local.theta_prfaas == 0
    assert everything_local.lambda_max == pytest.approx(1 / 4.0)  # PD-P at l_short = E[L] = 2000: 4 s
    everything_remote = point(toy_profile(), TWO, 0, Counts(2, 0, 1))
    assert everything_remote.p == 1 and everything_remote.theta_pd_p == 0
    assert everything_remote.lambda_max == pytest.approx(2 / 2.0)  # PrfaaS at E[L] = 2000: 2 s each
    assert everything_remote.bottleneck == "prfaas-compute"


def test_decode_binds_when_decode_is_scarce():
    op = point(toy_profile(), TWO, 2000, Counts(20, 20, 1))
    assert op.bottleneck == "pd-d" and op.lambda_max == pytest.approx(10)


def test_expected_mode_averages_service_times_over_each_side():
    convex = PrfaasProfile.from_dict({
        "prfaas": {"lengths": [1000, 2000, 3000], "prefill_s": [1.0, 2.0, 9.0], "kv_mib": [1, 2, 3]},
        "pd_prefill": {"lengths": [1000, 3000], "prefill_s": [1.0, 3.0]},
        "decode": {"tokens_per_s": 100}, "egress_gbps": 100})
    three = LengthDistribution.from_samples([500, 1000, 3000], 10)
    representative = route_workload(convex, three, [600])
    expected = route_workload(convex, three, [600], mode="expected")
    assert representative.t_long[0] == pytest.approx(convex.prfaas.t_prefill(2000))   # T(E[L|L>t]) = 2 s
    assert expected.t_long[0] == pytest.approx((1.0 + 9.0) / 2)                      # E[T(L)|L>t] = 5 s
    with pytest.raises(ValueError, match="mode"):
        route_workload(convex, three, [600], mode="median")


def test_throughputs_are_vectorised_over_thresholds():
    routed = route_workload(toy_profile(), TWO, [0, 2000, 5000])
    th = throughputs(toy_profile(), routed, Counts(2, 1, 1), 10)
    assert th.lambda_max.shape == (3,)
    assert np.isinf(th.pd_p_per_rest[0]) and np.isinf(th.prfaas_per_p[2])
    assert th.lambda_max[1] == pytest.approx(1.0)


def test_counts_refuse_negative_instances():
    with pytest.raises(ValueError):
        Counts(-1, 1, 1)
