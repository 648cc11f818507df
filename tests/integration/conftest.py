"""Real servers for the integration tests: nats-server and redis-server on loopback ports that cannot
collide (nats-server binds one itself; redis-server is retried on another port if its was taken), and a
whole `kvcentric up` cluster. Nothing here mocks NATS, Redis or gRPC."""

from __future__ import annotations

import subprocess

import pytest

from harness import UpProcess

from kvcentric.tools.processes import end, serve_nats, serve_redis, wait_for_port


def start_server(argv: list[str], port: int) -> subprocess.Popen:
    """A server on a port chosen up front (to restart one where it was: its clients know the port)."""
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_port("127.0.0.1", port, 10)
    return process


def stop(process: subprocess.Popen) -> None:
    end(process)


@pytest.fixture(scope="session")
def nats_url():
    process, port = serve_nats()
    try:
        yield f"nats://127.0.0.1:{port}"
    finally:
        stop(process)


@pytest.fixture
def own_nats():
    """A NATS server of the test's own, so no other test's conductor or kvs-meta answers in a queue group."""
    server, port = serve_nats()
    try:
        yield f"nats://127.0.0.1:{port}"
    finally:
        stop(server)


@pytest.fixture(scope="session")
def redis_url():
    process, port = serve_redis()
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        stop(process)


def start_up(tmp_path, *flags: str) -> UpProcess:
    return UpProcess(str(tmp_path), *flags)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory, nats_url, redis_url):
    """One prefill and one decode instance of `tiny`, on the session's NATS and Redis."""
    up = start_up(tmp_path_factory.mktemp("up"), "--nats-url", nats_url, "--redis-url", redis_url)
    try:
        yield up
    finally:
        up.stop()
