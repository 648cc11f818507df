"""How well the conductor predicts TTFT and TBT, from the roofline prior against from the engines' own measured
models: the conversation trace replayed live (`kvcentric bench replay`) against `kvcentric up --prefill 1
--decode 1 --model small`, once with `--cost-source prior` (the roofline of --model on --hardware, as before
the engines measured themselves) and once with the default `--cost-source measured`; `--rejection never`
in both, so that both place the same requests (with the measured models this CPU's TBT exceeds the 0.1 s SLO).

The figure is the mean absolute relative error |predicted - measured| / measured of TTFT over the completed
requests after the first --skip (the goal: at most 25% with the measured models), from the replay's
per-request rows (the prediction comes back in the x-kvcentric-predicted-ttft-s header); the conductor's own
TTFT and TBT error gauges and its /health view of each instance are kept beside it.

Usage:
    .venv/bin/python -m bench.serving.bench_prediction [--model small] [--limit 110] [--speed 0.12] [--scale 64]
        [--skip 50] [--out bench/results/prediction.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

from bench.harness import UpProcess
from bench import harness

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT.parent / "shared" / "traces" / "conversation_trace.jsonl"
SOURCES = {"prior (roofline)": "prior", "measured": "measured"}
GAUGES = ("ttft_prediction_rel_error_mean", "tbt_prediction_rel_error_mean", "ttft_outcomes_total",
          "tbt_outcomes_total", "placements_unjudged_total", "rejections_prefill_total", "rejections_decode_total")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--trace", default=str(TRACE if TRACE.exists() else Path("/work/shared/traces") / TRACE.name))
    parser.add_argument("--limit", default="110")
    parser.add_argument("--speed", default="0.12")
    parser.add_argument("--scale", default="64")
    parser.add_argument("--skip", type=int, default=50, help="requests left out of the figure (the fit's warm-up)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "prediction.json"))
    return parser.parse_args()


def conductor_gauges(up: UpProcess) -> dict[str, float]:
    url = up.manifest["services"]["conductor-0"]["health_url"].replace("/health", "/metrics")
    with urllib.request.urlopen(url, timeout=5) as response:
        lines = response.read().decode().splitlines()
    values = {line.split("{")[0].split()[0].removeprefix("kvc_"): float(line.split()[-1]) for line in lines
              if line and not line.startswith("#")}
    return {name: values[name] for name in GAUGES if name in values}


def replay(args: argparse.Namespace, source: str, out: Path) -> dict:
    """One replay against a fresh cluster whose conductor predicts from `source`."""
    with tempfile.TemporaryDirectory(prefix="kvc-up-") as log_dir:
        up = UpProcess(log_dir, "--model", args.model, "--prefill", "1", "--decode", "1", "--conductors", "1",
                       timeout_s=300, env={"KVC_COST_SOURCE": source, "KVC_REJECTION": "never"})
        try:
            subprocess.run([sys.executable, "-m", "kvcentric", "bench", "replay", args.trace, "--url", up.url,
                            "--limit", args.limit, "--speed", args.speed, "--scale", args.scale, "--output-scale",
                            args.scale, "--label", source, "--out", str(out), "--no-plots"], check=True)
            return {"gauges": conductor_gauges(up), "instances": up.health("conductor-0")["instances"]}
        finally:
            up.stop()


def errors(rows: list[dict], skip: int) -> dict:
    """Relative TTFT prediction errors of the completed requests, after the first `skip` requests sent."""
    def relative(part: list[dict]) -> list[float]:
        return [abs(r["predicted_ttft_s"] - r["ttft_s"]) / r["ttft_s"] for r in part
                if r["status"] == "completed" and r.get("ttft_s", 0) > 0]

    after, first = relative(rows[skip:]), relative(rows[:skip])
    return {"ttft_mare_after_skip": round(statistics.fmean(after), 4) if after else None,
            "ttft_median_rel_error_after_skip": round(statistics.median(after), 4) if after else None,
            "ttft_mare_first": round(statistics.fmean(first), 4) if first else None,
            "requests_scored": len(after), "requests": len(rows),
            "completed": sum(r["status"] == "completed" for r in rows),
            "ttft_mean_s": round(statistics.fmean(r["ttft_s"] for r in rows if "ttft_s" in r), 4),
            "predicted_ttft_mean_s": round(statistics.fmean(r["predicted_ttft_s"] for r in rows), 4)}


def main() -> None:
    args = parse_args()
    runs_dir = Path(tempfile.mkdtemp(prefix="kvc-prediction-"))
    results = {}
    for label, source in SOURCES.items():
        print(f"== {label}", flush=True)
        extra = replay(args, source, runs_dir / source)
        rows = [json.loads(line) for line in open(runs_dir / source / "requests.jsonl")]
        results[label] = {**errors(rows, args.skip), **extra}
    measured = results["measured"]["ttft_mare_after_skip"]
    report = {"what": "conductor's TTFT prediction error, live replay of the conversation trace, 1P+1D",
              "config": {k: v for k, v in vars(args).items()}, "goal_ttft_mare": 0.25,
              "goal_met": measured is not None and measured <= 0.25, "runs": results}
    harness.write(args.out, harness.record("bench_prediction", **report), indent=2)
    for label, run in results.items():
        print(f"{label}: TTFT mean abs relative error after {args.skip} requests {run['ttft_mare_after_skip']} "
              f"(median {run['ttft_median_rel_error_after_skip']}), {run['completed']}/{run['requests']} completed")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
