"""Prometheus text exposition of a service's counters, gauges and histograms: a small module of its own
(no registry, no global state, no I/O); `Service` renders it on GET /metrics.

A counter or gauge name may carry labels in Prometheus syntax, `requests_total{outcome="200"}`; the
service adds `role` and `instance` to every sample and the `kvc_` prefix to every name (`vllm:` and a
`model_name` label for the series named as vLLM names them). Which reported values are running totals,
and the HELP texts, are in `kvcentric.core.metric_catalog`.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping

from kvcentric.core.metric_catalog import exposed, help_of

LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                     30.0, 60.0, 120.0)
"""Seconds, from half a millisecond (a NATS round trip) to two minutes (a long prefill under load)."""

TOKEN_GAP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0,
                       2.5, 5.0)
"""Seconds between two tokens of one request (TBT); the Mooncake SLO is 0.1 s."""

SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
"""Counts (tokens, batch sizes, blocks), powers of two."""


class Histogram:
    """Cumulative buckets, sum and count of observed values, as Prometheus histograms expose them."""

    def __init__(self, buckets: Iterable[float] = LATENCY_BUCKETS_S, help: str = "") -> None:
        self.buckets = tuple(sorted(set(float(b) for b in buckets)))
        if not self.buckets:
            raise ValueError("a histogram needs at least one bucket")
        self.help = help
        self.counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def quantile(self, q: float) -> float:
        """The upper bound of the bucket holding the q-quantile (inf past the last bucket, nan if empty)."""
        if self.count == 0:
            return math.nan
        rank, seen = q * self.count, 0
        for bound, n in zip((*self.buckets, math.inf), self.counts):
            seen += n
            if seen >= rank:
                return bound
        return math.inf

    def samples(self, name: str, labels: str) -> list[str]:
        lines, cumulative = [], 0
        for bound, n in zip((*self.buckets, math.inf), self.counts):
            cumulative += n
            le = "+Inf" if bound == math.inf else _number(bound)
            lines.append(f'{name}_bucket{{{_join(labels, f"le={_quote(le)}")}}} {cumulative}')
        lines.append(f"{name}_sum{{{labels}}} {_number(self.sum)}")
        lines.append(f"{name}_count{{{labels}}} {self.count}")
        return lines


def split_name(key: str) -> tuple[str, str]:
    """'requests_total{outcome="200"}' -> ('requests_total', 'outcome="200"')."""
    name, brace, rest = key.partition("{")
    return name, rest.rstrip("}") if brace else ""


def labelled(name: str, **labels: object) -> str:
    """A counter or gauge key with labels: labelled("rejections_total", reason="overloaded")."""
    if not labels:
        return name
    return name + "{" + ",".join(f"{k}={_quote(str(v))}" for k, v in sorted(labels.items())) + "}"


def render(base_labels: Mapping[str, str], counters: Mapping[str, float], gauges: Mapping[str, object],
           histograms: Mapping[str, Histogram], prefix: str = "kvc_") -> str:
    """The Prometheus text format (version 0.0.4) of one service's metrics: each family with its HELP and
    TYPE. A value reported among the gauges that is a running total is a counter (`metric_catalog.exposed`)."""
    base = ",".join(f"{k}={_quote(v)}" for k, v in base_labels.items())
    families: dict[str, tuple[str, list[tuple[str, float]]]] = {}
    for key, value in _numbers(gauges):
        reported, labels = split_name(key)
        name, kind = exposed(reported)
        families.setdefault(name, (kind, []))[1].append((labels, value))
    for key, value in _numbers(counters):
        name, labels = split_name(key)
        families.setdefault(name, ("counter", []))[1].append((labels, value))
    lines: list[str] = []
    for name, (family_kind, samples) in sorted(families.items()):
        lines += [f"# HELP {prefix}{name} {_help(help_of(name, family_kind))}",
                  f"# TYPE {prefix}{name} {family_kind}"]
        lines += [f"{prefix}{name}{{{_join(base, labels)}}} {_number(value)}" for labels, value in sorted(samples)]
    for name, histogram in sorted(histograms.items()):
        lines.append(f"# HELP {prefix}{name} {_help(histogram.help or help_of(name, 'histogram'))}")
        lines.append(f"# TYPE {prefix}{name} histogram")
        lines += histogram.samples(prefix + name, base)
    return "\n".join(lines) + "\n"


def _numbers(values: Mapping[str, object]) -> list[tuple[str, float]]:
    """The numeric samples (a boolean as 0 or 1; text is skipped)."""
    numbers = []
    for key, value in values.items():
        if isinstance(value, bool):
            value = int(value)
        if isinstance(value, (int, float)):
            numbers.append((key, value))
    return numbers


def _help(text: str) -> str:
    """HELP text escaped as the text format wants (backslash and line feed)."""
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _join(*parts: str) -> str:
    return ",".join(p for p in parts if p)


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _number(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))
