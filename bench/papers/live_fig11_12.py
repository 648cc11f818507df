"""Mooncake Figures 11 and 12 live on this machine at small scale: `kvcentric up --model small` as [3P+1D],
[2P+2D] and four colocated instances, each replaying the first requests of the FAST'25 synthetic trace
(prompts and blocks shrunk --scale times, outputs --output-scale times) at a few speeds, with the SLOs
relative to unloaded latency (TTFT_P90 = 10×, TBT_P90 = 5×, Mooncake §2, §8.1).

Each deployment first replays a few requests at the lowest speed (its unloaded reference); the other speeds
run with `--slo-reference` pointing at it. The table normalises every deployment by one shared reference (per
P90, the lowest of the three references), as `bench/papers/repro_fig11_12.py` does in the simulator. Every run uses
its own token seed, so no run reuses another's prefix cache. The conductor admits everything
(`KVC_REJECTION=never`), so the P90s say whether a rate is sustainable; a disaggregated request whose TTFT
passes 30 s still fails (see LIVE_ENV), and a run with failures does not count as within SLO. Short by
design: a few minutes per deployment.

Usage: .venv/bin/python -m bench.papers.live_fig11_12 [--limit 16] [--speeds 0.1,0.2,0.4] [--runs-dir DIR]
    -> DIR/<setup>/<speed> (each a replay's output), bench/results/fig11_12_live.{json,png}
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.harness import UpProcess
from bench.sim.common import RESULTS, pyplot, save_json
from kvcentric.core.sim.slo import normalised_p90s, relative_slos
from kvcentric.tools.sim import DEFAULT_TRACE

TRACE = DEFAULT_TRACE.replace("conversation_trace", "synthetic_trace")
TRACE_RPS = 3993 / 1022.025
SETUPS = {"Mooncake-[3P+1D]": ["--prefill", "3", "--decode", "1"],
          "Mooncake-[2P+2D]": ["--prefill", "2", "--decode", "2"],
          "vLLM-[4M]": ["--colocated", "4"]}
LIVE_ENV = {"KVC_REJECTION": "never", "KVC_KV_WAIT_S": "900"}
"""Admit everything. The longer KV wait does not take effect: a decode job carries `kv_wait_s` = 30 s (the
protocol's default, which the gateway leaves) and the engine only ever shortens it, so a disaggregated
request whose TTFT passes 30 s fails with 'KV did not arrive in time'; such runs are not counted as within
SLO."""
KEYS = ("requests", "completed", "failed", "rejected_429", "ttft_p50_s", "ttft_p90_s", "tbt_p50_s", "tbt_p90_s",
        "prefix_hit_ratio", "wall_s")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--limit", type=int, default=16, help="trace lines per loaded run")
    parser.add_argument("--reference-limit", type=int, default=8, help="trace lines of the unloaded run")
    parser.add_argument("--reference-speed", type=float, default=0.05)
    parser.add_argument("--speeds", default="0.1,0.2,0.4")
    parser.add_argument("--scale", default="64", help="prompt and block shrink factor (512-token blocks -> 8)")
    parser.add_argument("--output-scale", default="8")
    parser.add_argument("--runs-dir", default="")
    parser.add_argument("--name", default="fig11_12_live", help="bench/results/NAME.json and NAME.png")
    return parser.parse_args()


def replay(url: str, out: Path, speed: float, limit: int, seed: int, args, reference: Path | None) -> dict:
    command = [sys.executable, "-m", "kvcentric", "bench", "replay", TRACE, "--url", url, "--speed", str(speed),
               "--limit", str(limit), "--scale", args.scale, "--output-scale", args.output_scale, "--seed",
               str(seed), "--out", str(out), "--no-progress", "--timeout-s", "300"]
    if reference is not None:
        command += ["--slo-reference", str(reference)]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / "summary.json").read_text())


def run_setup(name: str, flags: list[str], runs: Path, args) -> dict[float, dict]:
    speeds = [float(s) for s in args.speeds.split(",")]
    results: dict[float, dict] = {}
    with tempfile.TemporaryDirectory(prefix="kvc-up-") as log_dir:
        up = UpProcess(log_dir, "--model", args.model, *flags, timeout_s=300, env=LIVE_ENV)
        try:
            reference = runs / name / "reference"
            results[args.reference_speed] = replay(up.url, reference, args.reference_speed, args.reference_limit,
                                                   1, args, None)
            for index, speed in enumerate(speeds):
                results[speed] = replay(up.url, runs / name / str(speed), speed, args.limit, 2 + index, args,
                                        reference)
                print(f"{name} {speed}x: {_brief(results[speed])}", flush=True)
        finally:
            up.stop()
    return results


def _brief(summary: dict) -> dict:
    return {k: round(summary[k], 4) if isinstance(summary[k], float) else summary[k] for k in KEYS}


def judge(results: dict[str, dict[float, dict]], reference_speed: float) -> tuple[dict, dict]:
    references = {name: by_speed[reference_speed] for name, by_speed in results.items()}
    shared = {k: min(r[k] for r in references.values()) for k in ("ttft_p90_s", "tbt_p90_s")}
    slos = relative_slos(shared)
    table = {}
    for name, by_speed in results.items():
        rows = [{"speed": speed, "rps": round(speed * TRACE_RPS, 3), "unloaded_reference": speed == reference_speed,
                 **_brief(summary), **normalised_p90s(summary, slos)} for speed, summary in by_speed.items()]
        loaded = [r for r in rows if not r["unloaded_reference"]]
        ok = [r["rps"] for r in loaded if r["p90_slos_met"] and not r["failed"]]
        table[name] = {"rows": rows, "max_rps_within_slo": max(ok, default=0.0),
                       "own_reference": _brief(references[name])}
    return slos.to_dict(), table


def plot(table: dict, name: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, result in table.items():
        rows = [r for r in result["rows"] if not r["unloaded_reference"]]
        for ax, key in zip(axes, ("ttft_p90_normalised", "tbt_p90_normalised")):
            ax.plot([r["rps"] for r in rows], [r[key] for r in rows], marker="o", markersize=3, label=name)
    for ax, what in zip(axes, ("P90 TTFT / SLO (10× unloaded)", "P90 TBT / SLO (5× unloaded)")):
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        ax.set_xlabel("request rate (req/s), synthetic trace, first requests")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Figures 11-12 live, small model on this 2-core VM (shared; short runs)", fontsize=9)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{name}.png", dpi=120)
    plt.close(fig)


def main() -> None:
    args = parse_args()
    runs = Path(args.runs_dir or tempfile.mkdtemp(prefix="kvc-fig11-12-"))
    results = {name: run_setup(name, flags, runs, args) for name, flags in SETUPS.items()}
    slos, table = judge(results, args.reference_speed)
    save_json(f"{args.name}.json", {"trace": "synthetic_trace.jsonl", "settings": vars(args), "slos": slos,
                                     "machine_load_note": "2-core VM shared with other work; see docs",
                                     "results": table})
    plot(table, args.name)
    for name, result in table.items():
        print(f"| {name} | {result['max_rps_within_slo']} |")


if __name__ == "__main__":
    main()
