"""Conductor replicas: the lowest live id leads (time passed in), and only the leader's re-planning loop
decides role switches; every replica samples the pools."""

from __future__ import annotations

import asyncio
import collections
import logging

from factories import make_two_cluster_conductor
from kvc_conductor.replanning import ReplanLoop
from kvcentric.core.prfaas.replan import ReplanPolicy, Replanner
from kvcentric.core.prfaas.replanning import ThresholdRetuner
from kvcentric.core.scheduling.leadership import Leadership
from kvcentric.runtime.bus import Bus


def test_the_lowest_live_conductor_leads_and_a_newcomer_waits_one_lease_before_it_acts():
    a, b = Leadership("conductor", started=0.0, lease_s=1.5), Leadership("conductor-1", started=0.0, lease_s=1.5)
    assert not a.leads(1.0)  # too soon: it has not heard whether a lower id is alive
    for now in (1.0, 1.5, 2.0):
        a.heard("conductor-1", now)
        b.heard("conductor", now)
        a.heard("conductor", now)  # its own heartbeat, echoed back: ignored
    assert a.leads(2.0) and not b.leads(2.0)
    assert a.replicas(2.0) == b.replicas(2.0) == ["conductor", "conductor-1"]
    assert b.leader(3.6) == "conductor-1" and b.leads(3.6)  # "conductor" silent for more than a lease
    b.heard("conductor", 4.0)  # it came back
    assert b.leader(4.0) == "conductor" and not b.leads(4.0)


def test_only_the_leader_decides_role_switches_and_every_replica_samples_the_pools():
    counters: collections.Counter[str] = collections.Counter()
    log = logging.getLogger("kvcentric.test")
    planner = Replanner(ReplanPolicy(window_s=10.0, imbalance=1.25), bs_max=8, decode_time_s=2.0)
    loop = ReplanLoop(make_two_cluster_conductor(), Bus("conductor-test", counters, log), counters, log, planner,
                      ThresholdRetuner(None))
    sampled, decided = [], []
    planner.observe = lambda *args: sampled.append(args)  # type: ignore[method-assign]
    planner.decide = lambda *args: decided.append(args)  # type: ignore[method-assign]
    asyncio.run(loop.tick(leads=False))
    assert len(sampled) == 1 and decided == []
    asyncio.run(loop.tick(leads=True))
    assert len(sampled) == 2 and len(decided) == 1


def test_a_gateway_sees_every_live_replica_as_a_peer_and_forgets_one_that_no_longer_answers():
    gateway = Leadership("gateway-1", started=0.0, lease_s=1.5)
    gateway.heard("conductor-0", 0.0)
    gateway.heard("conductor-1", 1.0)
    assert gateway.peers(1.0) == ["conductor-0", "conductor-1"]
    assert gateway.peers(2.0) == ["conductor-1"]  # conductor-0 stopped heartbeating 2 s ago
    gateway.forget("conductor-1")
    assert gateway.peers(2.0) == []
