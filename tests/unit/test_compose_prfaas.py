"""docker-compose.prfaas.yml (two datacenters) runs the same `kvcentric` subcommands the tests run, its NATS
servers are joined by a gateway, and each side's services name their own cluster and bus."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from kvcentric.cli import _config_class, build_parser
from kvcentric.config import from_namespace
from kvcentric.tools.processes import nats_server_binary
from kvcentric.core.prfaas.topology import Topology

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.prfaas.yml").read_text())
SERVICES = COMPOSE["services"]
KVCENTRIC = sorted(name for name, s in SERVICES.items() if s.get("command", [""])[0] == "kvcentric")
SIDE = {"prefill-prfaas": "prfaas", "nats-prfaas": "prfaas"}


def mounts(service: dict) -> dict[str, Path]:
    """Container path -> the repository file mounted there."""
    pairs = (volume.split(":")[:2] for volume in service.get("volumes", []))
    return {target: ROOT / source for source, target in pairs}


def test_both_datacenters_have_their_servers_and_the_kvcentric_services():
    assert {"nats-pd", "nats-prfaas", "redis"} <= set(SERVICES)
    assert set(KVCENTRIC) == {"prefill-prfaas", "kvs-meta", "conductor", "prefill-pd", "decode-pd", "gateway"}


@pytest.mark.parametrize("name", KVCENTRIC)
def test_each_service_runs_a_valid_kvcentric_command_on_its_own_sides_bus(name, monkeypatch):
    service = SERVICES[name]
    command = list(service["command"])
    subcommand = command[1]
    assert ROOT.joinpath(service["build"].get("dockerfile", "Dockerfile")).exists()
    for target, source in mounts(service).items():  # the file the container would see
        assert source.exists(), source
        command = [str(source) if part == target else part for part in command]
    side = SIDE.get(name, "pd")
    environment = service["environment"]
    assert environment["KVC_CLUSTER"] == side and environment["KVC_NATS_URL"] == f"nats://nats-{side}:4222"
    for key, value in environment.items():
        monkeypatch.setenv(key, str(value))
    config = from_namespace(_config_class(subcommand), build_parser().parse_args(command[1:]))
    assert config.cluster == side


def test_the_conductor_routes_with_the_topology_and_the_prfaas_prefill_holds_to_its_link():
    topology = Topology.load(mounts(SERVICES["conductor"])["/etc/kvcentric/topology.json"])
    assert [c.role for c in topology.clusters] == ["pd", "prfaas"]
    command = SERVICES["prefill-prfaas"]["command"]
    limit = float(command[command.index("--kv-rate-limit-gbps") + 1])
    assert limit == topology.link_gbps("prfaas", "pd")


@pytest.mark.parametrize("side,other", [("pd", "prfaas"), ("prfaas", "pd")])
def test_each_nats_server_config_is_valid_and_has_a_gateway_to_the_other_datacenter(side, other):
    conf = mounts(SERVICES[f"nats-{side}"])["/etc/nats/nats.conf"]
    text = conf.read_text()
    assert f'name: "{side}"' in text and f'{{name: "{other}", url: "nats://nats-{other}:7222"}}' in text
    assert set(SERVICES[f"nats-{side}"]["networks"]) >= {"wan"}
    check = subprocess.run([nats_server_binary(), "-c", str(conf), "-t"], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr + check.stdout


def test_the_nodes_that_move_kv_between_datacenters_share_the_wan_network():
    for name in ("prefill-prfaas", "decode-pd", "prefill-pd"):
        assert "wan" in SERVICES[name]["networks"]
    assert "wan" not in SERVICES["gateway"]["networks"] and "wan" not in SERVICES["redis"]["networks"]


@pytest.mark.skipif(shutil.which("docker") is None, reason="no docker CLI on this machine")
def test_docker_compose_config_accepts_the_file():
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("the docker CLI has no compose plugin here")
    result = subprocess.run(["docker", "compose", "-f", str(ROOT / "docker-compose.prfaas.yml"), "config", "-q"],
                            capture_output=True, text=True, env={**os.environ})
    assert result.returncode == 0, result.stderr
