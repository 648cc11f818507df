"""The simulator with a PrfaaS cluster (two clusters joined by a bandwidth-limited link): the conductor's
routing, the PrfaaS hardware's own cost model, the KV crossing the link, and decode's BS_max."""

import pytest

from factories import simple_cost, two_cluster_setup
from kvcentric.core.costmodel import CostModel
from kvcentric.core.scheduling.config import SchedulerConfig
from kvcentric.core.sim.cluster import ClusterSpec, Simulation
from kvcentric.core.sim.workload import SimRequest

FAST = CostModel((0.0, 1e-4, 0.0, 0.0), (0.01, 1e-3, 0.0), 1000, "fast", kv_bytes_fixed=500_000)
"""PrfaaS hardware: 10x faster prefill; KV = 0.5 MB fixed + 1 KB per token."""


def simulate(requests, gbps=8.0, prfaas=1, prefill=1, decode=1, max_batch=0, threshold=1000):
    spec = ClusterSpec(prefill=prefill, decode=decode, prfaas=prfaas, decode_max_batch=max_batch,
                       link_bytes_per_s=1e12, num_layers=10)
    setup = two_cluster_setup(threshold=threshold, gbps=gbps, costs={"prfaas": FAST})
    sim = Simulation(SchedulerConfig(block_size=100, rejection="never"), simple_cost(), spec, setup)
    return sim, {r.request.request_id: r for r in sim.run(requests, sample_s=0)}


def req(name, at, n, out=11):
    return SimRequest(name, at, n, out, [f"{name}.{i}" for i in range(-(-n // 100))])


def test_long_requests_prefill_on_the_prfaas_hardware_and_short_ones_locally():
    sim, records = simulate([req("short", 0.0, 500), req("long", 0.0, 5000)])
    assert records["short"].prefill_id == "p0" and records["long"].prefill_id == "r0"
    assert records["short"].ttft_s == pytest.approx(0.5) and records["long"].ttft_s == pytest.approx(0.5)
    assert {r.decode_id for r in records.values()} == {"d0"} and all(r.status == "completed" for r in records.values())
    assert sim.prefills["r0"].kv_bytes_sent == 500_000 + 5000 * 1000 and sim.prefills["p0"].kv_bytes_sent == 0


def test_the_kv_of_a_prfaas_prefill_crosses_the_link_before_decode_starts():
    _, fast_link = simulate([req("long", 0.0, 5000)], gbps=8.0)  # 5.5 MB at 1 GB/s: within the prefill
    _, slow_link = simulate([req("long", 0.0, 5000)], gbps=0.008)  # at 1 MB/s: 5.5 s
    assert slow_link["long"].finish - fast_link["long"].finish == pytest.approx(5.5 - 0.5, abs=0.02)


def test_the_link_is_shared_first_come_first_served():
    _, records = simulate([req("a", 0.0, 5000), req("b", 0.0, 5000)], gbps=0.008, prfaas=2)
    gap = abs(records["b"].finish - records["a"].finish)
    assert gap == pytest.approx(5.5, abs=0.05)  # the second push waits for the first


def test_without_pd_prefill_instances_everything_goes_remote():
    _, records = simulate([req("short", 0.0, 200), req("long", 0.0, 5000)], prefill=0, threshold=0)
    assert {r.prefill_id for r in records.values()} == {"r0"}


def test_decode_holds_at_most_bs_max_sequences():
    _, records = simulate([req(f"q{i}", 0.0, 200, out=101) for i in range(3)], max_batch=2)
    finishes = sorted(r.finish for r in records.values())
    assert finishes[2] - finishes[0] > 0.5  # the third waited for a slot (100 steps of >= 10 ms)


def test_a_fixed_kv_size_survives_the_cost_model_file():
    assert CostModel.from_dict(FAST.to_dict()) == FAST and FAST.kv_bytes(0) == 0
    assert "kv_bytes_fixed" not in simple_cost().to_dict()
