"""The §3.4.2 grid search, Table 6's baselines and the reproduction of PrfaaS §4 from bench's profile."""

import json
from pathlib import Path

import numpy as np
import pytest

from kvcentric.core.prfaas.planner import naive, homogeneous, plan, search, threshold_grid, ttft
from kvcentric.core.prfaas.profile import PrfaasProfile
from kvcentric.core.prfaas.throughput import Counts, route_workload, throughputs
from kvcentric.core.prfaas.workload import LengthDistribution, lognormal

ROOT = Path(__file__).resolve().parents[2]


def toy_profile(egress_gbps=100.0, pd_slowdown=2.0, decode_tokens_per_s=100.0) -> PrfaasProfile:
    return PrfaasProfile.from_dict({
        "prfaas": {"lengths": [1000, 100000], "prefill_s": [0.5, 50.0], "kv_mib": [10, 1000]},
        "pd_prefill": {"lengths": [1000, 100000], "prefill_s": [0.5 * pd_slowdown, 50.0 * pd_slowdown]},
        "decode": {"tokens_per_s": decode_tokens_per_s}, "egress_gbps": egress_gbps})


SPREAD = LengthDistribution.from_samples([1000, 2000, 4000, 8000, 16000, 32000], output_length=100)


def test_threshold_grid_spans_all_offloaded_to_none_offloaded():
    grid = threshold_grid(SPREAD, 50)
    p = SPREAD.split(grid)[0]
    assert grid[0] == 0 and p[0] == 1.0 and p[-1] == 0.0
    assert np.all(np.diff(grid) > 0)


def test_search_returns_the_best_cell_of_the_grid():
    profile = toy_profile()
    best, grid, lam = search(profile, SPREAD, 2, 6, points=80)
    assert best.lambda_max == pytest.approx(lam.max())
    routed = route_workload(profile, SPREAD, grid)
    for n_p in range(7):  # brute force over the same grid
        th = throughputs(profile, routed, Counts(2, n_p, 6 - n_p), SPREAD.output_length)
        assert th.lambda_max.max() <= best.lambda_max + 1e-12
    assert best.counts.prfaas == 2 and best.counts.pd_prefill + best.counts.decode == 6


def test_a_faster_prfaas_cluster_takes_more_of_the_traffic():
    slow_local = search(toy_profile(pd_slowdown=4.0), SPREAD, 2, 6)[0]
    fast_local = search(toy_profile(pd_slowdown=1.2), SPREAD, 2, 6)[0]
    assert slow_local.p > fast_local.p


def test_a_thin_link_raises_the_threshold_to_ship_less_kv_per_second():
    wide = search(toy_profile(egress_gbps=100.0), SPREAD, 4, 6)[0]
    thin = search(toy_profile(egress_gbps=0.05), SPREAD, 4, 6)[0]
    assert thin.threshold > wide.threshold
    assert thin.egress_gbps <= 0.05 * (1 + 1e-9)


def test_decode_bound_ties_take_the_most_producer_headroom():
    profile = toy_profile(pd_slowdown=1.0, decode_tokens_per_s=5.0)  # 0.05 req/s per decode instance
    best, grid, lam = search(profile, SPREAD, 1, 6, points=200)
    assert best.counts == Counts(1, 1, 5) and best.bottleneck == "pd-d"
    assert best.lambda_max == pytest.approx(0.25)
    routed = route_workload(profile, SPREAD, grid)
    th = throughputs(profile, routed, best.counts, SPREAD.output_length)
    plateau = th.lambda_max >= 0.25 * (1 - 1e-9)
    assert plateau.sum() > 1  # several thresholds tie ...
    headroom = np.minimum(th.prfaas_per_p, th.pd_p_per_rest)
    chosen = int(np.flatnonzero(grid == best.threshold)[0])
    assert headroom[chosen] == pytest.approx(headroom[plateau].max())  # ... and the roomiest one is taken


def test_all_offloaded_is_chosen_when_decode_is_all_that_matters():
    best = search(toy_profile(decode_tokens_per_s=1.0), SPREAD, 4, 6)[0]
    assert best.counts == Counts(4, 0, 6) and best.p == 1.0 and best.bottleneck == "pd-d"


def test_homogeneous_and_naive_baselines():
    profile = toy_profile()
    hom = homogeneous(profile, SPREAD, 8)
    assert hom.point.p == 0 and hom.point.counts.prfaas == 0
    assert hom.point.counts.pd_prefill + hom.point.counts.decode == 8
    nai = naive(profile, SPREAD, 2, 6)
    assert nai.point.p == 1 and nai.point.counts == Counts(2, 0, 6)
    assert nai.ttft_mean_s == pytest.approx(float(SPREAD.weights @ profile.prfaas.t_prefill(SPREAD.lengths)))


def test_ttft_is_prefill_latency_on_the_routed_hardware():
    profile = toy_profile()
    two = LengthDistribution.from_samples([1000, 10000], 10)
    mean, p90 = ttft(profile, two, threshold=5000)
    assert mean == pytest.approx((1.0 + 5.0) / 2)  # 1000 on PD-P (2x slower): 1.0 s; 10000 on PrfaaS: 5.0 s
    assert p90 == pytest.approx(5.0)


def test_plan_holds_both_figure5_searches_and_the_balance():
    result = plan(toy_profile(), SPREAD, 2, 6, points=40)
    data = json.loads(json.dumps(result.to_dict()))  # JSON-safe
    assert data["figure5a_split_search"]["n_p"] == list(range(7))
    assert len(data["figure5b_threshold_search"]["threshold"]) == len(data["figure5b_threshold_search"]["lambda_max"])
    assert data["ratio_vs_homogeneous"]["prfaas_pd"] == pytest.approx(result.speedup)
    assert set(data["balance"]) == {"eq7_prfaas_per_p_over_pd_p_per_rest", "eq8_producers_over_decode"}


def test_plan_warns_when_the_workload_leaves_the_profiled_lengths():
    result = plan(toy_profile(), LengthDistribution.from_samples([10, 200000], 10), 1, 2, points=10)
    assert any("outside the prfaas profile" in w for w in result.warnings)


def test_bench_profile_reproduces_table6_shape():
    """bench/papers/prfaas_table6.py's derived profile: Table 6's split and threshold within its rounding."""
    path = ROOT / "bench" / "papers" / "prfaas_profile_table5.json"
    profile = PrfaasProfile.load(path)
    result = plan(profile, lognormal(9.90, 1.00, 128, 131072, 1024), 4, 8, 12)
    best = result.prfaas_pd.point
    assert best.counts == Counts(4, 3, 5)                   # paper: 4 / 3 / 5
    assert 17_000 < best.threshold < 22_000                 # paper: 19.4K
    assert 0.45 < best.p < 0.55                             # paper: 49.6%
    assert result.homogeneous.point.counts == Counts(0, 9, 3)  # paper: — / 9 / 3
    assert 1.35 < result.speedup < 1.65                     # paper: 1.54x
    assert best.bottleneck == "prfaas-compute" and best.egress_utilization < 0.2  # compute-bound, ~13% of link
