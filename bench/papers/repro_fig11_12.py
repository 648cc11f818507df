"""Mooncake Figures 11 and 12 (§8.1.1, §8.1.2) in the simulator at the paper's scale: Mooncake-[3P+1D] and
Mooncake-[2P+2D] against vLLM-[4M] (four colocated instances), P90 TTFT and P90 TBT against request rate,
with the SLOs relative to unloaded latency (TTFT_P90 = 10×, TBT_P90 = 5×, §2) and normalised so 1.0 is the
limit; "throughput under SLO" is the highest rate at which both P90s are within.

Workload: the FAST'25 synthetic trace (Poisson arrivals, mean input 15,326, output 149 tokens, ~65 % cache
ratio), replayed at several speeds (the paper's ArXiv/L-Eval sets and its simulated data are not ours).
Model: the LLaMA2-70B roofline on 8×A800 per instance (`kvcentric sim` defaults). No rejection: every request
is served, and the P90s say whether the rate is sustainable. Disaggregated setups place with `kvcentric`
(Algorithm 1), colocated ones with `cache_aware` (vLLM pulls from no other instance) and run each prompt as a
step that stalls the batch (vLLM without chunked prefill), or in 2,048-token chunks.

The unloaded reference is the same for every setup: per P90, the lowest any setup measured at the lowest
speed (0.05×, 0.2 req/s), so all of them face one pair of thresholds.

Usage: .venv/bin/python -m bench.papers.repro_fig11_12   -> bench/results/fig11_12_sim.json, fig11_12_sim.png
"""

from __future__ import annotations

from bench.sim.common import RESULTS, brief, pyplot, save_json, simulate
from kvcentric.core.sim.slo import normalised_p90s, relative_slos
from kvcentric.tools.sim import DEFAULT_TRACE

TRACE = DEFAULT_TRACE.replace("conversation_trace", "synthetic_trace")
TRACE_RPS = 3993 / 1022.025
"""The synthetic trace's mean rate at 1×: 3,993 requests in 1,022 s."""
SPEEDS = [0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 1.0]
SETUPS = {
    "Mooncake-[3P+1D]": {"architecture": "disaggregated", "prefill": 3, "decode": 1, "policy": "kvcentric"},
    "Mooncake-[2P+2D]": {"architecture": "disaggregated", "prefill": 2, "decode": 2, "policy": "kvcentric"},
    "vLLM-[4M]": {"architecture": "colocated", "instances": 4, "policy": "cache_aware"},
    "vLLM-[4M], chunked": {"architecture": "colocated", "instances": 4, "policy": "cache_aware",
                           "chunked_prefill": True},
}
KEYS = ("completed", "ttft_mean_s", "ttft_p90_s", "tbt_p90_s", "worst_gap_p90_s", "prefix_hit_ratio")


def sweep() -> dict[str, dict[float, dict]]:
    runs: dict[str, dict[float, dict]] = {}
    for name, setup in SETUPS.items():
        runs[name] = {}
        for speed in SPEEDS:
            summary, _, _ = simulate(trace=TRACE, speed=speed, rejection="never", sample_s=0, **setup)
            runs[name][speed] = brief(summary, *KEYS)
            print(f"{name} {speed}x: {runs[name][speed]}", flush=True)
    return runs


def judge(runs: dict[str, dict[float, dict]]) -> tuple[dict, dict]:
    """The shared relative SLOs, and per setup its normalised P90s and the highest rate within both."""
    lowest = SPEEDS[0]
    reference = {k: min(runs[name][lowest][k] for name in runs) for k in ("ttft_p90_s", "tbt_p90_s")}
    slos = relative_slos(reference)
    table = {}
    for name, by_speed in runs.items():
        rows = []
        for speed, summary in by_speed.items():
            row = {"speed": speed, "rps": round(speed * TRACE_RPS, 3), **summary,
                   **{k: round(v, 4) if isinstance(v, float) else v for k, v in normalised_p90s(summary, slos).items()}}
            rows.append(row)
        within = [r["rps"] for r in rows if r["p90_slos_met"]]
        table[name] = {"rows": rows, "max_rps_within_slo": max(within, default=0.0)}
    return slos.to_dict(), table


def plot(table: dict) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, result in table.items():
        rps = [r["rps"] for r in result["rows"]]
        axes[0].plot(rps, [r["ttft_p90_normalised"] for r in result["rows"]], marker="o", markersize=3, label=name)
        axes[1].plot(rps, [r["tbt_p90_normalised"] for r in result["rows"]], marker="o", markersize=3, label=name)
    for ax, what in zip(axes, ("P90 TTFT / SLO (10× unloaded)", "P90 TBT / SLO (5× unloaded)")):
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        ax.set_yscale("log")
        ax.set_xlabel("request rate (req/s), synthetic trace")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Figures 11-12 in the simulator: LLaMA2-70B roofline, 8xA800 per instance", fontsize=9)
    fig.tight_layout()
    fig.savefig(RESULTS / "fig11_12_sim.png", dpi=120)
    plt.close(fig)


def main() -> None:
    runs = sweep()
    slos, table = judge(runs)
    save_json("fig11_12_sim.json", {"trace": "synthetic_trace.jsonl", "trace_rps_at_1x": round(TRACE_RPS, 3),
                                    "slos": slos, "setups": SETUPS, "results": table})
    plot(table)
    print("| setup | max req/s with P90 TTFT and P90 TBT within SLO |")
    for name, result in table.items():
        print(f"| {name} | {result['max_rps_within_slo']} |")


if __name__ == "__main__":
    main()
