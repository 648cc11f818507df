"""The control plane runs without torch: the package installed without extras into a venv of its own (no torch
there), and its gateway, conductor, kvs-meta and messenger started from that venv against real nats-server and
redis-server until each answers /health. Only the engine commands need the `engine` extra."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import start_server, stop
from kvcentric.tools.processes import free_port, get_json, nats_server_argv, redis_server_argv

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bare_venv(tmp_path_factory) -> Path:
    """A venv with `pip install <repo>` (no extras): kvcentric and its base dependencies, no torch.

    The pip of the tests' own environment installs into it (`--python`): the venv needs no pip of its own (seeding
    one takes 5 s), and this pip is the Makefile's, up to date, where the one a new venv gets is Python's bundled
    one, whose resolver took 26 s here to the new one's 11. Bytecode is left to the first import (`--no-compile`:
    compiling every installed module took 10-15 s, most of them never imported here)."""
    venv = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                              "--no-compile", str(ROOT)], capture_output=True, text=True, timeout=900)
    assert install.returncode == 0, install.stderr[-3000:]
    return venv


def start(venv: Path, command: str, *flags: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    process = subprocess.Popen([str(venv / "bin" / "kvcentric"), command, "--port", str(port), *flags],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return process, port


def wait_healthy(process: subprocess.Popen, port: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if get_json(f"http://127.0.0.1:{port}/health")[0] == 200:
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    process.kill()
    raise AssertionError(f"not healthy (exit {process.poll()}):\n{process.communicate()[0][-3000:]}")


@pytest.mark.timeout(1200)
def test_torch_is_absent_and_the_control_plane_starts_without_it(bare_venv):
    python = str(bare_venv / "bin" / "python")
    assert subprocess.run([python, "-c", "import torch"], capture_output=True).returncode != 0
    help_run = subprocess.run([str(bare_venv / "bin" / "kvcentric"), "--help"], capture_output=True, text=True)
    assert help_run.returncode == 0 and "gateway" in help_run.stdout, help_run.stderr
    nats_port, redis_port = free_port(), free_port()
    servers = [start_server(nats_server_argv(nats_port), nats_port),
               start_server(redis_server_argv(redis_port), redis_port)]
    nats_url = f"nats://127.0.0.1:{nats_port}"
    services = []
    try:
        for command, *flags in (["kvs-meta", "--redis-url", f"redis://127.0.0.1:{redis_port}/0"], ["conductor"],
                                ["gateway"], ["messenger", "--kv-port", str(free_port())]):
            services.append(start(bare_venv, command, "--nats-url", nats_url, *flags))
        for process, port in services:
            wait_healthy(process, port)
    finally:
        for process, _ in services:
            stop(process)
        for server in servers:
            stop(server)
