"""What Python's full garbage collections cost a served cluster, with and without `freeze_heap`
(`libs/kvcentric/runtime/service.py`): `kvcentric up --colocated 1` of the `small` checkpoint serves
`--bursts` bursts of 32 prompts of 256 tokens (32 tokens each, at once, streamed by the client of
`bench_vs_vllm.py`), once with KVC_GC_FREEZE=0 and once as shipped, `--rounds` times alternated. Each
service's full collections are timed through `bench/serving/gc_trace/sitecustomize.py`.

Writes `bench/results/gc_pauses.json`: per setting, the burst throughputs and every full collection during the
bursts (service, ms).

    .venv/bin/python -m bench.serving.bench_gc_pauses --rounds 2
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from pathlib import Path

from bench.serving import bench_vs_vllm as vs
from bench import harness

HERE = Path(__file__).resolve().parent
RESULTS = harness.RESULTS
SETTINGS = {"collector as is (KVC_GC_FREEZE=0)": "0", "heap frozen at start (default)": "1"}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default=str(Path(tempfile.gettempdir()) / "kvc-vllm-small"),
                        help="the random `small` checkpoint bench_vs_vllm.py builds and keeps")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--bursts", type=int, default=6)
    parser.add_argument("--out", default=str(RESULTS / "gc_pauses.json"))
    return parser.parse_args()


def one_run(freeze: str, checkpoint: Path, bursts: int, rng: random.Random) -> dict:
    """One cluster: warm it up, serve the bursts, and return their throughputs and the full collections
    that ended while they were served."""
    log_dir = Path(tempfile.mkdtemp(prefix="bench-gc-"))
    trace = log_dir / "gc.txt"
    os.environ.update(KVC_GC_FREEZE=freeze, KVC_GC_TRACE=str(trace),
                      PYTHONPATH=os.pathsep.join(filter(None, [str(HERE / "gc_trace"), os.environ.get("PYTHONPATH")])))
    server = vs.start_cluster("colocated mixed", checkpoint, log_dir)
    try:
        model = vs.served_model(server.url)
        vs.run_batch(server.url, model, vs.random_prompts(rng, 8, 256), 32, 8)  # warm-up
        vs.settle()
        began, tokens_per_s = time.time(), []
        for _ in range(bursts):
            results = vs.run_batch(server.url, model, vs.random_prompts(rng, 32, 256), 32, 32)
            tokens_per_s.append(round(vs.throughput(results)))
        ended = time.time()
    finally:
        server.stop()
    pauses = []
    for line in trace.read_text().splitlines() if trace.exists() else []:
        at, ms, service = line.split()
        if began <= float(at) <= ended:
            pauses.append({"service": service, "ms": float(ms)})
    return {"burst_tokens_per_s": tokens_per_s, "seconds": round(ended - began, 1), "full_collections": pauses}


def main() -> None:
    args = parse_args()
    checkpoint = vs.build_small_checkpoint(Path(args.checkpoint))
    rng = random.Random(11)
    runs: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    for round_ in range(args.rounds):
        for name, freeze in SETTINGS.items():
            run = one_run(freeze, checkpoint, args.bursts, rng)
            runs[name].append(run)
            longest = max((p["ms"] for p in run["full_collections"]), default=0.0)
            print(f"round {round_ + 1}, {name}: {run['burst_tokens_per_s']} tokens/s, "
                  f"{len(run['full_collections'])} full collections in {run['seconds']} s, longest {longest:.0f} ms",
                  flush=True)
    record = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "deployment": "colocated mixed",
              "bursts": args.bursts, "runs": runs}
    harness.write(args.out, harness.record("bench_gc_pauses", **record))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
