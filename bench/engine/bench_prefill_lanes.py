"""Two cores for prefill, spent two ways, in one process: one model thread with a 2-thread OpenMP team computing
one prompt at a time (what a prefill instance does with a lent core now), against two model threads of one
OpenMP thread each, each computing its own prompts ("lanes"). 32 prompts of 256 tokens of `small`, one per pass.

Each is timed alone and beside a noise process that burns `--duties` of a core in 2 ms slices (the shape of the
serving path's work: the decode's steps, the event loops, the gateway and NATS, which take a core from the team
for a while). A team stalls at every op whose second thread lost its core, and its first thread spins
meanwhile; a lane that loses its core slows only its own prompt. The price of lanes is a lone prompt's latency:
it computes on one thread (57 ms here against 31 on a team).

Writes `bench/results/prefill_lanes.json`:

    .venv/bin/python -m bench.engine.bench_prefill_lanes
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import statistics
import threading
import time
from bench import harness

RESULTS = harness.RESULTS
PROMPTS, PROMPT_LEN, BLOCK = 32, 256, 16
SLICE_S = 0.002


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duties", type=float, nargs="+", default=[0.0, 0.2, 0.4],
                        help="share of one core the noise process burns (0: none)")
    parser.add_argument("--rounds", type=int, default=3, help="team and lanes alternated, per duty")
    parser.add_argument("--out", default=str(RESULTS / "prefill_lanes.json"))
    return parser.parse_args()


def burn(duty: float, stop) -> None:
    """Busy for duty / (1 - duty) of each SLICE_S of sleep, until `stop`."""
    busy_s = SLICE_S * duty / (1 - duty)
    while not stop.is_set():
        start = time.perf_counter()
        while time.perf_counter() - start < busy_s:
            pass
        time.sleep(SLICE_S)


def main() -> None:
    args = parse_args()
    import torch

    from kvcentric.engine.model.runner import ModelRunner
    from kvcentric.model.config import preset
    from kvcentric.runtime.service import keep_heap

    keep_heap()  # as a served engine has it
    runner = ModelRunner(preset("small"), PROMPTS * PROMPT_LEN // BLOCK, BLOCK)
    rng = random.Random(0)
    prompts = [[1] + [rng.randrange(3, 250) for _ in range(PROMPT_LEN - 1)] for _ in range(PROMPTS)]
    blocks = PROMPT_LEN // BLOCK

    def compute(indices, threads: int) -> None:
        torch.set_num_threads(threads)  # this thread's OpenMP team
        for index in indices:
            runner.prefill(prompts[index], list(range(index * blocks, (index + 1) * blocks)), 0)

    def team() -> float:
        thread = threading.Thread(target=compute, args=(range(PROMPTS), 2))
        start = time.perf_counter()
        thread.start()
        thread.join()
        return 1000 * (time.perf_counter() - start) / PROMPTS

    def lanes() -> float:
        threads = [threading.Thread(target=compute, args=(range(lane, PROMPTS, 2), 1)) for lane in range(2)]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return 1000 * (time.perf_counter() - start) / PROMPTS

    team()  # warm-up: oneDNN's kernels and the heap
    lanes()
    figures = {}
    for duty in args.duties:
        stop = multiprocessing.Event()
        noise = multiprocessing.Process(target=burn, args=(duty, stop)) if duty > 0 else None
        if noise is not None:
            noise.start()
        runs: dict[str, list[float]] = {"team": [], "lanes": []}
        try:
            for _ in range(args.rounds):
                runs["team"].append(round(team(), 1))
                runs["lanes"].append(round(lanes(), 1))
        finally:
            stop.set()
            if noise is not None:
                noise.join()
        ratio = statistics.median(runs["lanes"]) / statistics.median(runs["team"])
        figures[f"{duty:g}"] = {"team_ms_per_prompt": runs["team"], "lanes_ms_per_prompt": runs["lanes"],
                                "lanes_over_team": round(ratio, 2)}
        print(f"noise {duty:g} of a core: team {runs['team']} ms a prompt, lanes {runs['lanes']}, "
              f"lanes / team {ratio:.2f}", flush=True)
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "prompt_len": PROMPT_LEN, "prompts": PROMPTS,
              "by_noise_duty": figures}
    harness.write(args.out, harness.record("bench_prefill_lanes", **result))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
