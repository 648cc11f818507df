"""Each list of policy names is kept once, in its core module: the flags offer exactly those names and
the factories build exactly those policies."""

from __future__ import annotations

import argparse
import typing

import pytest

from factories import prefill_view
from kvcentric.config import add_arguments
from kvcentric.core.costmodel import CostModel
from kvcentric.core.scheduling.admission import REJECTION_MODES, Admission
from kvcentric.core.scheduling.config import SchedulerConfig
from kvcentric.core.scheduling.estimators import Estimator, LinkTable
from kvcentric.core.scheduling.eviction import EVICTION_POLICIES, POLICIES, make_policy as make_eviction
from kvcentric.core.scheduling.policies import PLACEMENT_POLICIES, best_holder, make_policy
from kvcentric.engine.config import EngineConfig
from kvcentric.tools.sim import SimConfig

COST = CostModel((0.0, 1e-3, 0.0, 0.0), (0.01, 1e-3, 0.0), 1000, "test")


def choices(config: type, field: str) -> list[str]:
    parser = argparse.ArgumentParser()
    add_arguments(parser, config)
    return next(action.choices for action in parser._actions if action.dest == field)


@pytest.mark.parametrize("name", PLACEMENT_POLICIES)
def test_every_placement_name_builds_the_policy_of_that_name(name):
    assert make_policy(name, Estimator(COST, 16), LinkTable(1e9)).name == name


@pytest.mark.parametrize("name", EVICTION_POLICIES)
def test_every_eviction_name_builds_the_policy_of_that_name(name):
    assert make_eviction(name).name == name


def test_the_eviction_factories_are_the_eviction_names():
    assert tuple(POLICIES) == EVICTION_POLICIES


@pytest.mark.parametrize("mode", REJECTION_MODES)
def test_every_rejection_mode_is_an_admission_mode(mode):
    assert Admission(mode, Estimator(COST, 16), 1.0, 0.1).mode == mode


@pytest.mark.parametrize("config, field, names", [
    (SchedulerConfig, "policy", PLACEMENT_POLICIES),
    (SchedulerConfig, "rejection", REJECTION_MODES),
    (SimConfig, "eviction", EVICTION_POLICIES),
    (EngineConfig, "host_pool_policy", EVICTION_POLICIES),
])
def test_the_flags_offer_exactly_the_core_names(config, field, names):
    assert tuple(choices(config, field)) == names
    assert typing.get_args(typing.get_type_hints(config)[field]) == names


def test_the_best_holder_is_the_instance_with_the_longest_prefix():
    pool = [prefill_view(f"p{i}", prefix=blocks) for i, blocks in enumerate((2, 5, 5))]
    assert best_holder(pool) == (pool[1], 5)
    pool = [prefill_view(f"p{i}") for i in range(3)]  # the prefix is held elsewhere
    assert best_holder(pool) == (None, 0)
