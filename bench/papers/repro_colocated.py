"""Mooncake §8.1.3: 10 prefill + 10 decode instances vs 20 colocated (vLLM-like) instances replaying a
real trace, TTFT SLO 30 s, TBT SLO 100 ms: how many requests meet both SLOs (the paper: ~75% more).

Colocated instances continuously batch decode and run each prompt as one step that stalls the batch
(vLLM without chunked prefill), or as chunks of 2048 tokens mixed into decode steps. Both architectures
get the same host prefix cache per instance; disaggregated places with `kvcentric`, colocated with
`cache_aware` (no cross-instance pulls). No rejection: every request is served and judged. A request's
TBT SLO is read three ways: its mean gap, its P90 gap, its worst gap.

Usage: .venv/bin/python -m bench.papers.repro_colocated   -> bench/results/colocated.json, colocated.png
"""

from __future__ import annotations

import json

import numpy as np

from bench.sim.common import RESULTS, brief, pyplot, save_json, simulate

SPEEDS = [1.0, 2.0, 3.0]
SETUPS = {
    "Mooncake 10P+10D": {"prefill": 10, "decode": 10, "policy": "kvcentric"},
    "vLLM 20M": {"architecture": "colocated", "instances": 20, "policy": "cache_aware"},
    "vLLM 20M chunked": {"architecture": "colocated", "instances": 20, "policy": "cache_aware",
                         "chunked_prefill": True, "prefill_chunk": 2048},
    "Mooncake 14P+6D": {"prefill": 14, "decode": 6, "policy": "kvcentric"},
}
KEYS = ("completed_within_slo", "completed_within_slo_p90_gap", "completed_within_slo_worst_gap",
        "ttft_mean_s", "ttft_p90_s", "tbt_p90_s", "worst_gap_p90_s", "ttft_slo_attainment", "tbt_slo_attainment",
        "prefix_hit_ratio")


def main() -> None:
    runs, cdfs = {}, {}
    for speed in SPEEDS:
        for name, setup in SETUPS.items():
            summary, records, _ = simulate(speed=speed, rejection="never", ttft_slo_s=30.0, tbt_slo_s=0.1,
                                           sample_s=0, **setup)
            runs[f"{name} @{speed:g}x"] = brief(summary, *KEYS)
            print(f"{speed:g}x {name}: {runs[f'{name} @{speed:g}x']}")
            if speed == 1.0 and "14P" not in name:
                done = [r for r in records if r.status == "completed" and r.request.output_len > 1]
                cdfs[name] = ([r.ttft_s for r in done], [r.tbt_s for r in done], [r.max_gap_s for r in done])
    ratios = {}
    for speed in SPEEDS:
        theirs = runs[f"vLLM 20M @{speed:g}x"]
        for setup in ("Mooncake 10P+10D", "Mooncake 14P+6D"):
            ours = runs[f"{setup} @{speed:g}x"]
            ratios[f"{setup} vs vLLM 20M @{speed:g}x"] = {k: round(ours[k] / max(1, theirs[k]) - 1, 4)
                                                          for k in KEYS[:3]}
    print("more requests within both SLOs than vLLM 20M:", json.dumps(ratios, indent=1))
    save_json("colocated.json", {"trace": "conversation_trace.jsonl", "runs": runs,
                                 "mooncake_vs_vllm_more_within_slo": ratios, "paper": "about +75% (arXiv trace)"})
    plot(cdfs)


def plot(cdfs: dict) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    titles = ("TTFT (s)", "mean TBT per request (s)", "worst gap per request (s)")
    for name, columns in cdfs.items():
        for ax, values in zip(axes, columns):
            values = np.sort(values)
            ax.plot(values, np.arange(1, len(values) + 1) / len(values), label=name)
    for ax, title, slo in zip(axes, titles, (30.0, 0.1, 0.1)):
        ax.axvline(slo, color="grey", linestyle="--", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_xlabel(title)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("CDF of requests")
    axes[0].legend(fontsize=7)
    fig.suptitle("1x replay of the conversation trace: 10P+10D vs 20 colocated (simulated, cf. Mooncake Fig. 13)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(RESULTS / "colocated.png", dpi=120)


if __name__ == "__main__":
    main()
