"""Ports cannot collide: services bind port 0 and report the port they got (--port-file), nats-server picks
its own, and a redis-server whose port was taken before it bound is started again on another. Conductors
started side by side see one another and agree on one leader."""

from __future__ import annotations

import socket
import subprocess
from concurrent.futures import ThreadPoolExecutor

from harness import spawn_service
from waiting import eventually

from kvcentric.tools import processes
from kvcentric.tools.processes import end, get_json, redis_pid, serve_nats, serve_redis


def test_a_redis_whose_port_was_taken_first_is_started_on_another(monkeypatch):
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()  # something else answers on the port picked first
    taken = squatter.getsockname()[1]
    picks = iter([taken])
    monkeypatch.setattr(processes, "free_port", lambda host="127.0.0.1": next(picks, None) or socket_port())
    started: list[subprocess.Popen] = []

    def spawn(argv: list[str]) -> subprocess.Popen:
        started.append(processes.quiet_spawn(argv))
        return started[-1]
    try:
        process, port = serve_redis(spawn)
        assert port != taken and redis_pid(port) == process.pid
        assert len(started) == 2 and started[0].poll() is not None  # the first one could not bind, and ended
    finally:
        squatter.close()
        for each in started:
            end(each)


def socket_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_many_servers_and_services_started_at_once_each_get_a_port_of_their_own():
    with ThreadPoolExecutor(8) as pool:
        servers = list(pool.map(lambda start: start(), [serve_nats] * 6 + [serve_redis] * 6))
        nats_url = f"nats://127.0.0.1:{servers[0][1]}"
        services = list(pool.map(lambda _: spawn_service("conductor", nats_url), range(6)))
    try:
        ports = [port for _, port in servers + services]
        assert len(set(ports)) == len(ports) == 18
        for _, port in services:
            status, body = get_json(f"http://127.0.0.1:{port}/health")
            assert status == 200 and body["role"] == "conductor"
        for process, port in servers[6:]:
            assert redis_pid(port) == process.pid
        views = eventually(lambda: {tuple(get_json(f"http://127.0.0.1:{p}/health")[1]["conductors"])
                                    for _, p in services}, "every conductor sees the five others",
                           until=lambda seen: len(seen) == 1 and len(next(iter(seen))) == 6)
        leaders = {get_json(f"http://127.0.0.1:{p}/health")[1]["leader"] for _, p in services}
        assert leaders == {min(next(iter(views)))}  # one leader, the same for all: the lowest id
    finally:
        for process, _ in services + servers:
            end(process)
