"""The distribution of uncached prefill lengths the planner sizes for, from a truncated log-normal, a list of
lengths or a Mooncake trace after prefix matching; it builds distributions and serves nothing.

The workload JSON file (`kvcentric plan --workload W.json`) is one object with a `kind`:

    {"kind": "lognormal", "mu": 9.90, "sigma": 1.00, "min_length": 128, "max_length": 131072,
     "output_length": 1024}                                   # PrfaaS §4.1; optional "bins" (default 4096)
    {"kind": "lengths", "input_lengths": [900, 12000, 70000], "output_length": 1024}
    {"kind": "trace", "path": "conversation_trace.jsonl", "prefix_cache": "infinite"}

A trace (Mooncake JSONL: `timestamp` ms, `input_length`, `output_length`, `hash_ids` of 512-token prefix
blocks, see `shared/traces/README.md`) gives one sample per request: its uncached length l = input_length
minus the prefix already seen in an earlier request (`prefix_cache` "infinite", the default; "none" counts
every token), at least 1 token; L_out is the mean output length and the offered rate requests per second
of trace time. A relative `path` is taken from the workload file's folder. Optional: `block_tokens` (512),
`limit` (first N requests). The planner uses l because PrfaaS routes on the incremental length (§3.3).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

from kvcentric.core.prfaas.inputs import Fields, InputError, load_document


@dataclasses.dataclass(frozen=True, eq=False)
class LengthDistribution:
    """Uncached lengths with probabilities (sorted ascending, weights summing to 1) and the mean L_out."""

    lengths: np.ndarray
    weights: np.ndarray
    output_length: float
    source: str = ""
    offered_rps: float | None = None
    """Requests per second the trace offered (trace workloads only)."""

    def __post_init__(self) -> None:
        if len(self.lengths) == 0 or len(self.lengths) != len(self.weights):
            raise ValueError("a length distribution needs as many weights as lengths, at least one")
        if np.any(np.diff(self.lengths) < 0) or np.any(self.weights < 0) or self.output_length <= 0:
            raise ValueError("lengths must be sorted, weights non-negative and output_length > 0")
        if not math.isclose(float(self.weights.sum()), 1.0, rel_tol=1e-9):
            raise ValueError("weights must sum to 1")

    @property
    def mean(self) -> float:
        return float(self.weights @ self.lengths)

    def split(self, thresholds, values=None):
        """For each threshold t: (p, E[v | L > t], E[v | L <= t]) with v = L unless `values` (per length) given.

        p = P(L > t) is the fraction routed to PrfaaS (§3.4.1); a mean over an empty side is NaN.
        """
        t = np.atleast_1d(np.asarray(thresholds, dtype=float))
        v = self.lengths if values is None else np.asarray(values, dtype=float)
        cum_w = np.concatenate([[0.0], np.cumsum(self.weights)])
        cum_v = np.concatenate([[0.0], np.cumsum(self.weights * v)])
        below = np.searchsorted(self.lengths, t, side="right")
        w_low, v_low = cum_w[below], cum_v[below]
        w_low = np.where(w_low < 1e-12, 0.0, np.where(w_low > 1 - 1e-12, 1.0, w_low))  # no 1e-16 crumbs
        p = 1.0 - w_low
        with np.errstate(invalid="ignore", divide="ignore"):
            above_mean = np.where(p > 1e-12, (cum_v[-1] - v_low) / np.maximum(p, 1e-300), np.nan)
            below_mean = np.where(w_low > 1e-12, v_low / np.maximum(w_low, 1e-300), np.nan)
        return p, above_mean, below_mean

    def quantile(self, q: float, values=None) -> float:
        """The weighted q-quantile of `values` (per length; default the lengths themselves)."""
        v = self.lengths if values is None else np.asarray(values, dtype=float)
        order = np.argsort(v, kind="stable")
        cum = np.cumsum(self.weights[order])
        index = min(int(np.searchsorted(cum, q - 1e-12)), len(v) - 1)
        return float(v[order][index])

    @classmethod
    def from_samples(cls, lengths, output_length: float, source: str = "",
                     offered_rps: float | None = None) -> LengthDistribution:
        values, counts = np.unique(np.asarray(lengths, dtype=float), return_counts=True)
        return cls(values, counts / counts.sum(), float(output_length), source, offered_rps)


def lognormal(mu: float, sigma: float, min_length: float, max_length: float, output_length: float,
              bins: int = 4096) -> LengthDistribution:
    """Log-normal(mu, sigma) truncated to [min_length, max_length], as `bins` log-spaced cells.

    Each cell carries its exact probability (normal CDF differences) at its geometric midpoint, so with
    4096 cells over [128, 128K] a cell spans 0.17% of its length and conditional means are exact to ~1e-6.
    """
    edges = np.exp(np.linspace(math.log(min_length), math.log(max_length), bins + 1))
    z = (np.log(edges) - mu) / (sigma * math.sqrt(2.0))
    cdf = 0.5 * (1.0 + np.array([math.erf(x) for x in z]))
    weights = np.diff(cdf)
    if weights.sum() <= 0:
        raise ValueError("the log-normal has no mass between min_length and max_length")
    source = f"lognormal(mu={mu}, sigma={sigma}) on [{min_length:g}, {max_length:g}]"
    return LengthDistribution(np.sqrt(edges[1:] * edges[:-1]), weights / weights.sum(), output_length, source)


def from_trace(path: str | Path, prefix_cache: str = "infinite", block_tokens: int = 512,
               limit: int = 0) -> LengthDistribution:
    """Uncached lengths of a Mooncake JSONL trace, prefix-matched against all earlier requests (see module)."""
    seen: set[int] = set()
    uncached: list[int] = []
    outputs: list[int] = []
    stamps: list[int] = []
    with open(path, "rb") as lines:
        for number, line in enumerate(lines, start=1):
            if limit and len(uncached) >= limit:
                break
            if line.strip():
                item = _trace_line(line, number)
                cached = 0
                if prefix_cache == "infinite":
                    while cached < len(item["hash_ids"]) and item["hash_ids"][cached] in seen:
                        cached += 1
                    seen.update(item["hash_ids"])
                uncached.append(max(1, item["input_length"] - cached * block_tokens))
                outputs.append(max(1, item["output_length"]))
                stamps.append(item["timestamp"])
    if not uncached:
        raise InputError(f"workload: trace {path} holds no requests")
    span_s = (max(stamps) - min(stamps)) / 1000.0
    rate = len(uncached) / span_s if span_s > 0 else None
    source = f"trace {Path(path).name} ({len(uncached)} requests, prefix cache {prefix_cache})"
    return LengthDistribution.from_samples(uncached, float(np.mean(outputs)), source, rate)


def _trace_line(line: bytes, number: int) -> dict:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InputError(f"workload: trace line {number}: not JSON: {exc}") from None
    fields = Fields(item, f"workload: trace line {number}")
    out: dict = {key: fields.integer(key, minimum=0) for key in ("timestamp", "input_length", "output_length")}
    if out["input_length"] < 1:
        raise fields.fail("input_length", "must be >= 1")
    ids = fields.raw("hash_ids")
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise fields.fail("hash_ids", "expected a list of integers")
    out["hash_ids"] = ids
    return out


def workload_from_dict(data: dict, base_dir: str | Path = ".") -> LengthDistribution:
    """A distribution from the workload JSON described in the module docstring; errors name the field."""
    fields = Fields(data, "workload")
    kind = fields.text("kind", choices=("lognormal", "lengths", "trace"))
    if kind == "lognormal":
        fields.reject_unknown(("kind", "mu", "sigma", "min_length", "max_length", "output_length", "bins", "notes"))
        low, high = fields.number("min_length", positive=True), fields.number("max_length", positive=True)
        if high <= low:
            raise fields.fail("max_length", f"must be > min_length ({low:g}), got {high:g}")
        return lognormal(fields.number("mu"), fields.number("sigma", positive=True), low, high,
                         fields.number("output_length", positive=True), fields.integer("bins", 4096, minimum=16))
    if kind == "lengths":
        fields.reject_unknown(("kind", "input_lengths", "output_length", "notes"))
        lengths = fields.numbers("input_lengths")
        return LengthDistribution.from_samples(lengths, fields.number("output_length", positive=True),
                                               f"{len(lengths)} given lengths")
    fields.reject_unknown(("kind", "path", "prefix_cache", "block_tokens", "limit", "notes"))
    path = Path(fields.text("path"))
    path = path if path.is_absolute() else Path(base_dir) / path
    if not path.is_file():
        raise fields.fail("path", f"no such trace file: {path}")
    return from_trace(path, fields.text("prefix_cache", "infinite", choices=("infinite", "none")),
                      fields.integer("block_tokens", 512, minimum=1), fields.integer("limit", 0, minimum=0))


def load_workload(path: str | Path) -> LengthDistribution:
    return workload_from_dict(load_document(path, "workload"), Path(path).parent)
