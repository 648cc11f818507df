"""The one Dockerfile: a torch-free control-plane image, an engine image with torch, and a target per
service that runs its subcommand; both compose files build only targets it has."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from kvcentric.cli import SERVICES

ROOT = Path(__file__).resolve().parents[2]
ENGINES = {"prefill", "decode", "colocated"}


def stages() -> dict[str, tuple[str, list[str]]]:
    """Stage name -> (the image it starts from, its instructions)."""
    found: dict[str, tuple[str, list[str]]] = {}
    current: list[str] = []
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        match = re.fullmatch(r"FROM (\S+) AS (\S+)", line)
        if match:
            current = []
            found[match[2]] = (match[1], current)
        elif line and not line.startswith("#"):
            current.append(line)
    return found


def compose_targets() -> set[str]:
    targets = set()
    for name in ("docker-compose.yml", "docker-compose.prfaas.yml"):
        services = yaml.safe_load((ROOT / name).read_text())["services"]
        targets |= {s["build"]["target"] for s in services.values() if "build" in s}
    return targets


def test_every_compose_build_target_is_a_stage():
    assert compose_targets() <= set(stages())


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_each_service_has_a_target_that_runs_it_on_the_right_image(name):
    base, instructions = stages()[name]
    assert base == ("engine" if name in ENGINES else "control-plane")
    assert instructions == [f'CMD ["{name}"]']


def test_the_control_plane_has_no_torch_and_the_engine_takes_its_torch_index_as_an_argument():
    _, control = stages()["control-plane"]
    _, engine = stages()["engine"]
    assert control == ["RUN pip install --no-cache-dir ."]
    assert engine[0].startswith("ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu")
    assert "${TORCH_INDEX_URL}" in engine[1] and "'.[engine]'" in engine[1]


def test_every_image_runs_kvcentric():
    assert stages()["source"][1][-1] == 'ENTRYPOINT ["kvcentric"]'
    assert not list(ROOT.glob("services/*/Dockerfile"))


def test_the_engine_image_has_a_compiler_for_the_cpu_kernels_and_tritons_launchers():
    _, engine = stages()["engine"]
    installs = [line for line in engine if "apt-get install" in line]
    assert len(installs) == 1 and " g++" in installs[0] and "rm -rf /var/lib/apt/lists/*" in installs[0]
    _, control = stages()["control-plane"]
    assert not any("apt-get" in line for line in control)  # the control plane compiles nothing
