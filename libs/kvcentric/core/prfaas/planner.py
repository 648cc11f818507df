"""The throughput-optimal configuration of PrfaaS §3.4.2: a grid search over the threshold t and the PD
cluster's split N_p/N_d for fixed N_prfaas and N_p + N_d, with Table 6's two baselines; it plans, it
changes no cluster.

The search maximises Λ_max (equation 6) over every N_p in 0..N_pd and every t of a log-spaced grid over
the workload's lengths (plus t = 0, all offloaded, and t = max length, none). Where several cells tie on
Λ_max (a decode-bound plateau), it takes the one with the most producer headroom
min(Θ_prfaas/p, Θ_pd-p/(1-p)), then the higher t (less cross-datacenter traffic). At the optimum the
balance conditions (7) and (8) are reported as ratios (1.0 = balanced).

Baselines (§4.3): *homogeneous PD* puts N_total instances of the PD hardware in one cluster and searches
its split alone (every request prefills on PD-P, p = 0); *naive heterogeneous* sends every prefill to the
PrfaaS cluster (p = 1) and makes the whole PD cluster decode. TTFT is the prefill latency of each request
on the hardware it is routed to, with no queueing and no transfer time: Table 6's figures match this
reading (its naive column's P90 TTFT, 3.51 s, is T_prefill on H200 at the workload's P90 length).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvcentric.core.prfaas.profile import PrfaasProfile
from kvcentric.core.prfaas.throughput import (Counts, Mode, OperatingPoint, operating_point, route_workload,
                                         throughputs)
from kvcentric.core.prfaas.workload import LengthDistribution


@dataclasses.dataclass(frozen=True)
class Column:
    """One column of Table 6: a configuration's operating point and its TTFT."""

    name: str
    point: OperatingPoint
    ttft_mean_s: float
    ttft_p90_s: float

    def to_dict(self) -> dict:
        return {"name": self.name, **self.point.to_dict(), "ttft_mean_s": self.ttft_mean_s,
                "ttft_p90_s": self.ttft_p90_s}


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    prfaas_pd: Column
    homogeneous: Column
    naive: Column
    split_search: dict
    """Figure 5(a): at the optimal t, per N_p: lambda_max, producers (Θ_prfaas + Θ_pd-p), decode (Θ_pd-d)."""
    threshold_search: dict
    """Figure 5(b): at the optimal split, per t: prfaas_per_p, pd_p_per_rest, decode, lambda_max."""
    balance: dict
    """Equations (7) and (8) at the optimum, as ratios of their two sides."""
    inputs: dict
    warnings: list[str]

    @property
    def speedup(self) -> float:
        return self.prfaas_pd.point.lambda_max / self.homogeneous.point.lambda_max

    def to_dict(self) -> dict:
        return {"prfaas_pd": self.prfaas_pd.to_dict(), "homogeneous_pd": self.homogeneous.to_dict(),
                "naive_heterogeneous": self.naive.to_dict(),
                "ratio_vs_homogeneous": {"prfaas_pd": self.speedup,
                                         "naive_heterogeneous": self.naive.point.lambda_max
                                         / self.homogeneous.point.lambda_max},
                "balance": self.balance, "figure5a_split_search": self.split_search,
                "figure5b_threshold_search": self.threshold_search, "inputs": self.inputs,
                "warnings": self.warnings}


def threshold_grid(workload: LengthDistribution, points: int = 1000) -> np.ndarray:
    """t = 0, `points` log-spaced values between the shortest and longest length, and the longest."""
    if points < 2:
        raise ValueError(f"need at least 2 threshold points, got {points}")
    low, high = float(workload.lengths[0]), float(workload.lengths[-1])
    inner = np.exp(np.linspace(np.log(low), np.log(high), points)) if high > low else np.array([low])
    return np.unique(np.concatenate([[0.0], inner, [high]]))


def ttft(profile: PrfaasProfile, workload: LengthDistribution, threshold: float,
         short_on_prfaas: bool = False) -> tuple[float, float]:
    """(mean, P90) of TTFT = T_prefill(l) on PrfaaS if l > threshold else on PD-P (see module)."""
    lengths = workload.lengths
    short_hw = profile.prfaas if short_on_prfaas else profile.pd_prefill
    times = np.where(lengths > threshold, profile.prfaas.t_prefill(lengths), short_hw.t_prefill(lengths))
    return float(workload.weights @ times), workload.quantile(0.9, times)


def search(profile: PrfaasProfile, workload: LengthDistribution, n_prfaas: int, n_pd: int,
           points: int = 1000, mode: Mode = "representative") -> tuple[OperatingPoint, np.ndarray, np.ndarray]:
    """The best (t, N_p) for N_prfaas PrfaaS and N_pd PD instances; also the grid and Λ_max[N_p, t]."""
    if n_prfaas < 0 or n_pd < 1:
        raise ValueError(f"need n_prfaas >= 0 and n_pd >= 1, got {n_prfaas} and {n_pd}")
    grid = threshold_grid(workload, points) if n_prfaas > 0 else np.array([float(workload.lengths[-1])])
    routed = route_workload(profile, workload, grid, mode)
    lam = np.empty((n_pd + 1, len(grid)))
    headroom = np.empty_like(lam)
    for n_p in range(n_pd + 1):
        th = throughputs(profile, routed, Counts(n_prfaas, n_p, n_pd - n_p), workload.output_length)
        lam[n_p] = th.lambda_max
        headroom[n_p] = np.minimum(th.prfaas_per_p, th.pd_p_per_rest)
    tied = lam >= lam.max() * (1 - 1e-9)
    order = np.lexsort((np.broadcast_to(grid, lam.shape)[tied], headroom[tied]))
    n_p, index = (axis[tied][order[-1]] for axis in np.indices(lam.shape))
    counts = Counts(n_prfaas, int(n_p), n_pd - int(n_p))
    best = operating_point(profile, routed, counts, workload.output_length, int(index))
    return best, grid, lam


def best_threshold(profile: PrfaasProfile, workload: LengthDistribution, counts: Counts, points: int = 1000,
                   mode: Mode = "representative") -> OperatingPoint:
    """The best t for fixed instance counts: the re-optimisation §3.4.3 runs after a role change, or with
    the measured egress bandwidth (`profile.with_egress(gbps)`) when the link drifts. Ties as `search`."""
    grid = threshold_grid(workload, points)
    routed = route_workload(profile, workload, grid, mode)
    th = throughputs(profile, routed, counts, workload.output_length)
    headroom = np.minimum(th.prfaas_per_p, th.pd_p_per_rest)
    tied = np.flatnonzero(th.lambda_max >= th.lambda_max.max() * (1 - 1e-9))
    index = int(tied[np.lexsort((grid[tied], headroom[tied]))[-1]])
    return operating_point(profile, routed, counts, workload.output_length, index)


def _column(name: str, profile: PrfaasProfile, workload: LengthDistribution, point: OperatingPoint,
            short_on_prfaas: bool = False) -> Column:
    mean, p90 = ttft(profile, workload, point.threshold, short_on_prfaas)
    return Column(name, point, mean, p90)


def homogeneous(profile: PrfaasProfile, workload: LengthDistribution, n_total: int,
                mode: Mode = "representative") -> Column:
    """Every prefill on PD-P of one n_total-instance PD cluster, its split searched (p = 0)."""
    point, _, _ = search(profile, workload, 0, n_total, mode=mode)
    return _column("homogeneous PD", profile, workload, point)


def naive(profile: PrfaasProfile, workload: LengthDistribution, n_prfaas: int, n_pd: int,
          mode: Mode = "representative") -> Column:
    """Every prefill on the PrfaaS cluster (p = 1), the whole PD cluster decoding."""
    routed = route_workload(profile, workload, [0.0], mode)
    point = operating_point(profile, routed, Counts(n_prfaas, 0, n_pd), workload.output_length)
    return _column("naive heterogeneous PD", profile, workload, point, short_on_prfaas=True)


def plan(profile: PrfaasProfile, workload: LengthDistribution, n_prfaas: int, n_pd: int,
         n_homogeneous: int | None = None, points: int = 1000, mode: Mode = "representative") -> Plan:
    """The optimum, both baselines (homogeneous with n_homogeneous, default n_prfaas + n_pd) and Figure 5."""
    best, grid, lam = search(profile, workload, n_prfaas, n_pd, points, mode)
    column = _column("PrfaaS-PD", profile, workload, best)
    n_total = n_prfaas + n_pd if n_homogeneous is None else n_homogeneous
    inputs = {"workload": workload.source, "mean_uncached_length": workload.mean,
              "output_length": workload.output_length, "offered_rps": workload.offered_rps,
              "egress_gbps": profile.egress_gbps, "prfaas_hardware": profile.prfaas.name,
              "pd_hardware": profile.pd_prefill.name, "decode_hardware": profile.decode.name,
              "decode_tokens_per_s": profile.decode.tokens_per_s, "n_prfaas": n_prfaas, "n_pd": n_pd,
              "n_homogeneous": n_total, "threshold_points": len(grid), "mode": mode}
    return Plan(column, homogeneous(profile, workload, n_total, mode), naive(profile, workload, n_prfaas, n_pd, mode),
                _split_search(profile, workload, best, n_pd, mode),
                _threshold_search(profile, workload, grid, best.counts, mode), _balance(best), inputs,
                _warnings(profile, workload, best))


def _split_search(profile: PrfaasProfile, workload: LengthDistribution, best: OperatingPoint, n_pd: int,
                  mode: Mode) -> dict:
    routed = route_workload(profile, workload, [best.threshold], mode)
    n_ps, lambda_max, producers, decode = [], [], [], []
    for n_p in range(n_pd + 1):
        th = throughputs(profile, routed, Counts(best.counts.prfaas, n_p, n_pd - n_p), workload.output_length)
        n_ps.append(n_p)
        lambda_max.append(float(th.lambda_max[0]))
        producers.append(float(th.prfaas[0] + th.pd_p[0]))
        decode.append(float(th.pd_d[0]))
    return {"threshold": best.threshold, "n_p": n_ps, "lambda_max": lambda_max, "producers": producers,
            "decode": decode}


def _threshold_search(profile: PrfaasProfile, workload: LengthDistribution, grid: np.ndarray, counts: Counts,
                      mode: Mode) -> dict:
    routed = route_workload(profile, workload, grid, mode)
    th = throughputs(profile, routed, counts, workload.output_length)
    finite = lambda a: [float(x) if np.isfinite(x) else None for x in a]  # noqa: E731
    return {"n_p": counts.pd_prefill, "n_d": counts.decode, "threshold": finite(grid), "p": finite(routed.p),
            "prfaas_per_p": finite(th.prfaas_per_p), "pd_p_per_rest": finite(th.pd_p_per_rest),
            "decode": finite(th.pd_d), "lambda_max": finite(th.lambda_max)}


def _balance(point: OperatingPoint) -> dict:
    p = point.p
    eq7 = (point.theta_prfaas / p) / (point.theta_pd_p / (1 - p)) if 0 < p < 1 and point.theta_pd_p > 0 else None
    eq8 = (point.theta_prfaas + point.theta_pd_p) / point.theta_pd_d if point.theta_pd_d > 0 else None
    return {"eq7_prfaas_per_p_over_pd_p_per_rest": eq7, "eq8_producers_over_decode": eq8}


def _warnings(profile: PrfaasProfile, workload: LengthDistribution, best: OperatingPoint) -> list[str]:
    out = []
    for role, hardware in (("prfaas", profile.prfaas), ("pd_prefill", profile.pd_prefill)):
        outside = ~np.array([hardware.prefill.covers(length) for length in workload.lengths])
        share = float(workload.weights[outside].sum())
        if share > 0.01:
            out.append(f"{share:.1%} of the workload lies outside the {role} profile's lengths "
                       f"{hardware.prefill.lengths[0]:g}..{hardware.prefill.lengths[-1]:g} (extrapolated)")
    if best.counts.decode == 0 or best.lambda_max <= 0:
        out.append("no configuration serves any request: check the profile and instance counts")
    if workload.offered_rps and workload.offered_rps > best.lambda_max:
        out.append(f"the trace offers {workload.offered_rps:.2f} req/s, above Λ_max {best.lambda_max:.2f}")
    return out
