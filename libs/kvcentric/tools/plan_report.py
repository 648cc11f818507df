"""Presents a Plan: the Table-6-style text, the JSON file and Figure 5's two searches as PNGs; it computes
nothing new (matplotlib is imported only to plot).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from kvcentric.core.prfaas.planner import Column, Plan


def _counts(column: Column) -> str:
    c = column.point.counts
    return " / ".join(str(n) if n else "—" for n in (c.prfaas, c.pd_prefill, c.decode))


def _thetas(column: Column) -> str:
    p = column.point
    parts = [p.theta_prfaas if p.counts.prfaas else None, p.theta_pd_p if p.counts.pd_prefill else None,
             p.theta_pd_d]
    return " / ".join("—" if x is None else f"{x:.2f}" for x in parts)


def table(plan: Plan) -> str:
    """Table 6's rows for the three configurations, then the optimum's traffic and balance."""
    columns = (plan.prfaas_pd, plan.homogeneous, plan.naive)
    base = plan.homogeneous.point.lambda_max
    best = plan.prfaas_pd.point
    rows = [("", [c.name for c in columns]),
            ("threshold t (uncached tokens)", [f"{best.threshold:,.0f}", "—", "—"]),
            ("N_prfaas / N_p / N_d", [_counts(c) for c in columns]),
            ("mean / P90 TTFT (s)", [f"{c.ttft_mean_s:.2f} / {c.ttft_p90_s:.2f}" for c in columns]),
            ("Θ_prfaas / Θ_pd-p / Θ_pd-d (req/s)", [_thetas(c) for c in columns]),
            ("Λ_max (req/s)", [f"{c.point.lambda_max:.2f}" for c in columns]),
            ("ratio", [f"{c.point.lambda_max / base:.2f}×" for c in columns]),
            ("bottleneck", [c.point.bottleneck for c in columns])]
    width = max(len(label) for label, _ in rows) + 2
    lines = [f"{label:<{width}}" + "".join(f"{cell:<26}" for cell in cells) for label, cells in rows]
    inputs = plan.inputs
    eq7, eq8 = plan.balance.values()
    lines += ["",
              f"workload: {inputs['workload']}; mean uncached length {inputs['mean_uncached_length']:,.0f} tokens, "
              f"L_out {inputs['output_length']:.0f}",
              f"offloaded to PrfaaS: {best.p:.1%} (E[L | L > t] = {best.l_long:,.0f}, "
              f"E[L | L <= t] = {best.l_short:,.0f} tokens)",
              f"PrfaaS egress at Λ_max: {best.egress_gbps:.1f} Gbps, {best.egress_utilization:.0%} of "
              f"B_out = {inputs['egress_gbps']:g} Gbps",
              f"balance at the optimum: eq (7) Θ_prfaas/p ÷ Θ_pd-p/(1-p) = {_ratio(eq7)}, "
              f"eq (8) (Θ_prfaas + Θ_pd-p) ÷ Θ_pd-d = {_ratio(eq8)}"]
    if inputs.get("offered_rps"):
        lines.append(f"the trace offers {inputs['offered_rps']:.2f} req/s: "
                     f"{inputs['offered_rps'] / best.lambda_max:.0%} of Λ_max")
    lines += [f"warning: {w}" for w in plan.warnings]
    return "\n".join(lines)


def _ratio(value) -> str:
    return "—" if value is None else f"{value:.2f}"


def write_json(plan: Plan, path: str | Path, **extra) -> None:
    """plan.to_dict() and `extra` as JSON: NaN and infinities become null, lists of numbers stay on one line."""
    text = json.dumps(_finite({**plan.to_dict(), **extra}), indent=2, ensure_ascii=False, allow_nan=False)
    text = re.sub(r"\[\s+([^\[\]{}]*?)\s+\]", lambda m: "[" + re.sub(r",\s+", ", ", m.group(1)) + "]", text)
    Path(path).write_text(text + "\n")


def _finite(value):
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def plot_split_search(plan: Plan, path: str | Path, title: str = "") -> None:
    """Figure 5(a): at the optimal t, Λ_max, producer and decode throughput over the PD split."""
    plt = _pyplot()
    s = plan.split_search
    fig, ax = plt.subplots(figsize=(6, 4))
    n_pd = s["n_p"][-1]
    labels = [f"{n}/{n_pd - n}" for n in s["n_p"]]
    ax.plot(labels, s["producers"], "o-", label="Θ_prfaas + Θ_pd-p (producers)")
    ax.plot(labels, s["decode"], "s-", label="Θ_pd-d (decode)")
    ax.plot(labels, s["lambda_max"], "k^--", label="Λ_max")
    best = plan.prfaas_pd.point.counts.pd_prefill
    ax.axvline(best, color="grey", lw=0.8)
    ax.set_xlabel("N_p / N_d in the PD cluster")
    ax.set_ylabel("requests per second")
    ax.set_title(title or f"split search at t = {s['threshold'] / 1000:.1f}K tokens")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_threshold_search(plan: Plan, path: str | Path, title: str = "") -> None:
    """Figure 5(b): at the optimal split, Θ_prfaas/p, Θ_pd-p/(1-p) and Λ_max over the threshold t."""
    plt = _pyplot()
    s = plan.threshold_search
    points = [(t, a, b, lam) for t, a, b, lam in zip(s["threshold"], s["prfaas_per_p"], s["pd_p_per_rest"],
                                                     s["lambda_max"]) if t and t > 0]
    t = [x[0] / 1000 for x in points]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(t, [x[1] for x in points], label="Θ_prfaas / p")
    ax.plot(t, [x[2] for x in points], label="Θ_pd-p / (1 - p)")
    ax.plot(t, [x[3] for x in points], "k--", label="Λ_max")
    ax.axhline(s["decode"][0], color="tab:green", lw=0.8, label="Θ_pd-d")
    ax.axvline(plan.prfaas_pd.point.threshold / 1000, color="grey", lw=0.8)
    top = max(x[3] for x in points)
    ax.set_ylim(0, 2.5 * top if top > 0 else 1)
    ax.set_xscale("log")
    ax.set_xlabel("threshold t (thousand uncached tokens)")
    ax.set_ylabel("requests per second")
    ax.set_title(title or f"threshold search at N_p = {s['n_p']}, N_d = {s['n_d']}")
    ax.legend()
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("plots need matplotlib: pip install -e '.[bench]' (or pass --no-plots)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt
