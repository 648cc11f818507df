"""The conductor service on a real NATS server and a real kvs-meta on Redis: prefix-aware placement from
kvs-meta's block locations asked per request (`--prefix-index kvs-meta`; the local index has its own tests
in test_prefix_mirror.py), load-only placement while kvs-meta is down, rejections and outcomes on the wire."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import msgspec
import nats

from kvc_conductor.config import ConductorConfig
from kvc_conductor.service import ConductorService
from kvc_kvs_meta.config import KVSMetaConfig
from kvc_kvs_meta.service import KVSMetaService
from kvcentric.core.protocol import (BlockStored, KVEventBatch, KVSQuery, KVSReply, LoadReport, Placement, Rejection,
                                RequestOutcome, ScheduleReply, ScheduleRequest, Subjects, decode, encode)
from waiting import eventually, eventually_async


async def start_conductor(nats_url: str, **settings) -> ConductorService:
    config = ConductorConfig(nats_url=nats_url, instance_id="conductor-test", stale_after_s=600.0,
                             kvs_retry_times=2, kvs_retry_interval_ms=10, **settings)
    service = ConductorService(config)
    await service.open()
    return service


async def announce(nc, service: ConductorService, prefills=("p0", "p1"), decodes=("d0",)) -> None:
    for role, names in (("prefill", prefills), ("decode", decodes)):
        for name in names:
            report = LoadReport(instance_id=name, role=role, cluster="local", kv_addr=f"{name}.example:50061",
                                queued_requests=0, queued_tokens=0, running=0, kv_blocks_total=1000,
                                kv_blocks_free=1000, ts=0.0)
            await nc.publish(Subjects.load(role, name), encode(report))
    await eventually_async(lambda: (sorted(service.registry.prefill), sorted(service.registry.decode)),
                           "the conductor saw every instance",
                           until=lambda seen: len(seen[0]) == len(prefills) and len(seen[1]) == len(decodes))


async def schedule(nc, request: ScheduleRequest):
    reply = await nc.request(Subjects.SCHEDULE, encode(request), timeout=5)
    return decode(reply.data, ScheduleReply)


def fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=2) as response:
        return response.read().decode()


async def metrics(service: ConductorService) -> str:
    """GET /metrics from a thread: the service answers on this test's event loop."""
    return await asyncio.to_thread(fetch, f"http://127.0.0.1:{service.http_port}/metrics")


async def test_placement_follows_the_prefix_kvs_meta_knows(own_nats, redis_url):
    kvs = KVSMetaService(KVSMetaConfig(nats_url=own_nats, instance_id="kvs-test", redis_url=redis_url))
    await kvs.open()
    conductor = await start_conductor(own_nats, policy="cache_aware", prefix_index="kvs-meta")
    nc = await nats.connect(own_nats)
    try:
        await announce(nc, conductor)
        hashes = [f"conductor-test-{i}" for i in range(6)]
        batch = KVEventBatch(events=[BlockStored(node_id="p1", block_hashes=hashes[:4])])
        await nc.publish(Subjects.kv_events("p1"), encode(batch))

        async def holders() -> list[list[str]]:
            reply = await nc.request(Subjects.KVS_QUERY, encode(KVSQuery(block_hashes=hashes[:1])), timeout=2)
            return decode(reply.data, KVSReply).holders
        await eventually_async(holders, "kvs-meta lists p1's first block", until=lambda seen: seen == [["p1:dram"]])
        decision = await schedule(nc, ScheduleRequest(request_id="a", n_tokens=100, block_hashes=hashes,
                                                      max_tokens=8))
        assert isinstance(decision, Placement)
        assert decision.prefill_id == "p1" and decision.cached_tokens == 4 * 16
        assert decision.decode_id == "d0" and decision.decode_kv_addr == "d0.example:50061"
        assert "kvc_kvs_metadata_down" in await metrics(conductor) \
            and conductor.counters["kvs_query_failures_total"] == 0
    finally:
        await nc.close()
        await conductor.close()
        await kvs.close()


async def test_with_kvs_meta_down_the_conductor_places_by_load_only(own_nats):
    conductor = await start_conductor(own_nats, kvs_down_duration_s=600.0, prefix_index="kvs-meta")
    nc = await nats.connect(own_nats)
    try:
        await announce(nc, conductor)
        asks = [ScheduleRequest(request_id=f"r{i}", n_tokens=100, block_hashes=["x0", "x1"], max_tokens=8)
                for i in range(3)]
        decisions = [await schedule(nc, ask) for ask in asks]
        assert all(isinstance(d, Placement) for d in decisions)
        assert {d.prefill_id for d in decisions[:2]} == {"p0", "p1"}  # still balanced by queued time
        text = await metrics(conductor)
        assert 'kvc_kvs_metadata_down{role="conductor",instance="conductor-test"} 1.0' in text
        assert 'kvc_placements_load_only_total{role="conductor",instance="conductor-test"} 3' in text
        assert conductor.counters["kvs_query_failures_total"] == 2  # then no more asking while down
    finally:
        await nc.close()
        await conductor.close()


async def test_an_overloaded_cluster_gets_a_rejection_that_names_the_stage(own_nats):
    conductor = await start_conductor(own_nats, ttft_slo_s=1e-9, rejection="early", cost_source="prior")
    nc = await nats.connect(own_nats)
    try:
        await announce(nc, conductor, prefills=("p0",))
        decision = await schedule(nc, ScheduleRequest(request_id="big", n_tokens=1000, block_hashes=[], max_tokens=8))
        assert isinstance(decision, Rejection) and decision.reason == "overloaded"
        assert decision.stage == "prefill" and decision.load > 1 and decision.retry_after_s >= 1
    finally:
        await nc.close()
        await conductor.close()


async def test_outcomes_are_compared_with_the_predicted_ttft(own_nats):
    conductor = await start_conductor(own_nats)
    nc = await nats.connect(own_nats)
    try:
        await announce(nc, conductor)
        placed = await schedule(nc, ScheduleRequest(request_id="o1", n_tokens=100, block_hashes=[], max_tokens=8))
        outcome = RequestOutcome(request_id="o1", prefill_id=placed.prefill_id, decode_id=placed.decode_id,
                                 finish_reason="length", ttft_s=placed.predicted_ttft_s + 0.5, e2e_s=2.0,
                                 prompt_tokens=100, completion_tokens=8, predicted_ttft_s=placed.predicted_ttft_s)
        await nc.publish(Subjects.OUTCOME, encode(outcome))
        await eventually_async(lambda: conductor.core.stats["outcomes"], "the outcome was recorded",
                               until=lambda outcomes: outcomes == 1)
        text = await metrics(conductor)
        assert 'kvc_ttft_prediction_error_mean_s{role="conductor",instance="conductor-test"} -0.5' in text
    finally:
        await nc.close()
        await conductor.close()


def test_the_live_gateway_reports_outcomes_to_the_conductor(cluster):
    body = json.dumps({"model": "tiny", "prompt": "outcome please", "max_tokens": 4, "temperature": 0}).encode()
    request = urllib.request.Request(cluster.url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200
    urls = [service["health_url"].replace("/health", "/metrics") for name, service in
            cluster.manifest["services"].items() if name.startswith("conductor")]  # the one that placed it counts

    def outcomes() -> float:
        lines = [line for url in urls for line in fetch(url).splitlines() if line.startswith("kvc_ttft_outcomes_total")]
        return sum(float(line.split()[-1]) for line in lines)
    eventually(outcomes, "a conductor recorded an outcome", until=lambda count: count >= 1)

    def first_tokens() -> float:  # every conductor hears each first token (their TTFT correction learns from it)
        lines = [line for url in urls for line in fetch(url).splitlines()
                 if line.startswith("kvc_first_tokens_heard_total")]
        return min((float(line.split()[-1]) for line in lines), default=0.0)
    eventually(first_tokens, "every conductor heard the first token", until=lambda count: count >= 1)


async def test_slow_first_tokens_turn_an_admission_into_a_429(own_nats):
    """The same request is placed before, and refused after, first tokens that came 10x later than predicted
    (with --no-ttft-correction it is placed both times)."""
    predicted = ConductorConfig(cost_source="prior").cost_model().t_prefill(1000, 0)
    after, text = await after_slow_first_tokens(own_nats, predicted, corrected=True)
    assert isinstance(after, Rejection) and after.stage == "prefill"
    # ten ratios of 10, clamped to 4: a mean of 4 - 3 * 0.75^10 = 3.83, plus one mean deviation (the default
    # --ttft-correction-spread) of about 1.6: past 4, so the factor is the clamp, 4
    assert 'kvc_ttft_correction{role="conductor",instance="conductor-test",prefill="p0"} 4.0' in text
    after, _ = await after_slow_first_tokens(own_nats, predicted, corrected=False)
    assert isinstance(after, Placement)


async def after_slow_first_tokens(own_nats: str, predicted: float, corrected: bool):
    """A request predicted at half the TTFT SLO is placed; then ten first tokens on kvc.conductor.first_token
    come 10x later than predicted: the decision on the same request again, and the conductor's /metrics."""
    conductor = await start_conductor(own_nats, cost_source="prior", ttft_slo_s=2 * predicted,
                                      ttft_correction=corrected)
    nc = await nats.connect(own_nats)
    try:
        await announce(nc, conductor, prefills=("p0",))
        ask = ScheduleRequest(request_id="before", n_tokens=1000, block_hashes=[], max_tokens=8)
        assert isinstance(await schedule(nc, ask), Placement)
        conductor.core.forget("before")  # out of the queue: the same request is predicted the same again
        for i in range(10):
            slow = RequestOutcome(request_id=f"slow{i}", prefill_id="p0", decode_id="d0", finish_reason="",
                                  ttft_s=10 * predicted, e2e_s=10 * predicted, prompt_tokens=1000,
                                  completion_tokens=1, predicted_ttft_s=predicted)
            await nc.publish(Subjects.FIRST_TOKEN, encode(slow))
        await eventually_async(lambda: conductor.counters["first_tokens_heard_total"], "it heard them all",
                               until=lambda heard: heard == 10)
        return await schedule(nc, msgspec.structs.replace(ask, request_id="after")), await metrics(conductor)
    finally:
        await nc.close()
        await conductor.close()
