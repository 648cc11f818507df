"""TTFT and TBT CDFs of one or more replays side by side, as in Mooncake's Figure 13 (matplotlib,
headless); it draws measured values and computes nothing new."""

from __future__ import annotations

import json
from pathlib import Path

from kvcentric.core.sim.metrics import Record
from kvcentric.tools.sim_plots import _pyplot, cdf


def record_values(records: list[Record]) -> tuple[list[float], list[float]]:
    """TTFTs and per-request mean TBTs of the completed requests."""
    done = [r for r in records if r.status == "completed"]
    return [r.ttft_s for r in done], [r.tbt_s for r in done if r.request.output_len > 1]


def run_values(directory: str | Path) -> tuple[list[float], list[float]]:
    """The same, read back from a replay's requests.jsonl."""
    rows = [json.loads(line) for line in open(Path(directory) / "requests.jsonl")]
    done = [r for r in rows if r["status"] == "completed"]
    return [r["ttft_s"] for r in done], [r["tbt_s"] for r in done if r.get("output_len", 0) > 1]


def plot_cdfs(path: Path, runs: dict[str, tuple[list[float], list[float]]], ttft_slo: float,
              tbt_slo: float, normalised: bool = False) -> Path | None:
    """One PNG: TTFT CDF left, TBT CDF right, one curve per run, SLOs dashed; None without matplotlib. With
    `normalised`, values are divided by their SLOs (Mooncake §8.1's axes: 1.0 is the limit)."""
    plt = _pyplot()
    if plt is None:
        return None
    ttft_scale, tbt_scale = (ttft_slo, tbt_slo) if normalised else (1.0, 1.0)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for label, (ttfts, tbts) in runs.items():
        cdf(left, [v / ttft_scale for v in ttfts], label, ttft_slo / ttft_scale)
        cdf(right, [v / tbt_scale for v in tbts], label, tbt_slo / tbt_scale)
    left.set_xlabel("TTFT / TTFT SLO" if normalised else "TTFT (s)")
    right.set_xlabel("mean time between tokens per request / TBT SLO" if normalised
                     else "mean time between tokens per request (s)")
    for ax in (left, right):
        ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
