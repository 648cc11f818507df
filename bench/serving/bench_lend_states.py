"""Where the two cores of 1 prefill + 1 decode go during bursts (the cores lent between them,
`engine/service/coreshare.py`): both instances' slot files sampled every 0.5 ms while `--bursts` bursts of 32
prompts of 256 tokens (32 tokens each) are served, as `bench_alone.py` sends them. Each sample is a state: the
prefill's threads (P0: not in a model call), the decode's (D0 likewise), "paused" when the decode paused itself
for its pace, and the prefill's queue (w0, w1, w2: 2 or more prompts behind the one it computes). A state with
one thread computing and the other instance paused or idle is a core left unused. The 0.3 s between bursts count
as (P0, D0).

Appends one JSON line per run to `--out`:

    .venv/bin/python -m bench.serving.bench_lend_states --label looks3
"""

from __future__ import annotations

import argparse
import collections
import random
import tempfile
import threading
import time
from pathlib import Path

from bench.serving import bench_vs_vllm as vs
from bench.serving.bench_alone import append_record

from kvcentric.engine.service.coreshare import COMPUTING, RESUMES_NS, USING, WAITING, Slot
from bench import harness

RESULTS = harness.RESULTS


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default=str(Path(tempfile.gettempdir()) / "kvc-vllm-small"),
                        help="the random `small` checkpoint bench_vs_vllm.py builds and keeps")
    parser.add_argument("--bursts", type=int, default=4)
    parser.add_argument("--label", default="")
    parser.add_argument("--out", default=str(RESULTS / "lend_states.jsonl"))
    return parser.parse_args()


def state(prefill: tuple[int, ...], decode: tuple[int, ...], now_ns: int) -> str:
    paused = not decode[COMPUTING] and decode[RESUMES_NS] > now_ns
    parts = [f"P{prefill[USING] if prefill[COMPUTING] else 0}", f"D{decode[USING] if decode[COMPUTING] else 0}"]
    parts += ["paused"] if paused else []
    parts += [f"w{min(prefill[WAITING], 2)}"] if prefill[COMPUTING] else []
    return " ".join(parts)


def main() -> None:
    args = parse_args()
    checkpoint = vs.build_small_checkpoint(Path(args.checkpoint))
    cluster = vs.start_cluster("1P+1D", checkpoint, Path(tempfile.mkdtemp(prefix="bench-lend-")))
    try:
        model = vs.served_model(cluster.url)
        rng = random.Random(5)
        vs.run_batch(cluster.url, model, vs.random_prompts(rng, 8, 256), 32, 8)  # warm-up
        vs.settle()
        share = Path(cluster.manifest["core_share_dir"])
        prefill, decode = Slot(share / "prefill-0.cores"), Slot(share / "decode-0.cores")
        states: collections.Counter[str] = collections.Counter()
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                states[state(prefill.read(), decode.read(), time.monotonic_ns())] += 1
                time.sleep(0.0005)

        sampler = threading.Thread(target=sample)
        sampler.start()
        burst = []
        for _ in range(args.bursts):
            results = vs.run_batch(cluster.url, model, vs.random_prompts(rng, 32, 256), 32, 32)
            burst.append(round(vs.throughput(results)))
            time.sleep(0.3)
        done.set()
        sampler.join()
        total = sum(states.values())
        shares = {name: round(100 * count / total, 1) for name, count in states.most_common()}
        record = {"label": args.label, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  "burst_tokens_per_s": burst, "state_percent": shares, "failed": vs.FAILED}
        append_record(args.out, record)
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
