"""Test and benchmark harness: one `kvcentric` service, or a whole `kvcentric up`, as a child process that
is ready when these return. Not part of the installed library.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from kvcentric.tools.processes import free_port, get_json


def spawn_service(command: str, nats_url: str, *flags: str, timeout_s: float = 60.0,
                  quiet: bool = True) -> tuple[subprocess.Popen, int]:
    """Start one `kvcentric <command>` on a free HTTP port and wait until its /health answers 200;
    returns (process, port). For tests and benchmarks; the process is killed if it never gets healthy."""
    port = free_port()
    output = subprocess.DEVNULL if quiet else None
    process = subprocess.Popen([sys.executable, "-m", "kvcentric", command, "--nats-url", nats_url,
                                "--port", str(port), *flags], stdout=output, stderr=output)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if get_json(f"http://127.0.0.1:{port}/health")[0] == 200:
                return process, port
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    process.kill()
    process.wait()
    raise RuntimeError(f"kvcentric {command} did not become healthy in {timeout_s} s")


class UpProcess:
    """`kvcentric up` run as a child process, for tests and benchmarks: start, wait ready, stop."""

    def __init__(self, log_dir: str, *flags: str, port: int = 0, timeout_s: float = 120.0,
                 env: dict[str, str] | None = None) -> None:
        self.port = port or free_port()
        self.log_dir = log_dir
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "kvcentric", "up", "--port", str(self.port), "--log-dir", log_dir,
                "--startup-timeout-s", str(timeout_s), *flags]
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        env={**os.environ, **(env or {})})
        self._wait_ready(timeout_s + 10)
        with open(os.path.join(log_dir, "cluster.json")) as manifest:
            self.manifest = json.load(manifest)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline, lines = time.monotonic() + timeout_s, []
        while time.monotonic() < deadline:
            line = self.process.stdout.readline()
            if not line and self.process.poll() is not None:
                break
            lines.append(line)
            if "ready at" in line:
                return
        self.stop()
        raise RuntimeError("kvcentric up did not become ready:\n" + "".join(lines))

    def health(self, service: str) -> dict:
        return get_json(self.manifest["services"][service]["health_url"])[1]

    def pids(self) -> list[int]:
        return [s["pid"] for s in self.manifest["services"].values()]

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait()
