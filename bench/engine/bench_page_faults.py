"""What fresh pages cost a model step, with and without `keep_heap` (`libs/kvcentric/runtime/service.py`): the
colocated engine of the `small` shape in one process, on its model thread with 2 torch threads as a served
engine runs it, serves `--bursts` bursts of 32 prompts of 256 tokens (32 tokens out each, mixed steps of 2048
tokens), in a process of its own for each setting (glibc's settings are process-wide), `--rounds` times
alternated. Each burst counts the process's minor page faults (a kernel entry and a zeroed 4 KiB page each).

Writes `bench/results/page_faults.json`: per setting, each burst's seconds and faults; the ratio of the mean
burst times in the summary.

    .venv/bin/python -m bench.engine.bench_page_faults --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

from bench import harness

RESULTS = harness.RESULTS
SETTINGS = {"glibc as is (KVC_MALLOC_KEEP=0)": "0", "heap kept (default)": "1"}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bursts", type=int, default=5, help="measured bursts per process, after one warm-up")
    parser.add_argument("--out", default=str(RESULTS / "page_faults.json"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args()


def child(bursts: int) -> None:
    """One process: keep_heap as the environment says (as run_service does), then the bursts; JSON on stdout."""
    import random
    import resource

    from kvcentric.core.block_pool import BlockPool
    from kvcentric.core.hashing import BlockHasher
    from kvcentric.core.protocol import DecodeJob, PrefillJob, SamplingParams
    from kvcentric.engine.cores.colocated import ColocatedEngine
    from kvcentric.engine.config import EngineConfig
    from kvcentric.engine.cores.mixed import MixedStepper
    from kvcentric.engine.service.node import ModelThread
    from kvcentric.engine.model.runner import ModelRunner
    from kvcentric.model.config import preset
    from kvcentric.runtime.service import keep_heap

    kept = keep_heap()
    config = EngineConfig()

    def serve() -> list[dict]:
        runner = ModelRunner(preset("small"), config.num_kv_blocks, config.block_size, config.seed)
        params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
        out = []
        for burst in range(bursts + 1):  # the first warms up
            engine = ColocatedEngine(runner, BlockPool(config.num_kv_blocks, config.block_size),
                                     BlockHasher(config.hash_algo, config.block_size), config.prefill_chunk,
                                     config.max_batch)
            stepper = MixedStepper(engine, config.step_tokens)
            rng = random.Random(burst)
            for index in range(32):
                prompt = [1] + [rng.randrange(3, 250) for _ in range(255)]
                engine.submit(PrefillJob(request_id=f"r{index}", token_ids=prompt, sampling=params, decode_id="",
                                         decode_kv_addr=""),
                              DecodeJob(request_id=f"r{index}", n_prompt_tokens=len(prompt), sampling=params))
            faults, start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
            while engine.has_work:
                stepper.step()
            seconds = time.perf_counter() - start
            if burst:
                out.append({"seconds": round(seconds, 4),
                            "minor_page_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults})
        return out

    print(json.dumps({"kept": kept, "bursts": ModelThread("colocated", 2).call(serve)}))


def main() -> None:
    args = parse_args()
    if args.child:
        return child(args.bursts)
    runs: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    for round_index in range(args.rounds):
        for name, keep in SETTINGS.items():
            env = {**os.environ, "KVC_MALLOC_KEEP": keep}
            argv = [sys.executable, "-m", __spec__.name, "--child", "--bursts", str(args.bursts)]
            done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600, check=True)
            run = json.loads(done.stdout.strip().splitlines()[-1])
            runs[name] += run["bursts"]
            seconds = [b["seconds"] for b in run["bursts"]]
            faults = [b["minor_page_faults"] for b in run["bursts"]]
            print(f"round {round_index + 1}, {name}: burst {statistics.mean(seconds):.3f} s, "
                  f"{statistics.mean(faults):,.0f} faults a burst", file=sys.stderr, flush=True)
    summary = {name: {"burst_s_mean": statistics.mean(b["seconds"] for b in bursts),
                      "minor_page_faults_mean": statistics.mean(b["minor_page_faults"] for b in bursts)}
               for name, bursts in runs.items()}
    plain, kept = (summary[name]["burst_s_mean"] for name in SETTINGS)
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": "small", "threads": 2,
              "burst": "32 prompts x 256 tokens, 32 out, mixed steps of 2048 tokens, on the model thread",
              "machine": {**harness.machine(), "libc": " ".join(platform.libc_ver())},
              "runs": runs, "summary": summary, "ratio": harness.ratio(kept, plain)}
    harness.write(args.out, result)
    for name, row in summary.items():
        print(f"{name:34s} burst {row['burst_s_mean']:.3f} s  {row['minor_page_faults_mean']:>9,.0f} faults",
              file=sys.stderr)
    print(f"kept / as is: {kept / plain:.3f} of the burst time; wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
