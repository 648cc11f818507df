"""Fault injection under steady streaming load on one real cluster (issue 15): for each fault of
`scenarios.FAULTS` (kill -9 and SIGSTOP of a decode, a prefill, a conductor and kvs-meta; nats-server and
redis-server restarted; a slow-receiver decode; 3x overload), no request waits past the fault's detection
time + 5 s, every answer is a success or a clean 429/503 with Retry-After in OpenAI's error shape, every
engine's KV blocks are free once idle again, and the cluster serves normally within 5 s of the fault's end.

The scenarios share one cluster: each starts once every child is back and sees the others (a killed one
restarted by `kvcentric up`), and ends with the load stopped and its KV accounted for."""

from __future__ import annotations

import json

import pytest

from scenarios import FAULTS, Fault, cluster, problems, run

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    with cluster(str(tmp_path_factory.mktemp("up-faults"))) as running:
        yield running


@pytest.mark.timeout(600)  # the first one starts the cluster too
@pytest.mark.parametrize("fault", FAULTS, ids=[f"{fault.target}-{fault.action}" for fault in FAULTS])
def test_every_request_ends_cleanly_and_the_cluster_recovers(up, fault: Fault):
    figured, wrong = run(up, fault)
    print(json.dumps(figured.as_row()))
    assert figured.sent > 0 and figured.completed > 0, figured
    found = problems(figured, wrong)
    assert found == {}, json.dumps({"problems": found, "figures": figured.as_row()}, indent=1)
