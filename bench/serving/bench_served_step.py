"""The served time between tokens at batch 1 against the engine's own decode step (issue 42, item 5): what a client
waits per token beyond the model's step is the serving path's cost (the token's way out: outbox, NATS, gateway,
SSE; the step loop's wake-ups), which this measures on each model shape and deployment.

For each shape (`small`, `medium`: the same random checkpoints as `bench_vs_vllm.py`) and deployment (colocated, the
mixed steps of `bench_vs_vllm.py`; 1P+1D), a `kvcentric up` cluster serves --requests sequential streamed greedy
requests (fresh random prompts of --input-len tokens, --output-len tokens each, one at a time: batch 1). Beside the
served time between tokens (mean gap after the first token, per request; the median over requests) it records the
decode instance's own timing of its steps, as it reports it to the conductor (`/health` of the conductor: its
latest batch-1 step and its fitted model's prediction for that shape), and the bare model step in this process
(`ModelRunner.decode` of one sequence at the same context, with the engine's thread count), and the CPU time a token
costs each process of the cluster (the gateway, NATS, the conductor..., and this client), which on a machine whose
cores the model's threads take is time taken from them.

Usage:
    .venv/bin/python -m bench.serving.bench_served_step [--shapes small medium] [--deployments colocated 1P+1D]
        [--requests 8] [--input-len 256] [--output-len 64] [--isa native|avx2]

--isa avx2 caps our kernels, torch and oneDNN to AVX2 (`bench_vs_vllm.ISA_ENV`), in the servers and in this process's
bare step (the bench starts itself again with that environment). Writes bench/results/served_step.json and prints a
markdown table.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch
from bench import harness

from bench.serving.bench_vs_vllm import (DEPLOYMENTS, ISA_ENV, settle, stream_one,
                           time_between_tokens)
from bench.serving.bench_vs_vllm import build_checkpoint
from bench.harness import UpProcess

from kvcentric.core.block_pool import BlockPool
from kvcentric.engine.model.runner import ModelRunner
from kvcentric.model.config import load_model_config


RESULTS = harness.RESULTS
SERVED = {"colocated": "colocated mixed", "1P+1D": "1P+1D", "1P+1D own cores": "1P+1D own cores"}
"""This bench's deployment names -> `bench_vs_vllm.DEPLOYMENTS`' (the same flags and engine settings)."""
DECODER = {"colocated": "colocated-0", "1P+1D": "decode-0", "1P+1D own cores": "decode-0"}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["small", "medium"], choices=["small", "medium"])
    parser.add_argument("--deployments", nargs="+", default=["colocated", "1P+1D"], choices=list(SERVED),
                        help="'1P+1D own cores': the engines lend each other no cores (--no-lend-cores)")
    parser.add_argument("--requests", type=int, default=8, help="sequential requests measured per deployment")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--checkpoint", default=str(Path(tempfile.gettempdir()) / "kvc-vllm-{shape}"),
                        help="where each shape's random checkpoint is built (kept between runs; bench_vs_vllm's)")
    parser.add_argument("--isa", default="native", choices=list(ISA_ENV),
                        help="avx2: our kernels, torch and oneDNN capped to AVX2, here and in the servers")
    parser.add_argument("--out", default=str(RESULTS / "served_step.json"))
    return parser.parse_args()


def bare_step_s(checkpoint: Path, context: int, threads: int, repeats: int = 40) -> float:
    """The median seconds of one sequence's decode step at `context` tokens in this process, on `threads`."""
    torch.set_num_threads(threads)
    config = load_model_config(str(checkpoint))
    runner = ModelRunner(config, -(-(context + 8) // 16) + 1, 16, 0, "float32")
    pool = BlockPool(runner.num_blocks, runner.block_size)
    table = pool.allocate(pool.blocks_for(context + 1))
    runner.prefill([1 + i % 250 for i in range(context)], table, 0)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        runner.decode([1], [context], [table])
        times.append(time.perf_counter() - start)
    return statistics.median(times[5:])


def engine_step(up: UpProcess, instance: str) -> dict:
    """The decode instance's latest timed step and its model's prediction for that shape, as the conductor has them."""
    view = up.health("conductor-0")["instances"].get(instance, {})
    return view.get("decode_step", {})


def cpu_seconds(up: UpProcess) -> dict[str, float]:
    """CPU seconds (user and system) each kind of process of the cluster has used so far, and this one's (the
    client's): what serves a token beside the model's own threads, which on a machine whose cores the model's threads
    take competes with them (item 5: docs/performance.md, "The whole step at batch 1")."""
    root = psutil.Process(up.process.pid)
    spent = {"client (this bench)": sum(psutil.Process().cpu_times()[:2])}
    for process in [root, *root.children(recursive=True)]:
        try:
            args, times = process.cmdline(), process.cpu_times()
        except psutil.Error:  # ended meanwhile
            continue
        kind = process_kind(args)
        spent[kind] = spent.get(kind, 0.0) + times.user + times.system
    return spent


def process_kind(args: list[str]) -> str:
    """What a cluster process runs: `nats-server`, `redis-server`, or the kvcentric command (`gateway`, `decode`..,
    `up`)."""
    words = " ".join(args).split()
    for server in ("nats-server", "redis-server"):
        if words and server in words[0]:
            return server
    if "kvcentric" in words and words.index("kvcentric") + 1 < len(words):
        return words[words.index("kvcentric") + 1]
    return Path(words[0]).name if words else "?"


def served(checkpoint: Path, deployment: str, args, rng: random.Random, log_dir: Path) -> dict:
    flags, env = DEPLOYMENTS[SERVED[deployment]]
    up = UpProcess(str(log_dir / deployment.replace("+", "")), "--model", str(checkpoint), *flags, timeout_s=600,
                   env={"KVC_DTYPE": "float32", **ISA_ENV[args.isa], **env})
    try:
        model = str(checkpoint)
        stream_one(up.url, model, [rng.randrange(256) for _ in range(args.input_len)], 8, time.perf_counter())
        settle()
        gaps, before = [], cpu_seconds(up)
        for _ in range(args.requests):
            prompt = [rng.randrange(256) for _ in range(args.input_len)]
            result = stream_one(up.url, model, prompt, args.output_len, time.perf_counter())
            if result:
                gaps.append(time_between_tokens(result))
        spent = cpu_seconds(up)
        tokens = max(1, args.requests * args.output_len)
        return {"served_tbt_s": statistics.median(gaps) if gaps else float("nan"), "requests": len(gaps),
                "engine_step": engine_step(up, DECODER[deployment]),
                "cpu_ms_per_token": {kind: round((seconds - before.get(kind, 0.0)) / tokens * 1e3, 4)
                                     for kind, seconds in sorted(spent.items())}}
    finally:
        up.stop()


def main() -> None:
    args = parse_args()
    capped = ISA_ENV[args.isa]
    if any(os.environ.get(name) != value for name, value in capped.items()):  # torch reads its cap at import
        os.execve(sys.executable, [sys.executable, "-m", "bench.serving.bench_served_step", *sys.argv[1:]],
                  {**os.environ, **capped})
    rng = random.Random(time.time_ns())  # prompts never sent before
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvc-served-step-") as logs:
        for shape in args.shapes:
            checkpoint = build_checkpoint(Path(args.checkpoint.format(shape=shape)), shape)
            context = args.input_len + args.output_len // 2
            bare = {threads: bare_step_s(checkpoint, context, threads) for threads in (1, 2)}
            for deployment in args.deployments:
                print(f"{shape} {deployment}", file=sys.stderr, flush=True)
                measured = served(checkpoint, deployment, args, rng, Path(logs))
                step = measured["engine_step"].get("measured_s", float("nan"))
                predicted = measured["engine_step"].get("predicted_s", float("nan"))
                rows.append({"shape": shape, "deployment": deployment, "context_tokens": context,
                             "bare_step_1_thread_s": bare[1], "bare_step_2_threads_s": bare[2], **measured,
                             "engine_step_s": step, "engine_predicted_s": predicted,
                             "served_over_engine": measured["served_tbt_s"] / step if step else float("nan"),
                             "not_the_model_ms": (measured["served_tbt_s"] - step) * 1000})
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": {**harness.machine(), "torch_threads": torch.get_num_threads()},
              "workload": {"input_len": args.input_len, "output_len": args.output_len, "requests": args.requests},
              "isa": args.isa, "isa_env": capped,
              "rows": rows}
    harness.write(args.out, result)
    print("| shape | deployment | bare step, 1 / 2 threads | engine's own step | served TBT | served / engine | "
          "not the model | CPU a token: gateway, NATS, the rest beside the engines |\n"
          "|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['deployment']} | {r['bare_step_1_thread_s'] * 1000:.1f} / "
              f"{r['bare_step_2_threads_s'] * 1000:.1f} ms | {r['engine_step_s'] * 1000:.1f} ms | "
              f"{r['served_tbt_s'] * 1000:.1f} ms | {r['served_over_engine']:.2f}x | {r['not_the_model_ms']:.1f} ms | "
              f"{beside_engines(r['cpu_ms_per_token'])} |")


def beside_engines(cpu: dict[str, float]) -> str:
    """The CPU a token costs the gateway, NATS and every other process but the engines and the client, in ms."""
    not_rest = {"colocated", "prefill", "decode", "client (this bench)", "gateway", "nats-server"}
    rest = sum(ms for kind, ms in cpu.items() if kind not in not_rest)
    return f"{cpu.get('gateway', 0.0):.2f}, {cpu.get('nats-server', 0.0):.2f}, {rest:.2f} ms"


if __name__ == "__main__":
    main()
