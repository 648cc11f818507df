"""What serving adds to a prompt's prefill: the `small` checkpoint of `bench_vs_vllm.py`, 256-token prompts, one
per pass, in one process (`ModelRunner.prefill` on 1 and on 2 torch threads) against the prefill instance of a
served 1P+1D cluster (`kvcentric up --prefill 1 --decode 1`).

Served, each burst sends 32 prompts at once. With `max_tokens` 1 the decode instance computes nothing, so the
prefill instance has the box to itself; that is measured in four settings (the default, no host pool, no
lending with 2 torch threads of its own, and both), then the default with 32 tokens out, where the decode
instance's steps and the streams share the two cores. Per prompt: wall time (a burst's last first token / 32:
its prefill phase) and the CPU of the prefill process's threads (`/proc/<pid>/task/*/stat`, the model thread and
its OpenMP worker apart from the rest).

Every served setting computes on one model thread (`KVC_PREFILL_LANES=1`): this measures what serving adds to a
prompt computed by a team, as before prefill lanes; the lanes are measured by `bench_alone.py "1P+1D"`
(`alone_lanes.jsonl`).

Writes `bench/results/prefill_served.json`:

    .venv/bin/python -m bench.serving.bench_prefill_served
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.serving import bench_vs_vllm as vs
from bench import harness

RESULTS = harness.RESULTS
PROMPTS, PROMPT_LEN = 32, 256
SETTINGS: dict[str, tuple[list[str], dict[str, str], int]] = {
    "default": ([], {}, 1),
    "no host pool": ([], {"KVC_HOST_POOL_MB": "0"}, 1),
    "no lending, 2 threads": (["--no-lend-cores", "--torch-threads", "2"], {}, 1),
    "no host pool, no lending, 2 threads": (["--no-lend-cores", "--torch-threads", "2"], {"KVC_HOST_POOL_MB": "0"}, 1),
    "default, 32 tokens out": ([], {}, 32),
}
"""Extra `kvcentric up` flags, environment and max_tokens of each served setting."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default=str(Path(tempfile.gettempdir()) / "kvc-vllm-small"),
                        help="the random `small` checkpoint bench_vs_vllm.py builds and keeps")
    parser.add_argument("--bursts", type=int, default=4, help="measured bursts per cluster, after one warm-up")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, each bringing up every setting once in turn")
    parser.add_argument("--only", nargs="*", choices=list(SETTINGS), help="served settings to run (default: all)")
    parser.add_argument("--out", default=str(RESULTS / "prefill_served.json"))
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    return parser.parse_args()


def in_process(checkpoint: str, threads: int) -> None:
    """One process: 32 prompts, one per pass, three times on `threads` torch threads; JSON on stdout."""
    import torch

    from kvcentric.engine.model.runner import ModelRunner
    from kvcentric.model.config import load_model_config
    from kvcentric.runtime.service import keep_heap

    keep_heap()  # as a served engine has it
    torch.set_num_threads(threads)
    runner = ModelRunner(load_model_config(checkpoint), 1024, 16)
    rng, walls, cpus = random.Random(0), [], []
    for _ in range(3):
        prompts = vs.random_prompts(rng, PROMPTS, PROMPT_LEN)
        wall, cpu = time.perf_counter(), time.process_time()
        for index, prompt in enumerate(prompts):
            first = index * PROMPT_LEN // 16
            runner.prefill(prompt, list(range(first, first + PROMPT_LEN // 16)), 0)
        walls.append(1000 * (time.perf_counter() - wall) / PROMPTS)
        cpus.append(1000 * (time.process_time() - cpu) / PROMPTS)
    print(json.dumps({"ms_per_prompt": round(statistics.median(walls[1:]), 1),
                      "cpu_ms_per_prompt": round(statistics.median(cpus[1:]), 1)}))


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of each thread of a process, by name:tid."""
    ticks, out = os.sysconf("SC_CLK_TCK"), {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as stat:
                text = stat.read()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2:].split()
        out[f"{text[text.index('(') + 1:text.rindex(')')]}:{tid}"] = (int(fields[11]) + int(fields[12])) / ticks
    return out


def served(checkpoint: Path, name: str, bursts: int, log_dir: Path) -> dict:
    from bench.harness import UpProcess

    flags, env, max_tokens = SETTINGS[name]
    print(f"starting 1P+1D, {name}", file=sys.stderr, flush=True)
    up = UpProcess(str(log_dir / name.replace(" ", "_").replace(",", "")), "--model", str(checkpoint),
                   "--prefill", "1", "--decode", "1", *flags, timeout_s=600,
                   env={"KVC_DTYPE": "float32", "KVC_PREFILL_LANES": "1", **env})
    try:
        model = vs.served_model(up.url)
        rng = random.Random(3)
        vs.run_batch(up.url, model, vs.random_prompts(rng, PROMPTS, PROMPT_LEN), max_tokens, PROMPTS)
        vs.settle()
        pid = up.reload()["services"]["prefill-0"]["pid"]
        walls = []
        before = thread_cpu_s(pid)
        for _ in range(bursts):
            results = vs.run_batch(up.url, model, vs.random_prompts(rng, PROMPTS, PROMPT_LEN), max_tokens, PROMPTS)
            if len(vs.completed(results)) != PROMPTS:
                raise RuntimeError(f"{name}: {PROMPTS - len(vs.completed(results))} requests failed")
            walls.append(max(r["first"] for r in results) - results[0]["start"])  # the last first token
        after = thread_cpu_s(pid)
    finally:
        up.stop()
    used = sorted(((after[t] - before.get(t, 0.0), t) for t in after), reverse=True)
    prompts = PROMPTS * bursts
    model_threads = sum(seconds for seconds, _ in used[:2])  # the model thread and its OpenMP worker: the busiest
    return {"max_tokens": max_tokens, "ms_per_prompt": round(1000 * statistics.median(walls) / PROMPTS, 1),
            "model_threads_cpu_ms_per_prompt": round(1000 * model_threads / prompts, 1),
            "other_threads_cpu_ms_per_prompt": round(1000 * sum(s for s, _ in used[2:]) / prompts, 1),
            "burst_s": [round(w, 3) for w in walls]}


def main() -> None:
    args = parse_args()
    if args.child:
        in_process(args.checkpoint, args.child)
        return
    checkpoint = vs.build_small_checkpoint(Path(args.checkpoint))
    log_dir = Path(tempfile.mkdtemp(prefix="bench-prefill-served-"))
    figures: dict = {"in one process": {}}
    for threads in (1, 2):
        argv = [sys.executable, "-m", __spec__.name, "--checkpoint", str(checkpoint), "--child", str(threads)]
        out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
        figures["in one process"][f"{threads} threads"] = json.loads(out.strip().splitlines()[-1])
        print(f"in one process, {threads} threads", figures["in one process"][f"{threads} threads"], flush=True)
    figures["served"] = {name: [] for name in args.only or SETTINGS}
    for round_index in range(args.rounds):  # settings alternated: this VM drifts by more than some differences
        for name in figures["served"]:
            figures["served"][name].append(served(checkpoint, name, args.bursts, log_dir / f"round{round_index + 1}"))
            print(f"round {round_index + 1}", name, figures["served"][name][-1], flush=True)
    two = figures["in one process"]["2 threads"]["ms_per_prompt"]
    summary = {name: {"ms_per_prompt": [row["ms_per_prompt"] for row in rows],
                      "model_threads_cpu_ms_per_prompt": [row["model_threads_cpu_ms_per_prompt"] for row in rows],
                      "over_in_process_2_threads": round(statistics.median(row["ms_per_prompt"] for row in rows) / two,
                                                         2)}
               for name, rows in figures["served"].items()}
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": harness.machine(),
              "prompt_len": PROMPT_LEN, "prompts_per_burst": PROMPTS, "figures": figures, "summary": summary}
    harness.write(args.out, result)
    print(json.dumps(summary, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
