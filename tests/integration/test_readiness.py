"""Liveness apart from readiness (/health vs /ready) on real servers: a conductor and a gateway with no engines
are alive but not ready, and become ready once a prefill and a decode instance report (played by a NATS client
publishing load reports); kvs-meta is not ready while its Redis is down; a real `kvcentric up` cluster's
services are all ready."""

from __future__ import annotations

import time

import nats
import pytest

from conftest import start_server, stop
from harness import spawn_service as spawn
from kvcentric.core.protocol import LoadReport, Subjects, encode
from kvcentric.tools.processes import free_port, get_json, nats_server_argv, redis_server_argv
from waiting import eventually


def eventually_status(url: str, status: int) -> dict:
    """The JSON body of `url` once it answers `status`."""
    return eventually(lambda: get_json(url), f"{url} answers {status}", until=lambda answer: answer[0] == status,
                      ignoring=(OSError, ValueError))[1]


async def report_engines(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    try:
        for role, name in (("prefill", "p"), ("decode", "d")):
            report = LoadReport(instance_id=name, role=role, cluster="local", kv_addr="127.0.0.1:1", queued_requests=0,
                                queued_tokens=0, running=0, kv_blocks_total=100, kv_blocks_free=100, ts=time.time())
            await nc.publish(Subjects.load(role, name), encode(report))
        await nc.flush()
    finally:
        await nc.close()


async def test_conductor_and_gateway_are_alive_before_ready_and_ready_once_engines_report():
    port = free_port()
    server = start_server(nats_server_argv(port), port)
    url = f"nats://127.0.0.1:{port}"
    conductor, conductor_port = spawn("conductor", url, "--stale-after-s", "600")
    gateway, gateway_port = spawn("gateway", url)
    try:
        for service_port in (conductor_port, gateway_port):
            assert get_json(f"http://127.0.0.1:{service_port}/health")[0] == 200
            status, body = get_json(f"http://127.0.0.1:{service_port}/ready")
            assert status == 503 and body["ready"] is False and "prefill" in body["reason"]
        await report_engines(url)
        for service_port in (conductor_port, gateway_port):
            assert eventually_status(f"http://127.0.0.1:{service_port}/ready", 200)["ready"] is True
    finally:
        stop(gateway)
        stop(conductor)
        stop(server)


@pytest.mark.timeout(120)
def test_kvs_meta_is_not_ready_while_redis_is_down(own_nats):
    redis_port = free_port()
    redis = start_server(redis_server_argv(redis_port), redis_port)
    kvs, kvs_port = spawn("kvs-meta", own_nats, "--redis-url", f"redis://127.0.0.1:{redis_port}/0")
    try:
        assert eventually_status(f"http://127.0.0.1:{kvs_port}/ready", 200)["ready"] is True
        stop(redis)
        body = eventually_status(f"http://127.0.0.1:{kvs_port}/ready", 503)
        assert "Redis" in body["reason"]
        assert get_json(f"http://127.0.0.1:{kvs_port}/health")[0] == 200
    finally:
        stop(kvs)
        stop(redis)


def test_every_service_of_an_up_cluster_is_ready(cluster):
    for name, service in cluster.manifest["services"].items():
        if service.get("health_url"):
            status, body = get_json(service["health_url"].replace("/health", "/ready"))
            assert status == 200 and body["ready"] is True, (name, body)
