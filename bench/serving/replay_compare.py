"""Side by side: the summaries of two or more `kvcentric bench replay` runs (a markdown table) and their
TTFT and TBT CDFs in one plot, as Mooncake's Figure 13 sets Mooncake against vLLM.

Usage:
    .venv/bin/python -m bench.serving.replay_compare RUN_DIR RUN_DIR [...] [--out bench/results/NAME]

Writes NAME.json (the summaries) and NAME.png (the CDFs, SLOs dashed), and prints the table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvcentric.tools.replay_plots import plot_cdfs, run_values

ROWS = (("requests", "requests", "{:d}"), ("completed", "completed", "{:d}"),
        ("completed_within_slo", "within both SLOs", "{:d}"), ("rejected_429", "rejected (429)", "{:d}"),
        ("failed", "failed", "{:d}"),
        ("ttft_p50_s", "TTFT p50 (s)", "{:.3f}"), ("ttft_p90_s", "TTFT P90 (s)", "{:.3f}"),
        ("tbt_p50_s", "TBT p50 (s)", "{:.4f}"), ("tbt_p90_s", "TBT P90 (s)", "{:.4f}"),
        ("worst_gap_p90_s", "worst gap P90 (s)", "{:.3f}"), ("slo_attainment", "SLO attainment", "{:.3f}"),
        ("goodput_rps", "goodput (req/s)", "{:.3f}"))


def table(summaries: list[dict]) -> str:
    lines = ["| | " + " | ".join(s["label"] for s in summaries) + " |", "|---" * (len(summaries) + 1) + "|"]
    for key, name, form in ROWS:
        if all(key in s for s in summaries):
            lines.append(f"| {name} | " + " | ".join(form.format(s[key]) for s in summaries) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="output directories of kvcentric bench replay")
    parser.add_argument("--out", default="replay_compare", help="path prefix of the .json and .png written")
    args = parser.parse_args()
    summaries = [json.loads((Path(run) / "summary.json").read_text()) for run in args.runs]
    config = summaries[0]["config"]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({s["label"]: s for s in summaries}, indent=2) + "\n")
    runs = {s["label"]: run_values(run) for s, run in zip(summaries, args.runs)}
    plot_cdfs(out.with_suffix(".png"), runs, config["ttft_slo_s"], config["tbt_slo_s"])
    print(table(summaries))
    print(f"\nTTFT SLO {config['ttft_slo_s']} s, TBT SLO {config['tbt_slo_s']} s -> {out}.json, {out}.png")


if __name__ == "__main__":
    main()
