"""Mooncake Table 1: hit ratio of one global block pool, LRU / LFU / length-aware x capacities, on the
FAST'25 conversation trace (the arXiv trace the paper used is not available to us).

Usage: .venv/bin/python -m bench.papers.repro_table1   -> bench/results/table1.json, table1.png
"""

from __future__ import annotations

import math

from bench.sim.common import RESULTS, pyplot, save_json
from kvcentric.core.sim.cachesim import replay_pool
from kvcentric.tools.sim import DEFAULT_TRACE
from kvcentric.core.sim.workload import load_trace

CAPACITIES = [math.inf, 100_000, 50_000, 30_000, 10_000, 1_000]
PAPER = {  # Mooncake Table 1 (arXiv trace, 23,608 requests)
    "lru": [0.51, 0.51, 0.50, 0.48, 0.40, 0.30],
    "lfu": [0.51, 0.51, 0.49, 0.43, 0.35, 0.30],
    "length_aware": [0.51, 0.50, 0.48, 0.42, 0.35, 0.30],
}


def main() -> None:
    requests = load_trace(DEFAULT_TRACE)
    ours = {policy: [replay_pool(requests, policy, c) for c in CAPACITIES] for policy in PAPER}
    label = lambda c: "inf" if c == math.inf else f"{c:,}"  # noqa: E731
    print("| policy | " + " | ".join(label(c) for c in CAPACITIES) + " |")
    for policy, rows in ours.items():
        cells = [f"{r['hit_ratio']:.2f} ({p:.2f})" for r, p in zip(rows, PAPER[policy])]
        print(f"| {policy} | " + " | ".join(cells) + " |")
    save_json("table1.json", {"trace": DEFAULT_TRACE.rsplit("/", 1)[-1], "capacities": [label(c) for c in CAPACITIES],
                              "ours": {p: [{k: r[k] for k in ("hit_ratio", "prefix_hit_ratio")} for r in rows]
                                       for p, rows in ours.items()},
                              "paper_arxiv_trace": PAPER})
    plot(ours)


def plot(ours: dict) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    x = range(len(CAPACITIES))
    for color, policy in zip(("C0", "C1", "C2"), PAPER):
        ax.plot(x, [r["hit_ratio"] for r in ours[policy]], "o-", color=color, label=f"{policy} (ours, conversation)")
        ax.plot(x, PAPER[policy], "s--", color=color, alpha=0.5, label=f"{policy} (paper, arXiv trace)")
    ax.set_xticks(list(x), ["inf", "100k", "50k", "30k", "10k", "1k"])
    ax.set_xlabel("global pool capacity (blocks of 512 tokens)")
    ax.set_ylabel("block hit ratio")
    ax.set_ylim(0, 0.6)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(RESULTS / "table1.png", dpi=120)


if __name__ == "__main__":
    main()
