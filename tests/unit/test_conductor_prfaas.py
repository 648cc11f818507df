"""PrfaaS routing in the Conductor core (§3.3, §3.4.3) on hand-built two-cluster cases: PD cluster "pd"
(prefill a0.., decode d0..) and PrfaaS cluster "prfaas" (prefill r0..), blocks of 100 tokens, t = 1000."""

import pytest

from factories import (decode_report, make_conductor, make_two_cluster_conductor, prefill_report,
                       schedule_request, simple_cost, two_cluster_setup)
from kvcentric.core.costmodel import CostModel
from kvcentric.core.protocol import Placement, Rejection
from kvcentric.core.scheduling.clusters import ClusterSetup


def place(conductor, n_tokens, hits=None, now=0.1, request_id="r"):
    decision = conductor.schedule(schedule_request(n_tokens, request_id), hits or {}, now)
    assert isinstance(decision, Placement), decision
    return decision


def test_short_requests_prefill_locally_and_long_ones_in_the_prfaas_cluster():
    conductor = make_two_cluster_conductor()
    assert place(conductor, 1000, request_id="short").prefill_id == "a0"  # l = t stays local
    long = place(conductor, 1001, request_id="long")
    assert long.prefill_id == "r0" and long.decode_id == "d0"
    assert conductor.router.stats["routed_pd"] == 1 and conductor.router.stats["routed_prfaas"] == 1


def test_decode_never_runs_in_the_prfaas_cluster():
    conductor = make_two_cluster_conductor(decodes=0)
    conductor.observe(decode_report("rd", cluster="prfaas"), 0.0)
    decision = conductor.schedule(schedule_request(5000), {}, 0.1)
    assert isinstance(decision, Rejection) and decision.reason == "no_instance"
    conductor.observe(decode_report("d0", running=50, cluster="pd"), 0.1)
    assert place(conductor, 5000).decode_id == "d0"


def test_the_threshold_applies_to_the_uncached_length():
    conductor = make_two_cluster_conductor()
    decision = place(conductor, 3000, hits={"a0": 25})  # 2500 cached in pd: l = 500 <= t
    assert decision.prefill_id == "a0" and decision.cached_tokens == 2500 and decision.kv_source_id == ""


def test_ample_bandwidth_counts_the_best_prefix_anywhere_and_pulls_it_across():
    conductor = make_two_cluster_conductor()
    decision = place(conductor, 3000, hits={"r0": 25})  # the prfaas node holds 2500: l = 500 <= t
    assert decision.prefill_id == "a0" and decision.kv_source_id == "r0"
    assert decision.kv_source_addr == "r0:7000" and decision.pull_block_hashes == [f"h{i}" for i in range(25)]
    assert decision.cached_tokens == 2500
    assert conductor.router.stats["cross_cluster_transfers"] == 1


def scarce(conductor, now=2.0, gbps=8.0):
    """Reports saying r0 pushed at the link's full rate for two seconds."""
    rate = gbps * 1e9 / 8
    for t in (0.0, 1.0, now):
        conductor.observe(prefill_report("r0", cluster="prfaas", kv_bytes_sent=int(rate * t)), t)
    for name in ("a0", "d0"):
        conductor.observe((prefill_report if name == "a0" else decode_report)(name, cluster="pd"), now)


def test_scarce_bandwidth_judges_each_clusters_prefix_on_its_own_and_moves_no_cache():
    conductor = make_two_cluster_conductor()
    scarce(conductor)
    assert conductor.router.utilization("prfaas", conductor.prefill_views(2.0), 2.0) == pytest.approx(1.0)
    decision = place(conductor, 3000, hits={"r0": 25}, now=2.0)  # l judged against pd's own prefix: 3000 > t
    assert decision.prefill_id == "r0" and decision.kv_source_id == "" and decision.cached_tokens == 2500


def test_long_request_with_its_prefix_in_pd_goes_to_prfaas_with_the_prefix_when_bandwidth_is_ample():
    conductor = make_two_cluster_conductor()
    decision = place(conductor, 5000, hits={"a0": 20})  # l = 3000 > t even with pd's 2000
    assert decision.prefill_id == "r0" and decision.kv_source_id == "a0" and decision.cached_tokens == 2000


def test_egress_near_its_ceiling_raises_t_after_the_adjust_interval():
    conductor = make_two_cluster_conductor(setup=two_cluster_setup(adjust_s=1.0))
    scarce(conductor)
    assert place(conductor, 1200, now=2.0).prefill_id == "a0"  # t stepped to 1250 before routing
    assert conductor.router.threshold == pytest.approx(1250)
    place(conductor, 1200, now=2.5, request_id="again")
    assert conductor.router.threshold == pytest.approx(1250)  # not again within the interval


def test_a_long_prfaas_queue_raises_t_and_calm_brings_it_back_to_the_plan():
    conductor = make_two_cluster_conductor(setup=two_cluster_setup(adjust_s=1.0))
    conductor.observe(prefill_report("r0", queue_s=30.0, cluster="prfaas"), 0.0)
    place(conductor, 500, now=0.0)
    assert conductor.router.threshold == pytest.approx(1250)
    for report in (prefill_report("r0", cluster="prfaas"), prefill_report("a0", cluster="pd"),
                   decode_report("d0", cluster="pd")):
        conductor.observe(report, 1.0)
    place(conductor, 500, now=1.0, request_id="calm")
    assert conductor.router.threshold == pytest.approx(1000)
    assert "planned" in conductor.router.last_change.reason


def test_a_long_local_queue_with_prfaas_idle_lowers_t():
    conductor = make_two_cluster_conductor(setup=two_cluster_setup(adjust_s=1.0))
    conductor.observe(prefill_report("a0", queue_s=30.0, cluster="pd"), 0.0)
    assert place(conductor, 900, now=0.0).prefill_id == "r0"  # t fell to 800 first
    assert conductor.router.threshold == pytest.approx(800)


def test_the_prfaas_prefill_prediction_includes_the_kv_crossing_the_link():
    conductor = make_two_cluster_conductor(setup=two_cluster_setup(gbps=0.008))  # 1 MB/s; 1 KB per token
    first = place(conductor, 2000, now=0.0, request_id="a")
    assert first.prefill_id == "r0" and first.predicted_ttft_s == pytest.approx(2.0)  # 2 MB crossing, 2 s compute
    second = place(conductor, 2000, now=0.0, request_id="b")
    assert second.predicted_ttft_s == pytest.approx(4.0)  # behind the first on the link and the queue
    assert conductor.router.stats["kv_bytes_routed_remote"] == 4_000_000


def test_each_cluster_is_priced_with_its_own_cost_model():
    fast = CostModel((0.0, 1e-4, 0.0, 0.0), (0.01, 1e-3, 0.0), 1000, "fast")
    conductor = make_two_cluster_conductor(setup=two_cluster_setup(costs={"prfaas": fast}))
    assert place(conductor, 5000).predicted_ttft_s == pytest.approx(max(0.5, 0.005))
    assert place(conductor, 500, request_id="s").predicted_ttft_s == pytest.approx(0.5)


def test_an_empty_cluster_sends_its_requests_to_the_other():
    no_prfaas = make_two_cluster_conductor(prfaas_prefills=0)
    assert place(no_prfaas, 5000).prefill_id == "a0"
    no_pd_prefill = make_two_cluster_conductor(pd_prefills=0)
    assert place(no_pd_prefill, 10).prefill_id == "r0"


def test_instances_of_clusters_outside_the_topology_are_not_placed():
    conductor = make_two_cluster_conductor(pd_prefills=0, prfaas_prefills=0)
    conductor.observe(prefill_report("x0", cluster="elsewhere"), 0.0)
    decision = conductor.schedule(schedule_request(10), {}, 0.1)
    assert isinstance(decision, Rejection) and decision.reason == "no_instance"


def test_without_a_topology_the_cluster_names_do_not_matter():
    conductor = make_conductor(0, 0)
    conductor.observe(prefill_report("p0", cluster="prfaas"), 0.0)
    conductor.observe(decode_report("d0", cluster="anywhere"), 0.0)
    assert conductor.router is None and place(conductor, 5000).prefill_id == "p0"


def test_the_setup_must_name_a_pd_cluster_as_local():
    setup = two_cluster_setup()
    with pytest.raises(ValueError, match="not a pd cluster"):
        ClusterSetup(setup.topology, "prfaas", 1000)
    assert setup.prfaas == ("prfaas",) and simple_cost().kv_bytes(1) == 1000


def test_status_reports_threshold_egress_and_routes():
    conductor = make_two_cluster_conductor()
    place(conductor, 5000)
    status = conductor.router.status(conductor.prefill_views(0.1), 0.1)
    assert status["threshold"] == 1000 and status["routed"]["routed_prfaas"] == 1
    assert set(status["egress_utilization"]) == {"prfaas"}


TOPOLOGY = """clusters:
  - {name: pd, role: pd, instances: 2}
  - {name: prfaas, role: prfaas, instances: 1}
links:
  - {between: [prfaas, pd], gbps: 0.2}
"""


def test_the_conductor_flags_build_the_routing_and_name_the_flag_at_fault(tmp_path):
    from kvc_conductor.config import ConductorConfig
    from kvcentric.config import ConfigError
    path = tmp_path / "topology.yaml"
    path.write_text(TOPOLOGY)
    config = ConductorConfig(topology=str(path), cluster="pd", prfaas_threshold=256)
    setup = config.clusters()
    assert (setup.local, setup.prfaas, setup.threshold) == ("pd", ("prfaas",), 256.0)
    assert setup.link_bytes_per_s("prfaas", "pd") == pytest.approx(0.2e9 / 8)
    assert ConductorConfig().clusters() is None
    with pytest.raises(ConfigError, match="--cluster: 'local' must name a pd cluster"):
        ConductorConfig(topology=str(path))
    with pytest.raises(ConfigError, match="--topology: topology: cannot read"):
        ConductorConfig(topology=str(tmp_path / "missing.yaml"), cluster="pd")


def test_egress_use_is_measured_over_a_window_and_fades_when_reports_stop_counting_bytes():
    from kvcentric.core.scheduling.clusters import EgressMeter
    meter = EgressMeter(window_s=5.0)
    for t in range(11):
        meter.observe("r0", 1000 * t, float(t))
    assert meter.rate(["r0"], 10.0) == pytest.approx(1000)
    assert meter.rate(["r0"], 12.0) == pytest.approx(3000 / 5)  # from t = 7; nothing more sent since t = 10
    assert meter.rate(["r0"], 30.0) == 0.0 and meter.rate(["missing"], 30.0) == 0.0
    meter.observe("r0", 10, 31.0)  # a restarted instance starts its counter again
    assert meter.rate(["r0"], 31.0) == 0.0


def test_only_the_part_the_pd_cluster_lacks_crosses_the_link_and_decode_takes_the_prefix_locally():
    """PrfaaS §3.3: with 2000 of 5000 tokens cached in pd (a0), r0 ships 3000 tokens of KV; the decode
    instance pulls the 20 prefix blocks from a0."""
    conductor = make_two_cluster_conductor(setup=two_cluster_setup(gbps=0.008))  # 1 MB/s; 1 KB per token
    decision = place(conductor, 5000, hits={"a0": 20}, now=0.0)
    assert decision.prefill_id == "r0" and decision.decode_id == "d0"
    assert decision.decode_prefix_addr == "a0:7000" and decision.decode_prefix_tokens == 2000
    assert decision.decode_prefix_hashes == [f"h{i}" for i in range(20)]
    assert conductor.router.stats["kv_bytes_routed_remote"] == 3_000_000
    assert conductor.router.stats["kv_tokens_kept_local"] == 2000


def test_without_a_prefix_in_pd_the_whole_kv_crosses_and_decode_pulls_nothing():
    conductor = make_two_cluster_conductor()
    scarce(conductor)
    decision = place(conductor, 3000, hits={"r0": 25}, now=2.0)  # cached in prfaas only
    assert decision.prefill_id == "r0" and decision.decode_prefix_addr == "" and decision.decode_prefix_hashes == []
    local = place(conductor, 3000, hits={"a0": 25}, now=2.0, request_id="local")
    assert local.prefill_id == "a0" and local.decode_prefix_addr == ""  # local prefill: RDMA, nothing to keep


def test_a_whole_cached_prompt_keeps_all_but_its_last_token_local():
    conductor = make_two_cluster_conductor()
    scarce(conductor)
    conductor.router.threshold = -1.0  # every request goes remote, however much pd holds
    decision = place(conductor, 3000, hits={"a0": 30}, now=2.0)
    assert decision.prefill_id == "r0" and decision.decode_prefix_tokens == 2999
    assert len(decision.decode_prefix_hashes) == 30


def test_the_planners_profile_reaches_the_routing_for_short_term_re_derivation(tmp_path):
    from pathlib import Path

    from kvc_conductor.config import ConductorConfig
    path = tmp_path / "topology.yaml"
    path.write_text(TOPOLOGY)
    profile = Path(__file__).resolve().parents[2] / "bench" / "papers" / "prfaas_profile_table5.json"
    setup = ConductorConfig(topology=str(path), cluster="pd", replan_profile=str(profile)).clusters()
    assert setup is not None and setup.profile is not None and setup.profile.egress_gbps == 100
    assert ConductorConfig(topology=str(path), cluster="pd").clusters().profile is None
