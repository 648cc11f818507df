"""The one Dockerfile: a torch-free control-plane image, an engine image with torch and kernels built ahead of time
(no compiler at run time), both as an unprivileged user from a pinned base, and a target per service that runs its
subcommand (`docker run IMAGE --help` is that subcommand's help); both compose files build only targets it has."""

from __future__ import annotations

import re
import subprocess
import sys
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
    assert instructions == [f"ENV KVC_SERVICE={name}", f'CMD ["{name}"]']


def test_the_control_plane_has_no_torch_and_the_engine_takes_its_torch_index_and_wheels_as_arguments():
    _, control = stages()["build-control"]
    _, engine = stages()["build-engine"]
    assert control[-1] == "RUN /opt/kvcentric/bin/pip install --no-cache-dir --no-deps ."
    assert any("python requirements.py pyproject.toml > requirements.txt" in line for line in control)
    assert any("python requirements.py pyproject.toml engine > requirements.txt" in line for line in engine)
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in engine
    assert "ARG TORCH_WHEELS=deploy/wheels" in engine and "COPY ${TORCH_WHEELS} /wheels" in engine
    install = instructions_after(engine, next(line for line in engine if "pip install" in line))
    assert "--find-links /wheels" in install and '${TORCH_INDEX_URL:+--extra-index-url "${TORCH_INDEX_URL}"}' in install
    assert (ROOT / "deploy" / "wheels").is_dir()


def test_the_dependencies_are_installed_before_the_source_is_copied():
    for name in ("build-control", "build-engine"):
        _, instructions = stages()[name]
        requirements = next(i for i, line in enumerate(instructions) if "-r requirements.txt" in line)
        source = instructions.index("COPY libs libs")
        assert requirements < source and "COPY pyproject.toml deploy/docker/requirements.py ./" in instructions
    listed = subprocess.run([sys.executable, str(ROOT / "deploy" / "docker" / "requirements.py"),
                             str(ROOT / "pyproject.toml"), "engine"], capture_output=True, text=True, check=True)
    assert "torch==2.13.0" in listed.stdout.splitlines() and "nats-py>=2.7" in listed.stdout.splitlines()


def instructions_after(instructions: list[str], first: str) -> str:
    """`first` with the continuation lines that follow it, as one string."""
    at = instructions.index(first)
    joined = [first]
    while joined[-1].endswith("\\"):
        at += 1
        joined.append(instructions[at])
    return " ".join(joined)


def test_every_image_runs_kvcentric_through_the_entrypoint_as_an_unprivileged_user():
    _, runtime = stages()["runtime"]
    assert runtime[-1] == 'ENTRYPOINT ["kvcentric-entrypoint"]'
    assert "USER 10001:10001" in runtime and any("useradd --system --uid 10001" in line for line in runtime)
    assert (ROOT / "deploy" / "docker" / "entrypoint.sh").stat().st_mode & 0o111
    assert not list(ROOT.glob("services/*/Dockerfile"))


def test_the_runtime_images_have_no_compiler_and_the_engine_carries_kernels_built_ahead():
    for name in ("runtime", "control-plane", "engine"):
        assert not any("g++" in line or "gcc" in line for line in stages()[name][1]), name
    _, engine = stages()["build-engine"]
    assert any("g++" in line for line in engine)
    assert any("python -m kvcentric.engine.model.kernels --prebuild" in line for line in engine)
    assert stages()["engine"][1] == ["COPY --from=build-engine /opt/kvcentric /opt/kvcentric"]
    assert any("KVC_KERNEL_PREBUILT=/opt/kvcentric/kernels" in line for line in stages()["runtime"][1])


def test_the_base_image_is_pinned_and_every_stage_starts_from_it_or_another_stage():
    text = (ROOT / "Dockerfile").read_text()
    pinned = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", text, re.MULTILINE)[1]
    assert re.fullmatch(r"python:3\.11\.\d+-slim-\w+(@sha256:[0-9a-f]{64})?", pinned)
    for name, (base, _) in stages().items():
        assert base == "${PYTHON_IMAGE}" or base in stages(), name


@pytest.mark.parametrize("args,expected", [
    (["--help"], ["decode", "--help"]),
    ([], ["decode"]),
    (["--instance-id", "d-1"], ["decode", "--instance-id", "d-1"]),
    (["prefill", "--help"], ["prefill", "--help"]),
])
def test_the_entrypoint_runs_the_images_own_service_when_the_arguments_start_with_a_flag(args, expected, tmp_path):
    fake = tmp_path / "kvcentric"
    fake.write_text('#!/bin/sh\nfor argument in "$@"; do echo "$argument"; done\n')
    fake.chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "KVC_SERVICE": "decode"}
    result = subprocess.run(["sh", str(ROOT / "deploy" / "docker" / "entrypoint.sh"), *args], env=env,
                            capture_output=True, text=True, check=True)
    assert result.stdout.splitlines() == expected
    env.pop("KVC_SERVICE")
    result = subprocess.run(["sh", str(ROOT / "deploy" / "docker" / "entrypoint.sh"), *args], env=env,
                            capture_output=True, text=True, check=True)
    assert result.stdout.splitlines() == args
