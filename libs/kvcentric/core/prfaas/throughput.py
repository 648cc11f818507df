"""The steady-state throughput model of PrfaaS §3.4.1, equations (3)–(6), evaluated for one split of
instances over a grid of thresholds t; it evaluates and compares, the search is in `planner`.

    Θ_prfaas = min(N_prfaas / T_prefill(l_long), B_out / S_kv(l_long))          (3)
    Θ_pd-p   = N_p / T_prefill(l_short)                                           (4)
    Θ_pd-d   = N_d * BS_max / (T_decode * L_out)                                  (5)
    Λ_max    = min(Θ_prfaas / p, Θ_pd-p / (1 - p), Θ_pd-d)                        (6)

with p = P(L > t), l_long = E[L | L > t], l_short = E[L | L <= t] over the uncached length L (§3.4.1
approximates each side by one representative length: `mode="representative"`). `mode="expected"`
uses E[T_prefill(L) | side] and E[S_kv(L) | side] instead, the mean service time of the side, which a
queue actually sees; for near-linear profiles the two differ by a few percent. A stage with no traffic
(p = 0 or p = 1) puts no limit on Λ. All rates are requests per second; bytes and seconds elsewhere.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np

from kvcentric.core.prfaas.profile import HardwareProfile, PrfaasProfile
from kvcentric.core.prfaas.workload import LengthDistribution

Mode = Literal["representative", "expected"]
STAGES = ("prfaas-compute", "prfaas-bandwidth", "pd-p", "pd-d")


@dataclasses.dataclass(frozen=True)
class Counts:
    """Instances per role: N_prfaas (PrfaaS cluster), N_p and N_d (prefill and decode of the PD cluster)."""

    prfaas: int
    pd_prefill: int
    decode: int

    def __post_init__(self) -> None:
        if min(self.prfaas, self.pd_prefill, self.decode) < 0:
            raise ValueError(f"instance counts must be >= 0, got {self}")


@dataclasses.dataclass(frozen=True, eq=False)
class Routed:
    """Per threshold: p and the service times each side sees (arrays aligned with `thresholds`)."""

    thresholds: np.ndarray
    p: np.ndarray
    l_long: np.ndarray
    l_short: np.ndarray
    t_long: np.ndarray
    """PrfaaS prefill seconds per request (on the PrfaaS hardware)."""
    kv_long: np.ndarray
    """KV bytes a PrfaaS request ships."""
    t_short: np.ndarray
    """PD-P prefill seconds per request (on the PD hardware)."""


def route_workload(profile: PrfaasProfile, workload: LengthDistribution, thresholds,
                   mode: Mode = "representative", long_hardware: HardwareProfile | None = None,
                   short_hardware: HardwareProfile | None = None) -> Routed:
    """Split the workload at each threshold and price both sides (hardware defaults: PrfaaS / PD-P)."""
    long_hw = long_hardware or profile.prfaas
    short_hw = short_hardware or profile.pd_prefill
    p, l_long, l_short = workload.split(thresholds)
    if mode == "representative":
        t_long, t_short = long_hw.t_prefill(l_long), short_hw.t_prefill(l_short)
        kv_long = long_hw.kv_bytes(l_long) if long_hw.kv is not None else np.zeros_like(l_long)
    elif mode == "expected":
        t_long = workload.split(thresholds, long_hw.t_prefill(workload.lengths))[1]
        t_short = workload.split(thresholds, short_hw.t_prefill(workload.lengths))[2]
        kv_long = (workload.split(thresholds, long_hw.kv_bytes(workload.lengths))[1]
                   if long_hw.kv is not None else np.zeros_like(l_long))
    else:
        raise ValueError(f"mode must be 'representative' or 'expected', got {mode!r}")
    return Routed(np.atleast_1d(np.asarray(thresholds, float)), p, l_long, l_short,
                  np.atleast_1d(t_long), np.atleast_1d(kv_long), np.atleast_1d(t_short))


@dataclasses.dataclass(frozen=True, eq=False)
class Throughputs:
    """Equations (3)–(6) for one Counts over the thresholds of a Routed (arrays, req/s)."""

    prfaas_compute: np.ndarray
    prfaas_bandwidth: np.ndarray
    prfaas: np.ndarray
    pd_p: np.ndarray
    pd_d: np.ndarray
    prfaas_per_p: np.ndarray
    """Θ_prfaas / p: the Λ the PrfaaS stage allows (inf when p = 0)."""
    pd_p_per_rest: np.ndarray
    """Θ_pd-p / (1 - p): the Λ the PD-P stage allows (inf when p = 1)."""
    lambda_max: np.ndarray


def throughputs(profile: PrfaasProfile, routed: Routed, counts: Counts, output_length: float,
                bandwidth: bool = True) -> Throughputs:
    """Θ and Λ_max per threshold; `bandwidth=False` drops B_out from (3) (an in-cluster prefill pool)."""
    p = routed.p
    has_long, has_short = p > 1e-12, p < 1 - 1e-12
    with np.errstate(divide="ignore", invalid="ignore"):
        compute = np.where(has_long, counts.prfaas / routed.t_long, 0.0)
        link = (np.where(has_long, profile.egress_bytes_per_s / routed.kv_long, 0.0) if bandwidth
                else np.full_like(p, np.inf))
        prfaas = np.minimum(compute, link)
        pd_p = np.where(has_short, counts.pd_prefill / routed.t_short, 0.0)
        per_p = np.where(has_long, prfaas / np.where(has_long, p, 1.0), np.inf)
        per_rest = np.where(has_short, pd_p / np.where(has_short, 1.0 - p, 1.0), np.inf)
    pd_d = np.full_like(p, counts.decode * profile.decode.throughput(output_length))
    lam = np.minimum(np.minimum(per_p, per_rest), pd_d)
    return Throughputs(compute, link, prfaas, pd_p, pd_d, per_p, per_rest, lam)


@dataclasses.dataclass(frozen=True)
class OperatingPoint:
    """One configuration: its threshold, counts, the Θ of each stage, Λ_max and what binds it."""

    threshold: float
    counts: Counts
    p: float
    l_long: float
    l_short: float
    theta_prfaas: float
    theta_prfaas_compute: float
    theta_prfaas_bandwidth: float
    theta_pd_p: float
    theta_pd_d: float
    lambda_max: float
    bottleneck: str
    egress_gbps: float
    """PrfaaS egress at Λ_max: p * Λ_max * S_kv(l_long), Gbit/s."""
    egress_utilization: float
    """egress_gbps / B_out."""

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["counts"] = dataclasses.asdict(self.counts)
        return {k: (None if isinstance(v, float) and not np.isfinite(v) else v) for k, v in out.items()}


def operating_point(profile: PrfaasProfile, routed: Routed, counts: Counts, output_length: float,
                    index: int = 0, bandwidth: bool = True) -> OperatingPoint:
    """The OperatingPoint at `routed.thresholds[index]`."""
    th = throughputs(profile, routed, counts, output_length, bandwidth)
    i = index
    p, lam = float(routed.p[i]), float(th.lambda_max[i])
    limits = {"prfaas-compute": th.prfaas_compute[i] / p if p > 1e-12 else np.inf,
              "prfaas-bandwidth": th.prfaas_bandwidth[i] / p if p > 1e-12 else np.inf,
              "pd-p": th.pd_p_per_rest[i], "pd-d": th.pd_d[i]}
    bottleneck = min(STAGES, key=lambda stage: limits[stage])
    kv = float(routed.kv_long[i]) if p > 1e-12 else 0.0
    egress = p * lam * kv * 8 / 1e9 if np.isfinite(lam) else 0.0
    return OperatingPoint(float(routed.thresholds[i]), counts, p, float(routed.l_long[i]),
                          float(routed.l_short[i]), float(th.prfaas[i]), float(th.prfaas_compute[i]),
                          float(th.prfaas_bandwidth[i]), float(th.pd_p[i]), float(th.pd_d[i]), lam, bottleneck,
                          egress, egress / profile.egress_gbps)
