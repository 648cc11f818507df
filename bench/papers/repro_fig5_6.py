"""Mooncake Figures 5 and 6 (§4) from the traces we have: input and output length distributions, and the CDF
of how many times each 512-token block is hit (reused after its first appearance). The paper drew them from
its arXiv trace (mean input 7,590, mean output 182 tokens); we have the FAST'25 conversation and synthetic
traces. It reads trace files and counts; it simulates nothing.

Usage: .venv/bin/python -m bench.papers.repro_fig5_6
  -> bench/results/fig5_lengths.{json,png}, fig6_block_hits.{json,png}
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

from bench.sim.common import RESULTS, pyplot, save_json
from kvcentric.core.sim.workload import SimRequest, load_trace
from kvcentric.tools.sim import DEFAULT_TRACE

TRACES = {"conversation": Path(DEFAULT_TRACE), "synthetic": Path(DEFAULT_TRACE).with_name("synthetic_trace.jsonl")}
PAPER = {"mean_input": 7590, "mean_output": 182, "mean_input_output_ratio": 720,
         "blocks_never_hit_share": "over 0.5", "most_hit_block": "tens of thousands"}


def quantiles(values: np.ndarray) -> dict:
    return {"mean": round(float(values.mean()), 1), "p50": float(np.percentile(values, 50)),
            "p90": float(np.percentile(values, 90)), "p99": float(np.percentile(values, 99)),
            "max": int(values.max())}


def lengths(requests: list[SimRequest]) -> dict:
    """Figure 5's numbers: input and output length quantiles and the mean input/output ratio."""
    inputs = np.array([r.input_len for r in requests], dtype=float)
    outputs = np.array([r.output_len for r in requests], dtype=float)
    return {"requests": len(requests), "input": quantiles(inputs), "output": quantiles(outputs),
            "mean_input_output_ratio": round(float(np.mean(inputs / outputs)), 1),
            "ratio_of_means": round(float(inputs.mean() / outputs.mean()), 1)}


def block_hits(requests: list[SimRequest]) -> tuple[np.ndarray, dict]:
    """Figure 6: per distinct block, its uses after the first (a hit with an infinite cache)."""
    uses = Counter(h for r in requests for h in r.hashes)
    hits = np.array(sorted(n - 1 for n in uses.values()))
    summary = {"blocks": len(hits), "never_hit_share": round(float(np.mean(hits == 0)), 4),
               "hit_at_most_once_share": round(float(np.mean(hits <= 1)), 4),
               "hit_10_or_more_share": round(float(np.mean(hits >= 10)), 4),
               "hits_p90": float(np.percentile(hits, 90)), "hits_p99": float(np.percentile(hits, 99)),
               "most_hits": int(hits.max()),
               "top_1pct_blocks_share_of_hits": round(float(hits[-max(1, len(hits) // 100):].sum() / hits.sum()), 4)}
    return hits, summary


def plot_lengths(data: dict[str, list[SimRequest]]) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for name, requests in data.items():
        for ax, values in zip(axes, ([r.input_len for r in requests], [r.output_len for r in requests])):
            ax.hist(values, bins=np.logspace(0, np.log10(max(values) + 1), 60), histtype="step", label=name,
                    density=False)
    for ax, what in zip(axes, ("input length (tokens)", "output length (tokens)")):
        ax.set_xscale("log")
        ax.set_xlabel(what)
        ax.set_ylabel("requests")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Figure 5 from the FAST'25 traces: input and output lengths", fontsize=9)
    fig.tight_layout()
    fig.savefig(RESULTS / "fig5_lengths.png", dpi=120)
    plt.close(fig)


def plot_hits(hits: dict[str, np.ndarray]) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for name, values in hits.items():
        ax.plot(values + 1, np.arange(1, len(values) + 1) / len(values), label=name, drawstyle="steps-post")
    ax.set_xscale("log")
    ax.set_xlabel("block hit count + 1 (uses of the block)")
    ax.set_ylabel("fraction of distinct blocks")
    ax.set_ylim(0, 1.01)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Figure 6 from the FAST'25 traces: CDF of block hit count", fontsize=9)
    fig.tight_layout()
    fig.savefig(RESULTS / "fig6_block_hits.png", dpi=120)
    plt.close(fig)


def main() -> None:
    data = {name: load_trace(path) for name, path in TRACES.items()}
    fig5 = {name: lengths(requests) for name, requests in data.items()}
    hits = {}
    fig6 = {}
    for name, requests in data.items():
        hits[name], fig6[name] = block_hits(requests)
    save_json("fig5_lengths.json", {"paper_arxiv_trace": PAPER, "traces": fig5})
    save_json("fig6_block_hits.json", {"paper_arxiv_trace": PAPER, "traces": fig6})
    plot_lengths(data)
    plot_hits(hits)
    for name in data:
        print(name, fig5[name], fig6[name])


if __name__ == "__main__":
    main()
