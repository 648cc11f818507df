"""The closed-form decode batch: k steps at once equal k single steps."""

import random

import pytest

from kvcentric.core.costmodel import CostModel
from kvcentric.core.sim.batch import DecodeBatch
from kvcentric.core.sim.instances import _slow_steps

COST = CostModel((0.0, 1e-3, 0.0, 0.0), (0.01, 1e-3, 1e-6), 1000)


def test_k_steps_last_as_long_as_k_single_steps():
    batch = DecodeBatch(COST)
    for i in range(5):
        batch.add(f"r{i}", 1000 * (i + 1), 100)
    single, kv = 0.0, batch.kv_tokens
    for _ in range(37):
        single += COST.t_decode(5, kv)
        kv += 5
    assert batch.duration(37) == pytest.approx(single)


def test_steps_within_is_the_inverse_of_duration():
    rng = random.Random(1)
    batch = DecodeBatch(COST)
    for i in range(7):
        batch.add(i, rng.randrange(100, 50_000), 1000)
    for _ in range(50):
        seconds = rng.uniform(0, 20)
        k = batch.steps_within(seconds)
        assert batch.duration(k) <= seconds < batch.duration(k + 1)


def test_advance_finishes_items_in_step_order_and_grows_the_context():
    batch = DecodeBatch(COST)
    batch.add("short", 100, 2)
    batch.add("long", 100, 5)
    assert batch.steps_to_next_finish() == 2
    assert batch.advance(2) == ["short"] and batch.kv_tokens == 204
    batch.release(102)
    assert batch.steps_to_next_finish() == 3 and batch.advance(3) == ["long"]
    assert batch.steps_within(1.0) == 0  # empty batch


def test_slow_steps_counts_the_steps_of_a_segment_over_the_slo():
    for first, growth, steps, slo in ((0.01, 0.001, 20, 0.0155), (0.02, 0.0, 5, 0.015), (0.01, 0.0, 5, 0.015),
                                      (0.01, 0.002, 3, 0.1)):
        expected = sum(first + growth * j > slo for j in range(steps))
        assert _slow_steps(first, growth, steps, slo) == expected
