"""The conductor's re-planning loop without servers: after a role change shows in the load reports, t is
re-planned with `planner.best_threshold` for the new counts over the lengths it placed."""

from __future__ import annotations

import collections
import logging
from pathlib import Path

from factories import make_two_cluster_conductor
from kvc_conductor.replanning import ReplanLoop
from kvcentric.core.prfaas.planner import best_threshold
from kvcentric.core.prfaas.profile import PrfaasProfile
from kvcentric.core.prfaas.replan import ReplanPolicy, Replanner
from kvcentric.core.prfaas.replanning import ThresholdRetuner
from kvcentric.core.prfaas.throughput import Counts
from kvcentric.core.prfaas.workload import LengthDistribution
from kvcentric.core.protocol import Placement, ScheduleRequest
from kvcentric.runtime.bus import Bus

PROFILE = Path(__file__).resolve().parents[2] / "bench" / "papers" / "prfaas_profile_table5.json"


def loop_for(conductor, profile: str = str(PROFILE)) -> ReplanLoop:
    counters: collections.Counter[str] = collections.Counter()
    log = logging.getLogger("kvcentric.test")
    planner = Replanner(ReplanPolicy(window_s=10.0, imbalance=1.25), bs_max=8, decode_time_s=2.0)
    retuner = ThresholdRetuner(PrfaasProfile.load(profile) if profile else None)
    return ReplanLoop(conductor, Bus("conductor-test", counters, log), counters, log, planner, retuner)


def test_t_is_replanned_for_the_new_counts_once_the_switch_shows():
    conductor = make_two_cluster_conductor(pd_prefills=2, prfaas_prefills=1, decodes=1)
    loop = loop_for(conductor)
    lengths = [2_000 + 1_500 * i for i in range(40)]
    for i, n in enumerate(lengths):
        loop.placed(ScheduleRequest(request_id=f"r{i}", n_tokens=n, block_hashes=[], max_tokens=256),
                    Placement(request_id=f"r{i}", prefill_id="a0", decode_id="d0", decode_kv_addr="",
                              cached_tokens=0, predicted_ttft_s=0.1, predicted_tbt_s=0.01))
    loop.retuner.expect(1, 2)
    loop.retune_threshold(2, 1, 0.5)  # the switch has not shown yet: t stays
    assert conductor.router.stats["threshold_replans"] == 0
    loop.retune_threshold(1, 2, 0.5)
    want = best_threshold(PrfaasProfile.load(PROFILE), LengthDistribution.from_samples(lengths, 256), Counts(1, 1, 2))
    assert conductor.router.threshold == want.threshold == conductor.router.setup.threshold
    assert conductor.router.stats["threshold_replans"] == 1 and loop.expected is None


def test_without_a_profile_only_the_roles_change():
    conductor = make_two_cluster_conductor()
    loop = loop_for(conductor, profile="")
    before = conductor.router.threshold
    loop.retuner.expect(1, 1)
    loop.retune_threshold(1, 1, 0.5)
    assert conductor.router.threshold == before and loop.expected is None
