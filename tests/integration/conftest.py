"""Real servers for the integration tests: nats-server and redis-server on free loopback ports, and a
whole `kvcentric up` cluster. Nothing here mocks NATS, Redis or gRPC."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from kvcentric.launcher import free_port, get_json, nats_server_argv, redis_server_argv, wait_for_port


def start_server(argv: list[str], port: int) -> subprocess.Popen:
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_port("127.0.0.1", port, 10)
    return process


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="session")
def nats_url():
    port = free_port()
    process = start_server(nats_server_argv(port), port)
    try:
        yield f"nats://127.0.0.1:{port}"
    finally:
        stop(process)


@pytest.fixture(scope="session")
def redis_url():
    port = free_port()
    process = start_server(redis_server_argv(port), port)
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        stop(process)


class UpCluster:
    """A running `kvcentric up` and what it wrote to cluster.json."""

    def __init__(self, process: subprocess.Popen, log_dir: str, port: int) -> None:
        self.process, self.log_dir, self.port = process, log_dir, port
        self.url = f"http://127.0.0.1:{port}"
        with open(os.path.join(log_dir, "cluster.json")) as manifest:
            self.manifest = json.load(manifest)

    def health(self, service: str) -> dict:
        return get_json(self.manifest["services"][service]["health_url"])[1]

    def pids(self) -> list[int]:
        return [s["pid"] for s in self.manifest["services"].values()]


def start_up(tmp_path, *flags: str, timeout_s: float = 120.0) -> UpCluster:
    """Run `kvcentric up` in a subprocess and wait for its ready line."""
    port = free_port()
    log_dir = str(tmp_path)
    process = subprocess.Popen([sys.executable, "-m", "kvcentric", "up", "--port", str(port), "--log-dir", log_dir,
                                *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + timeout_s
    lines = []
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line and process.poll() is not None:
            break
        lines.append(line)
        if "ready at" in line:
            return UpCluster(process, log_dir, port)
    process.kill()
    raise RuntimeError("kvcentric up did not become ready:\n" + "".join(lines))


def stop_up(cluster: UpCluster) -> None:
    cluster.process.send_signal(signal.SIGTERM)
    try:
        cluster.process.wait(15)
    except subprocess.TimeoutExpired:
        cluster.process.kill()


@pytest.fixture(scope="session")
def cluster(tmp_path_factory, nats_url, redis_url):
    """One prefill and one decode instance of `tiny`, on the session's NATS and Redis."""
    up = start_up(tmp_path_factory.mktemp("up"), "--nats-url", nats_url, "--redis-url", redis_url)
    try:
        yield up
    finally:
        stop_up(up)
