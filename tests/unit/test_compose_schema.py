"""The compose files and their secured overrides pass the compose-spec JSON schema (check-jsonschema's vendored copy,
offline), and both compose files start in order of readiness: every kvcentric service has a healthcheck on its own
GET /ready, the servers have theirs, and every depends_on waits for service_healthy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
FILES = ["docker-compose.yml", "docker-compose.prfaas.yml"]
OVERRIDES = ["docker-compose.secure.yml", "docker-compose.prfaas.secure.yml"]
"""Files that go over one of FILES (`-f FILE -f OVERRIDE`): partial, but each passes the schema on its own."""


def validate(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
                           str(path)], capture_output=True, text=True)


@pytest.mark.parametrize("name", FILES + OVERRIDES)
def test_the_compose_file_passes_the_compose_spec_schema(name):
    result = validate(ROOT / name)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_validator_refuses_a_wrong_depends_on_condition(tmp_path):
    broken = tmp_path / "compose.yml"
    broken.write_text((ROOT / FILES[0]).read_text().replace("condition: service_healthy", "condition: service_happy"))
    assert validate(broken).returncode != 0


@pytest.mark.parametrize("name", FILES)
def test_services_wait_for_readiness_of_what_they_depend_on(name):
    services = yaml.safe_load((ROOT / name).read_text())["services"]
    for service_name, service in services.items():
        command = service.get("command") or []
        if command[:1] == ["kvcentric"]:
            assert "/ready" in " ".join(service["healthcheck"]["test"]), service_name
        elif service_name.startswith(("nats", "redis")):
            assert service["healthcheck"]["test"], service_name
        for dependency, condition in (service.get("depends_on") or {}).items():
            assert condition == {"condition": "service_healthy"}, (service_name, dependency)
            assert "healthcheck" in services[dependency], (service_name, dependency)
