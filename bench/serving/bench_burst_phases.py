"""Where a burst's time goes, ours against vLLM's, each server alone on the box and warmed with two bursts:
32 prompts of 256 tokens (32 tokens out each) sent at once by the client of `bench_vs_vllm.py`, `--bursts`
times. For each burst: output tokens/s, the first and the last first token (the prefill phase), and the end
(so the decode tail: the end less the last first token).

Writes `bench/results/burst_phases.json`:

    .venv/bin/python -m bench.serving.bench_burst_phases
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from bench.serving import bench_vs_vllm as vs
from bench import harness

RESULTS = harness.RESULTS


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peer-venv", default=os.environ.get("VLLM_VENV", "/work/vllm-venv"),
                        help="venv made by bench/serving/vllm_peer/setup.sh (as bench_vs_vllm.py)")
    parser.add_argument("--checkpoint", default=str(Path(tempfile.gettempdir()) / "kvc-vllm-small"),
                        help="the random `small` checkpoint bench_vs_vllm.py builds and keeps")
    parser.add_argument("--deployment", default="colocated mixed", choices=list(vs.DEPLOYMENTS))
    parser.add_argument("--bursts", type=int, default=4)
    parser.add_argument("--out", default=str(RESULTS / "burst_phases.json"))
    return parser.parse_args()


def burst(url: str, model: str, rng: random.Random) -> dict:
    results = vs.run_batch(url, model, vs.random_prompts(rng, 32, 256), 32, 32)
    start = results[0]["start"]
    firsts = sorted(r["first"] - start for r in results)
    end = max(r["last"] for r in results) - start
    return {"tokens_per_s": round(vs.throughput(results)), "first_token_ms": round(1000 * firsts[0]),
            "last_first_token_ms": round(1000 * firsts[-1]), "end_ms": round(1000 * end),
            "decode_tail_ms": round(1000 * (end - firsts[-1]))}


def main() -> None:
    args = parse_args()
    checkpoint = vs.build_small_checkpoint(Path(args.checkpoint))
    log_dir = Path(tempfile.mkdtemp(prefix="bench-phases-"))
    rng = random.Random(4)
    figures: dict[str, list[dict]] = {}
    for name in ("vLLM", args.deployment):
        if name == "vLLM":
            python = vs.peer_python(args.peer_venv)
            if python is None:
                print(f"SKIPPED vLLM: no vLLM in {args.peer_venv} (bench/serving/vllm_peer/setup.sh makes one)")
                continue
            server = vs.PeerServer(python, checkpoint, 2, log_dir / "vllm.log")
            server.wait_ready()
        else:
            server = vs.start_cluster(name, checkpoint, log_dir)
        try:
            model = vs.served_model(server.url)
            for _ in range(2):  # warm-up: the measured shapes
                vs.run_batch(server.url, model, vs.random_prompts(rng, 32, 256), 32, 32)
            vs.settle()
            figures[name] = [burst(server.url, model, rng) for _ in range(args.bursts)]
        finally:
            server.stop()
        for row in figures[name]:
            print(name, json.dumps(row), flush=True)
    summary = {name: {key: statistics.median(row[key] for row in rows) for key in rows[0]}
               for name, rows in figures.items()}
    record = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "bursts": figures, "medians": summary}
    harness.write(args.out, harness.record("bench_burst_phases", **record))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
