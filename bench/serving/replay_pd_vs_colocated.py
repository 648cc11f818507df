"""Disaggregated vs colocated on this machine: the same Poisson workload replayed (`kvcentric bench replay`)
against `kvcentric up --prefill 1 --decode 1` and against `kvcentric up --colocated 2`, same model, same
SLOs; then `bench/serving/replay_compare.py` puts TTFT, TBT and goodput side by side.

Usage:
    .venv/bin/python -m bench.serving.replay_pd_vs_colocated [--model small] [--rps 0.3] [--num-requests 60]
        [--input-len 1024] [--output-len 128] [--ttft-slo-s 10] [--tbt-slo-s 0.1] [--runs-dir DIR]

Writes DIR/pd and DIR/colocated (each a replay's output) and bench/results/pd_vs_colocated.{json,png}.
"""

from __future__ import annotations


import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.harness import UpProcess
from bench import harness

RESULTS = harness.RESULTS
DEPLOYMENTS = {"1P+1D": ("pd", ["--prefill", "1", "--decode", "1"]), "2 colocated": ("colocated", ["--colocated", "2"])}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--rps", default="0.3")
    parser.add_argument("--num-requests", default="60")
    parser.add_argument("--input-len", default="1024", help="prompt tokens: one prefill is many decode steps")
    parser.add_argument("--output-len", default="128")
    parser.add_argument("--ttft-slo-s", default="10")
    parser.add_argument("--tbt-slo-s", default="0.1")
    parser.add_argument("--runs-dir", default="", help="where the two replays write (default: a temp dir)")
    parser.add_argument("--out", default=str(RESULTS / "pd_vs_colocated"))
    return parser.parse_args()


def replay(args, label: str, out: Path, flags: list[str]) -> None:
    with tempfile.TemporaryDirectory(prefix="kvc-up-") as log_dir:
        up = UpProcess(log_dir, "--model", args.model, *flags, timeout_s=300)
        try:
            subprocess.run([sys.executable, "-m", "kvcentric", "bench", "replay", "poisson", "--url", up.url,
                            "--rps", args.rps, "--num-requests", args.num_requests, "--input-len", args.input_len,
                            "--output-len", args.output_len, "--cache-ratio", "0", "--ttft-slo-s", args.ttft_slo_s,
                            "--tbt-slo-s", args.tbt_slo_s, "--label", label, "--out", str(out)], check=True)
        finally:
            up.stop()


def main() -> None:
    args = parse_args()
    runs = Path(args.runs_dir or tempfile.mkdtemp(prefix="kvc-pd-vs-colocated-"))
    for label, (name, flags) in DEPLOYMENTS.items():
        print(f"== {label}", flush=True)
        replay(args, label, runs / name, flags)
    subprocess.run([sys.executable, str(Path(__file__).with_name("replay_compare.py")),
                    *(str(runs / name) for name, _ in DEPLOYMENTS.values()), "--out", args.out], check=True)


if __name__ == "__main__":
    main()
