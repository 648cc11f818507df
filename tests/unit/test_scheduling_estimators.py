"""Transfer links, decode forecasts and prefix matching: the pieces the Conductor's estimates rest on."""

import math

import pytest

from factories import simple_cost
from kvcentric.core.scheduling.estimators import DecodeForecast, Estimator, LinkTable
from kvcentric.core.scheduling.prefix import PrefixIndex, prefix_from_holders


def test_transfer_time_adds_the_bytes_already_queued_at_the_sender():
    links = LinkTable(1000.0)
    assert links.t_transfer("a", "b", 500, now=0.0) == pytest.approx(0.5)
    assert links.reserve("a", "b", 2000, now=0.0) == pytest.approx(2.0)
    assert links.t_transfer("a", "c", 500, now=0.5) == pytest.approx(1.5 + 0.5)
    assert links.t_transfer("b", "a", 500, now=0.5) == pytest.approx(0.5)  # b's egress is free
    links.set_bandwidth("a", "c", 500.0)
    assert links.t_transfer("a", "c", 500, now=3.0) == pytest.approx(1.0)


def test_estimator_counts_cached_blocks_in_tokens_and_always_computes_one_token():
    estimator = Estimator(simple_cost(), block_tokens=100)
    assert estimator.cached_tokens(1000, 3) == 300
    assert estimator.cached_tokens(1000, 50) == 999
    assert estimator.t_prefill(1000, 3) == pytest.approx(0.7)
    assert estimator.block_bytes(2) == 2 * 100 * 1000
    assert estimator.tbt(4, 100) == pytest.approx(0.014)
    assert estimator.tbt(4, 2000, capacity_tokens=1000) == math.inf


def test_forecast_counts_requests_decoding_in_a_window_of_t_d():
    forecast = DecodeForecast()
    for name, start in (("a", 1.0), ("b", 2.0), ("c", 5.0)):
        forecast.add(name, start, 100)
    assert forecast.at(0.5, t_d=3.0) == (0, 0)
    assert forecast.at(2.5, t_d=3.0) == (2, 200)
    assert forecast.at(5.5, t_d=3.0) == (1, 100)  # a and b are done by then
    assert forecast.in_flight(1.5) == (2, 200)


def test_forecast_reconciles_with_a_report_and_the_difference_fades_over_t_d():
    forecast = DecodeForecast()
    forecast.add("a", 0.0, 100)
    forecast.reconcile(running=5, kv_tokens=900, now=1.0, t_d=10.0)  # 4 we did not place
    assert forecast.at(1.0, t_d=10.0) == (5, 900)
    assert forecast.at(6.0, t_d=10.0) == pytest.approx((3.0, 500.0))
    assert forecast.at(11.0, t_d=10.0) == (0, 0)


def test_forecast_remove_and_expire():
    forecast = DecodeForecast()
    forecast.add("a", 1.0, 10)
    forecast.add("b", 1.0, 20)
    forecast.add("c", 9.0, 30)
    assert forecast.remove("b") and not forecast.remove("b")
    assert forecast.at(1.5, t_d=5.0) == (1, 10)
    forecast.expire(now=7.0, t_d=5.0)
    assert len(forecast) == 1 and forecast.by_request == {"c": 9.0}


def test_prefix_index_walks_each_instance_to_its_first_missing_block():
    index = PrefixIndex()
    index.add("p0", ["a", "b", "c"])
    index.add("p1", ["a", "c"])
    index.add("p2", ["x"])
    assert index.match(["a", "b", "c", "d"]) == {"p0": 3, "p1": 1}
    assert index.match(["x", "y"]) == {"p2": 1}
    assert index.match([]) == {} and index.match(["zz"]) == {}
    index.remove("p0", ["b"])
    assert index.match(["a", "b", "c"]) == {"p0": 1, "p1": 1}


def test_prefix_from_kvs_holders_ignores_the_tier():
    holders = [["p0:dram", "p1:gpu"], ["p0:dram", "p1:dram"], ["p1:dram"], []]
    assert prefix_from_holders(holders) == {"p0": 2, "p1": 3}
    assert prefix_from_holders([]) == {} and prefix_from_holders([[]]) == {}
