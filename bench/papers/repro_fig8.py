"""Mooncake Figure 8 (§6.2): prefill placement policies on 8 prefill + 8 decode instances replaying a
real trace; mean TTFT and TTFT SLO attainment. Also Llumnix's metric, and Algorithm 1's threshold.

The paper's cluster replayed the arXiv trace (23,000 requests) overnight; we replay the FAST'25
conversation trace (12,031 requests, one hour) on the simulator, LLaMA2-70B roofline on 8xA800 nodes,
no rejection (every request is served, so attainment measures TTFT alone), TTFT SLO 30 s.

Usage: .venv/bin/python -m bench.papers.repro_fig8   -> bench/results/fig8.json, fig8.png
"""

from __future__ import annotations

import math

from kvcentric.core.scheduling.policies import PLACEMENT_POLICIES
from bench.sim.common import RESULTS, brief, pyplot, save_json, simulate

POLICIES = list(PLACEMENT_POLICIES)
SPEEDS = [1.0, 1.5]
THRESHOLDS = [1.0, 1.5, 2.0, 4.0, 8.0, math.inf]
KEYS = ("ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_slo_attainment", "prefix_hit_ratio", "pulls",
        "pulled_blocks", "sim_wall_s")


def main() -> None:
    runs = {}
    for speed in SPEEDS:
        for policy in POLICIES:
            summary, _, _ = simulate(policy=policy, rejection="never", speed=speed, sample_s=0)
            runs[f"{policy}@{speed}x"] = brief(summary, *KEYS)
            print(f"{speed}x {policy:>12}: {runs[f'{policy}@{speed}x']}")
    sweep = {}
    for threshold in THRESHOLDS:
        summary, _, _ = simulate(policy="kvcentric", rejection="never", speed=1.5, sample_s=0,
                                 kvcache_balancing_threshold=threshold)
        sweep[str(threshold)] = brief(summary, *KEYS)
        print(f"threshold {threshold}: {sweep[str(threshold)]}")
    save_json("fig8.json", {"cluster": "8P+8D", "trace": "conversation_trace.jsonl", "ttft_slo_s": 30.0,
                            "runs": runs, "kvcentric_threshold_sweep_at_1.5x": sweep})
    plot(runs)


def plot(runs: dict) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    width = 0.8 / len(SPEEDS)
    for i, speed in enumerate(SPEEDS):
        xs = [p + i * width for p in range(len(POLICIES))]
        mean = [runs[f"{p}@{speed}x"]["ttft_mean_s"] for p in POLICIES]
        attained = [100 * runs[f"{p}@{speed}x"]["ttft_slo_attainment"] for p in POLICIES]
        axes[0].bar(xs, mean, width, label=f"{speed:g}x replay")
        axes[1].bar(xs, attained, width, label=f"{speed:g}x replay")
    for ax, title in zip(axes, ("mean TTFT (s, log)", "TTFT SLO (30 s) attainment (%)")):
        ax.set_xticks([p + width * (len(SPEEDS) - 1) / 2 for p in range(len(POLICIES))], POLICIES, fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
    axes[0].set_yscale("log")
    fig.suptitle("8P+8D, LLaMA2-70B roofline on 8xA800, conversation trace (simulated)", fontsize=10)
    fig.tight_layout()
    fig.savefig(RESULTS / "fig8.png", dpi=120)


if __name__ == "__main__":
    main()
