"""LayerKV's pure parts against hand-computed cases: layer placement (eq. 4, §3.1.2), the layer-wise block pool
and its per-layer tables, the SLO-aware scheduler (eqs. 1–3, Algorithm 1) and the free-block forecast (eq. 5)."""

import math

import pytest

from kvcentric.core.block_pool import OutOfBlocks
from kvcentric.core.layerkv.placement import min_retained_layers, offloaded_layers, retained_layers
from kvcentric.core.layerkv.pool import LayerBlockPool, Move, host_home
from kvcentric.core.layerkv.scheduler import (Decoding, Holding, PrefillCost, admitted_prefills, forecast_free,
                                              offload_victims, prefill_budget_s, request_slack_s, schedule_prefills)


def test_retained_layers_spread_evenly_as_the_paper_example():
    assert retained_layers(8, 4) == [1, 3, 5, 7]  # §3.1.2: keep 1, 3, 5, 7; offload 0, 2, 4, 6
    assert offloaded_layers(8, retained_layers(8, 4)) == [0, 2, 4, 6]
    assert retained_layers(8, 4, phase=1) == [0, 2, 4, 6]
    assert retained_layers(8, 2) == [3, 7]
    assert retained_layers(8, 3) == [1, 4, 7]
    assert retained_layers(8, 8) == list(range(8))
    assert retained_layers(8, 0) == []
    with pytest.raises(ValueError):
        retained_layers(8, 9)


def test_min_retained_layers_hides_the_offload_behind_the_prefill():
    # One layer of 1000 tokens: 2 * 1000 * 4 heads * 64 * 4 bytes = 2.048 MB, 2.048 ms at 1 GB/s.
    assert min_retained_layers(8, 0.010, 1000, 4, 64, 4, 1e9) == 8 - 4  # 10 ms hides 4 layers' offload
    assert min_retained_layers(8, 1.0, 1000, 4, 64, 4, 1e9) == 0  # a long prefill: every layer may leave
    assert min_retained_layers(8, 0.001, 1000, 4, 64, 4, 1e9) == 8  # too short to hide even one
    assert min_retained_layers(8, 1.0, 1000, 4, 64, 4, 0.0) == 8  # no link measured yet: keep all


def test_prompt_placement_puts_named_layers_on_the_device_and_the_rest_on_the_host():
    pool = LayerBlockPool(device_blocks=4, block_size=4, num_layers=4, host_blocks=8)
    pool.placement = [1, 3]
    blocks = pool.allocate(2)
    assert pool.device_layers(blocks) == [False, True, False, True]
    assert [len(free) for free in pool.device_free] == [4, 2, 4, 2]
    assert len(pool.host_free) == 4
    assert all(home < 0 for home in pool.layer_table(blocks, 0))
    assert all(home >= 0 for home in pool.layer_table(blocks, 3))
    assert pool.device_layer_blocks_of(blocks) == 4
    assert not pool.can_allocate(3)  # layers 1 and 3 have 2 device blocks left
    with pytest.raises(OutOfBlocks):
        pool.allocate(3)
    pool.placement = None
    pool.free(blocks)
    assert [len(free) for free in pool.device_free] == [4, 4, 4, 4] and len(pool.host_free) == 8


def test_growth_goes_to_the_device_where_a_layer_has_room_else_the_host():
    pool = LayerBlockPool(device_blocks=1, block_size=4, num_layers=2, host_blocks=2)
    pool.placement = [0]
    first = pool.allocate(1)  # layer 0's only device block
    pool.placement = None
    grown = pool.allocate(1)
    assert pool.device_layers(grown) == [False, True]
    assert pool.layer_table(first + grown, 0) == [0, host_home(1)]  # host blocks are handed out from 0 up
    assert pool.layer_table(first + grown, 1) == [host_home(0), 0]
    assert not pool.can_allocate(1)  # no device block left in either layer and no host block


def test_offload_moves_device_layers_to_the_host_and_queues_the_copies():
    pool = LayerBlockPool(device_blocks=2, block_size=4, num_layers=2, host_blocks=4)
    blocks = pool.allocate(1)
    assert pool.device_layers(blocks) == [True, True]
    device_homes = [pool.layer_table(blocks, layer)[0] for layer in range(2)]
    assert pool.offload(blocks) == 2
    assert pool.device_layers(blocks) == [False, False]
    assert pool.take_moves() == [Move(0, device_homes[0], 0), Move(1, device_homes[1], 1)]
    assert pool.take_moves() == []
    assert pool.device_free_layer_blocks == 4
    assert pool.stats["layerkv_layer_blocks_offloaded"] == 2


def test_fitting_layers_keeps_the_most_that_fit_above_the_reserve():
    pool = LayerBlockPool(device_blocks=4, block_size=4, num_layers=4, host_blocks=16)
    assert pool.fitting_layers(2, at_least=0, reserve=0) == [0, 1, 2, 3]
    assert pool.fitting_layers(2, at_least=0, reserve=9) == [0, 1, 3]  # 16 - 3 * 2 = 10 >= 9
    assert pool.fitting_layers(2, at_least=0, reserve=11) == [1, 3]  # 16 - 3 * 2 < 11 <= 16 - 2 * 2
    assert pool.fitting_layers(2, at_least=0, reserve=16) == []  # everything offloaded
    assert pool.fitting_layers(2, at_least=1, reserve=16) is None
    assert LayerBlockPool(4, 4, 4, 64).fitting_layers(5, at_least=4, reserve=0) == []  # longer than a layer
    pool.placement = [1, 3]
    pool.allocate(3)  # layers 1 and 3 have one block left: the other phase fits
    pool.placement = None
    assert pool.fitting_layers(2, at_least=2, reserve=0) == [0, 2]


def test_request_slack_and_budget_eq_1():
    # SLO 0.2 s, 10 generated, 30 to come, 2.5 s spent, TPOT now 0.05 s: 0.2 * 40 - 2.5 - 0.05 * 30 = 4.0
    early = Decoding(elapsed_s=2.5, generated=10, remaining=30)
    assert request_slack_s(early, 0.2, 0.05) == pytest.approx(4.0)
    late = Decoding(elapsed_s=11.0, generated=50, remaining=10)  # 0.2 * 60 - 11 - 0.5 = 0.5
    assert prefill_budget_s([early, late], 0.2, 0.05) == pytest.approx(0.5)
    assert prefill_budget_s([], 0.2, 0.05) == math.inf


def test_prefill_time_eq_3_and_admission_eq_2():
    cost = PrefillCost(params=1e9, num_layers=2, hidden=10, flops=1e12)
    assert cost.seconds(100) == pytest.approx((2e9 * 100 + 2 * 2 * 10 * 100 ** 2) / 1e12)
    assert cost.refit(100, 2 * cost.seconds(100), weight=1.0).alpha == pytest.approx(2.0)
    assert admitted_prefills([0.2, 0.25, 0.1], 0.5) == 2  # 0.45 fits, 0.55 does not
    assert admitted_prefills([0.6], 0.5) == 0
    assert admitted_prefills([], 0.5) == 0


def test_algorithm_1_admits_in_order_within_the_budget():
    cost = PrefillCost(params=1e6, num_layers=1, hidden=1, flops=1e12)  # 0.2 s + 0.02 s per 100K tokens
    late = Decoding(elapsed_s=11.0, generated=50, remaining=10)  # budget 0.5 s at SLO 0.2, TPOT 0.05
    admission = schedule_prefills([100_000, 100_000, 100_000], [late], 0.2, 0.05, cost)
    assert admission.budget_s == pytest.approx(0.5)
    assert admission.prefill_s == pytest.approx([0.22] * 3)
    assert admission.admitted == 2  # two fit in 0.5 s, three do not
    assert schedule_prefills([10 ** 9], [late], 0.0, 0.05, cost).admitted == 1  # no SLO: everything


def test_free_block_forecast_eq_5():
    a = Holding("a", remaining=10, device_layer_blocks=40, growth_layer_blocks=8)  # ends in stage 0
    b = Holding("b", remaining=40, device_layer_blocks=20, growth_layer_blocks=8)  # ends in stage 2
    # F1 = 100 + (40 + 8) - 16; F2 = 132 - 8; F3 = 124 + (20 + 8) - 8
    assert forecast_free(100, [a, b], stages=3, stage_tokens=16) == [100, 132, 124, 144]
    assert forecast_free(100, [b], stages=1, stage_tokens=16, prefill_layer_blocks=30) == [100, 62]


def test_offload_victims_newest_first_until_the_deficit_is_covered():
    newest_first = [Holding("c", 5, 0, 8), Holding("b", 5, 5, 8), Holding("a", 5, 10, 8), Holding("z", 5, 10, 8)]
    assert offload_victims([10, 4, 6], threshold=12, newest_first=newest_first) == ["b", "a"]
    assert offload_victims([20, 30], threshold=12, newest_first=newest_first) == []


def test_reload_brings_host_layers_back_where_the_device_has_room():
    pool = LayerBlockPool(device_blocks=2, block_size=4, num_layers=2, host_blocks=4)
    pool.placement = []  # every layer on the host
    blocks = pool.allocate(1)
    pool.placement = None
    assert pool.host_layer_blocks_of(blocks) == 2
    pool.device_free[1].clear()  # layer 1 has no room
    assert pool.reload(blocks) == 1
    assert pool.device_layers(blocks) == [True, False]
    assert pool.take_inbound() == [Move(0, 0, 0)]  # device block 0 of layer 0 from host block 0
    assert len(pool.host_free) == 3 and pool.stats["layerkv_layer_blocks_reloaded"] == 1
