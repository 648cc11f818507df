"""One server alone on the box, measured by the client of `bench_vs_vllm.py`: for A/B runs of one engine setting
(the environment's KVC_* settings reach `kvcentric up`'s children) or of vLLM by itself, without a second server
idling beside it.

Tests: the median time between tokens of 32 streams of 96 tokens from 16-token prompts (`--streams` at once;
the tokens after each stream's first event, as `logprobs: 0` counts them),
then output tokens/s of 32 requests (256-token prompts, 32 tokens each) sent at once and of 32 at concurrency 8,
each `--repeat` times on fresh random prompts, and the at-once test's 99th percentile time between two token
events of a stream (`bench_vs_vllm.gap_percentile`). Appends one JSON line per run to `--out`.

Usage (2026-11-26 A/B of the CPU attention kernels, docs/performance.md):

    KVC_CPU_KERNELS=0 .venv/bin/python -m bench.serving.bench_alone "colocated mixed" --label sdpa
    KVC_CPU_KERNELS=1 .venv/bin/python -m bench.serving.bench_alone "colocated mixed" --label kernels
    .venv/bin/python -m bench.serving.bench_alone vLLM
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.serving import bench_vs_vllm as vs
from bench import harness

RESULTS = harness.RESULTS


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("deployment", choices=["vLLM", *vs.DEPLOYMENTS])
    parser.add_argument("--peer-venv", default=os.environ.get("VLLM_VENV", "/work/vllm-venv"),
                        help="venv made by bench/serving/vllm_peer/setup.sh (as bench_vs_vllm.py)")
    parser.add_argument("--checkpoint", default=os.path.join(tempfile.gettempdir(), "kvc-vllm-small"),
                        help="the random checkpoint bench_vs_vllm.py builds and keeps")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--label", default="")
    parser.add_argument("--out", default=str(RESULTS / "alone.jsonl"))
    return parser.parse_args()


def stream_many(url: str, model: str, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    """Every prompt streamed at once, counting the tokens each event carries (`bench_vs_vllm.time_between_tokens`)."""
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        start = time.perf_counter()
        return list(pool.map(lambda p: vs.stream_one(url, model, p, max_tokens, start, count_tokens=True), prompts))


def start(args, checkpoint: Path, log_dir: Path):
    if args.deployment != "vLLM":
        return vs.start_cluster(args.deployment, checkpoint, log_dir)
    python = vs.peer_python(args.peer_venv)
    if python is None:
        print(f"SKIPPED: no vLLM in {args.peer_venv} (bench/serving/vllm_peer/setup.sh makes one)")
        sys.exit(0)
    server = vs.PeerServer(python, checkpoint, 2, log_dir / "vllm.log")
    server.wait_ready()
    return server


def main() -> None:
    args = parse_args()
    checkpoint = vs.build_small_checkpoint(Path(args.checkpoint))  # kept between runs
    log_dir = Path(tempfile.mkdtemp(prefix="bench-alone-"))
    server = start(args, checkpoint, log_dir)
    try:
        model = vs.served_model(server.url)
        rng = random.Random(5)
        vs.run_batch(server.url, model, vs.random_prompts(rng, 8, 256), 32, 8)  # warm-up
        vs.settle()
        figures: dict[str, list[float]] = {"tbt_ms": [], "burst_tokens_per_s": [], "concurrent_tokens_per_s": [],
                                           "burst_tbt_p99_ms": []}
        for _ in range(args.repeat):
            streams = stream_many(server.url, model, vs.random_prompts(rng, args.streams, 16), 96)
            gaps = [(r["last"] - r["first"]) / (r["tokens"] - r["first_tokens"]) for r in vs.completed(streams)]
            figures["tbt_ms"].append(round(1000 * statistics.median(gaps), 2))
            for name, concurrency in (("burst_tokens_per_s", 32), ("concurrent_tokens_per_s", 8)):
                results = vs.run_batch(server.url, model, vs.random_prompts(rng, 32, 256), 32, concurrency)
                figures[name].append(round(vs.throughput(results)))
                if name == "burst_tokens_per_s":
                    figures["burst_tbt_p99_ms"].append(round(1000 * vs.gap_percentile(vs.completed(results), 0.99)))
        record = {"deployment": args.deployment, "label": args.label, "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                             time.gmtime()),
                  **figures, "failed": vs.FAILED}
        append_record(args.out, record)
    finally:
        server.stop()


def append_record(path: str, record: dict) -> None:
    """Print one run's record and append it to the JSON-lines file `path`."""
    print(json.dumps(record))
    harness.append_line(path, record)


if __name__ == "__main__":
    main()
