"""docker-compose.yml runs the same `kvcentric` subcommands and flags the tests run."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from kvcentric.cli import SERVICES, _config_class, build_parser
from kvcentric.config import from_namespace

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_compose_has_every_service_and_the_servers():
    assert set(COMPOSE["services"]) >= {"nats", "redis", "jaeger", *SERVICES}


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_each_service_is_built_from_its_dockerfile_and_runs_a_valid_kvcentric_command(name, monkeypatch):
    service = COMPOSE["services"][name]
    dockerfile = ROOT / service["build"].get("dockerfile", "Dockerfile")
    assert dockerfile.exists() and f'CMD ["{name}"]' in dockerfile.read_text()
    command = service["command"]
    assert command[:2] == ["kvcentric", name]
    environment = service.get("environment", {})
    for key, value in environment.items():
        if key.startswith("KVC_"):
            monkeypatch.setenv(key, str(value))
    args = build_parser().parse_args(command[1:])
    from_namespace(_config_class(name), args)  # the config validates as it would in the container


@pytest.mark.skipif(shutil.which("docker") is None, reason="no docker CLI on this machine")
def test_docker_compose_config_accepts_the_file():
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("the docker CLI has no compose plugin here")
    result = subprocess.run(["docker", "compose", "-f", str(ROOT / "docker-compose.yml"), "config", "-q"],
                            capture_output=True, text=True, env={**os.environ})
    assert result.returncode == 0, result.stderr
