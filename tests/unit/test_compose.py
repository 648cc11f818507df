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


def test_every_service_restarts_when_it_dies_and_the_kvcentric_ones_have_a_reaper():
    for name, service in COMPOSE["services"].items():
        assert service["restart"] == "unless-stopped", name
        if service.get("command", [""])[0] == "kvcentric":
            assert service["init"] is True, name


@pytest.mark.parametrize("name", ["prefill", "decode"])
def test_the_engines_scale_each_replica_naming_itself_and_advertising_its_own_address(name, monkeypatch):
    service = COMPOSE["services"][name]
    assert "--instance-id" not in service["command"] and "--kv-advertise" not in service["command"]
    assert "container_name" not in service and "ports" not in service  # both would stop `--scale`
    for key, value in service["environment"].items():
        if key.startswith("KVC_"):
            monkeypatch.setenv(key, str(value))
    config = from_namespace(_config_class(name), build_parser().parse_args(service["command"][1:]))
    assert config.instance_id == "" and config.kv_advertise == "" and config.kv_host == "0.0.0.0"


def test_traces_are_exported_only_when_a_collector_is_named_and_jaeger_is_behind_a_profile():
    from kvcentric.runtime.tracing import exporter_kind

    assert COMPOSE["services"]["jaeger"]["profiles"] == ["tracing"]
    endpoint = COMPOSE["x-kvc-env"]["OTEL_EXPORTER_OTLP_ENDPOINT"]
    assert endpoint == "${OTEL_EXPORTER_OTLP_ENDPOINT:-}"
    assert exporter_kind({"OTEL_EXPORTER_OTLP_ENDPOINT": ""}) is None  # what the unset variable becomes
    assert exporter_kind({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://jaeger:4317"}) == "otlp"


@pytest.mark.parametrize("name", ["docker-compose.yml", "docker-compose.prfaas.yml"])
def test_every_image_and_the_base_image_are_pinned_and_overridable(name):
    import re

    compose = yaml.safe_load((ROOT / name).read_text())
    for service_name, service in compose["services"].items():
        if "image" in service:
            assert re.fullmatch(r"\$\{[A-Z]+_IMAGE:-[a-z/-]+:\d+\.\d+\.\d+(-[a-z]+)?\}", service["image"]), service_name
        else:
            assert service["build"]["args"]["PYTHON_IMAGE"] == "${PYTHON_IMAGE:-python:3.11.11-slim-bookworm}"
    assert "ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm" in (ROOT / "Dockerfile").read_text()
