"""The Grafana dashboard in deploy/grafana reads series the services really expose: after one request on the
shared `kvcentric up` cluster, every series its queries name is on some service's /metrics with the type the
query needs (a rate of a counter, a quantile of a histogram), every vLLM-named series carries `model_name`, and
no gauge is named `_total`; every family has HELP and TYPE."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "kvcentric.json"
SERIES = re.compile(r"(?:vllm:|kvc_)[a-z0-9_]+")
HISTOGRAM_PARTS = ("_bucket", "_sum", "_count")


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def families(text: str) -> tuple[dict[str, str], set[str], list[str]]:
    """The families' types, the families with HELP, and the sample lines."""
    types, helped, samples = {}, set(), []
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            types[name] = kind
        elif line.startswith("# HELP "):
            name, _, words = line[len("# HELP "):].partition(" ")
            if words.strip():
                helped.add(name)
        elif line:
            samples.append(line)
    return types, helped, samples


def queries(dashboard: dict) -> list[str]:
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def family_of(series: str, types: dict[str, str]) -> tuple[str, str]:
    """The family a queried series belongs to, and its type ("" when no service exposes it)."""
    for part in HISTOGRAM_PARTS:
        if series.endswith(part) and types.get(series.removesuffix(part)) == "histogram":
            return series.removesuffix(part), "histogram"
    return series, types.get(series, "")


def test_every_series_the_dashboard_queries_is_exposed_with_the_type_it_needs(cluster):
    body = json.dumps({"model": "tiny", "prompt": "dashboard", "max_tokens": 3}).encode()
    request = urllib.request.Request(cluster.url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200
    types, helped, samples = {}, set(), []
    for service in cluster.manifest["services"].values():
        if service.get("health_url"):
            found = families(scrape(service["health_url"].replace("/health", "/metrics")))
            types.update(found[0])
            helped |= found[1]
            samples += found[2]
    dashboard = json.loads(DASHBOARD.read_text())
    for expr in queries(dashboard):
        for series in SERIES.findall(expr):
            family, kind = family_of(series, types)
            assert kind, f"{series} (in {expr}) is on no service's /metrics"
            if f"rate({series}" in expr or f"increase({series}" in expr:
                assert kind in ("counter", "histogram"), f"{expr}: {family} is a {kind}"
            if "histogram_quantile" in expr and series.endswith("_bucket"):
                assert kind == "histogram", f"{expr}: {family} is a {kind}"
    variable = dashboard["templating"]["list"][1]["definition"]
    assert variable == "label_values(vllm:num_requests_running, model_name)"
    assert any(line.startswith('vllm:num_requests_running{model_name="tiny"') for line in samples)
    assert all('model_name="tiny"' in line for line in samples if line.startswith("vllm:"))
    assert not [name for name, kind in types.items() if kind == "gauge" and name.endswith("_total")]
    assert set(types) == helped
    for name in ("kvc_tokens_generated_total", "kvc_requests_finished_total", "vllm:generation_tokens_total"):
        assert types[name] == "counter", name
    assert types["kvc_requests_running"] == types["kvc_requests_waiting"] == "gauge"
