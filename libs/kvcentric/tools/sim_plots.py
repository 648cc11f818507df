"""PNG plots of one simulation: TTFT and TBT CDFs, and prefill and decode load over time (matplotlib,
headless); it draws what `kvcentric.core.sim.metrics` measured and computes nothing new."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvcentric.core.sim.metrics import LoadSeries, Record


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def cdf(ax, values, label: str, slo: float | None = None) -> None:
    values = np.sort(np.asarray(values))
    if len(values):
        ax.plot(values, np.arange(1, len(values) + 1) / len(values), label=label)
    if slo is not None:
        ax.axvline(slo, color="grey", linestyle="--", linewidth=1)
    ax.set_ylabel("fraction of completed requests")
    ax.set_ylim(0, 1.01)
    ax.grid(alpha=0.3)


def plot_run(out: Path, records: list[Record], series: LoadSeries, ttft_slo: float, tbt_slo: float,
             normalised: bool = False) -> list[Path]:
    """ttft_cdf.png, tbt_cdf.png and load.png in `out`; nothing (and no error) without matplotlib. With
    `normalised`, TTFT and TBT are divided by their SLOs (Mooncake §8.1's axes: 1.0 is the limit)."""
    plt = _pyplot()
    if plt is None:
        return []
    done = [r for r in records if r.status == "completed"]
    ttft_scale, tbt_scale = (ttft_slo, tbt_slo) if normalised else (1.0, 1.0)
    written = []
    for name, values, slo, label in (
            ("ttft_cdf.png", [r.ttft_s / ttft_scale for r in done], ttft_slo / ttft_scale,
             "TTFT / TTFT SLO" if normalised else "TTFT (s)"),
            ("tbt_cdf.png", [r.tbt_s / tbt_scale for r in done if r.request.output_len > 1], tbt_slo / tbt_scale,
             "mean TBT per request / TBT SLO" if normalised else "mean TBT per request (s)")):
        fig, ax = plt.subplots(figsize=(5, 3.5))
        cdf(ax, values, label, slo)
        ax.set_xlabel(label)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(out / name)
    written.append(plot_load(plt, out / "load.png", series))
    return written


def plot_load(plt, path: Path, series: LoadSeries, title: str = "") -> Path:
    fig, ax = plt.subplots(figsize=(8, 3.5))
    t = np.asarray(series.t) / 60
    ax.plot(t, series.prefill, label="prefill load (queued s / TTFT SLO)", linewidth=1)
    ax.plot(t, series.decode, label="decode load (step time / TBT SLO)", linewidth=1)
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("simulated time (min)")
    ax.set_ylabel("mean load per instance")
    if title:
        ax.set_title(title)
    ax.legend(loc="upper right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
