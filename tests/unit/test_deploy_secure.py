"""The secured compose file takes every certificate and credential from files (compose secrets), offline: each
kvcentric service's command and environment parse with the real CLI, and once the material `kvcentric certs`
writes is put where the secrets land, every file a service names is there and is what it should be (the flags'
own checks, as at start); nats-server accepts its secured config with the passwords from its environment; no
secret is written into the compose file; and the users file in deploy/secure is what the permissions table says."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from kvcentric.cli import SERVICES, _config_class, build_parser
from kvcentric.config import from_namespace
from kvcentric.runtime.security import check_files
from kvcentric.tools.processes import nats_server_binary
from kvcentric.tools.secure import make_secure_files, users_conf

ROOT = Path(__file__).resolve().parents[2]
BASE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SECURE = yaml.safe_load((ROOT / "docker-compose.secure.yml").read_text())
OUT = "./deploy/secure/out"


@pytest.fixture(scope="module")
def material(tmp_path_factory):
    folder = tmp_path_factory.mktemp("deploy") / "out"
    make_secure_files(str(folder), ["localhost"], ["nats"])
    return folder


def mounted(service: dict, material: Path) -> dict[str, str]:
    """Where each of a service's compose secrets lands in its container -> the file `kvcentric certs` wrote."""
    places = {}
    for entry in service.get("secrets", []):
        source, target = (entry, f"/run/secrets/{entry}") if isinstance(entry, str) else \
            (entry["source"], entry["target"])
        places[target] = SECURE["secrets"][source]["file"].replace(OUT, str(material))
    return places


def test_the_users_file_is_the_permissions_table():
    assert (ROOT / "deploy" / "secure" / "nats-users.conf").read_text() == users_conf()


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_each_service_finds_its_certificates_and_credentials_where_the_secrets_land(name, material, monkeypatch):
    base, secure = BASE["services"][name], SECURE["services"][name]
    places = mounted(secure, material)
    environment = {**base.get("environment", {}), **secure["environment"]}
    for key in [key for key in os.environ if key.startswith("KVC_")]:
        monkeypatch.delenv(key)
    for key, value in environment.items():
        if key.startswith("KVC_"):
            monkeypatch.setenv(key, places.get(str(value), str(value)))
    config = from_namespace(_config_class(name), build_parser().parse_args(base["command"][1:]))
    assert config.nats_url == "tls://nats:4222" and config.tls_cert and config.nats_user
    check_files(config)  # every file is there, parses, and a KV certificate names what peers check


def test_nats_server_accepts_its_secured_config_with_the_passwords_of_its_environment(material, tmp_path):
    nats = SECURE["services"]["nats"]
    places = mounted(nats, material)
    for mount in nats["volumes"]:
        source, target = mount.split(":")[:2]
        text = (ROOT / source).read_text()
        for inside, outside in places.items():
            text = text.replace(inside, outside)
        (tmp_path / Path(target).name).write_text(text)
    env_file = Path(nats["env_file"][0].replace(OUT, str(material)))
    passwords = dict(line.split("=", 1) for line in env_file.read_text().splitlines())
    check = subprocess.run([nats_server_binary(), "-t", "-c", str(tmp_path / "nats.conf")], capture_output=True,
                           text=True, env=passwords, timeout=30)
    assert check.returncode == 0, check.stderr + check.stdout
    check = subprocess.run([nats_server_binary(), "-t", "-c", str(tmp_path / "nats.conf")], capture_output=True,
                           text=True, env={}, timeout=30)
    assert check.returncode != 0  # without its environment the users have no passwords: it refuses to start


def test_redis_reads_its_password_from_a_secret_and_no_command_or_variable_carries_a_secret():
    redis = SECURE["services"]["redis"]
    assert redis["command"][:2] == ["redis-server", "/run/secrets/redis.conf"] and "redis.conf" in redis["secrets"]
    for name, service in SECURE["services"].items():
        command = " ".join(service.get("command", BASE["services"][name].get("command", [])))
        assert not {"--requirepass", "--api-key", "--pass", "--user"} & set(command.split()), name
        assert not [key for key in service.get("environment", {}) if key.endswith(("PASSWORD", "API_KEY"))], name
