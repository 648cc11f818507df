"""Disaggregated vs single process: N concurrent greedy requests on `kvcentric up --prefill 1 --decode 1`,
on `kvcentric up --colocated 1`, and on the same colocated engine driven in this process with no services
(no gateway, NATS, gRPC or KV push); output tokens/s and TTFT side by side, as ratios to the in-process run.

Usage:
    .venv/bin/python -m bench.serving.bench_disagg [--model small] [--dtype float32] [--concurrency 8]
        [--input-len 256] [--output-len 32] [--threads 1] [--device cpu]

On a GPU host (`bench/engine/gpu_check.sh` runs it with the 8B shape): `--device cuda --model llama3-8b --dtype
bfloat16`; the two engines of 1P+1D then share the one GPU, as on the CPU they share its cores.

Writes bench/results/disagg.json and prints a table.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import statistics
import string
import sys
import tempfile
import time
import urllib.request

import torch

from bench.harness import UpProcess

from kvcentric.core.block_pool import BlockPool
from kvcentric.core.hashing import BlockHasher
from kvcentric.core.protocol import DecodeJob, PrefillJob, SamplingParams
from kvcentric.engine.cores.colocated import ColocatedEngine
from kvcentric.engine.config import EngineConfig
from kvcentric.engine.cores.mixed import MixedStepper
from kvcentric.engine.model.runner import ModelRunner
from kvcentric.model.config import preset
from kvcentric.model.tokenizer import ByteTokenizer
from bench import harness

RESULTS = harness.RESULTS
DEPLOYMENTS = {"1P+1D": ["--prefill", "1", "--decode", "1"], "colocated": ["--colocated", "1"]}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=256, help="prompt tokens (bytes: one token each)")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the in-process engine (`kvcentric "
                        "up` gives each engine cores / engines: 1P+1D on 2 cores runs one thread each)")
    parser.add_argument("--device", default="cpu", help="torch device of every engine and of the in-process one "
                        "(cuda: the in-process runner captures its decode graphs, as the served engines do)")
    parser.add_argument("--only", nargs="*", default=list(DEPLOYMENTS), choices=list(DEPLOYMENTS),
                        help="served deployments to run (the in-process run always runs)")
    parser.add_argument("--logs", default="", help="keep each deployment's service logs under DIR/<deployment> "
                        "(with OTEL_TRACES_EXPORTER=console they hold every span)")
    parser.add_argument("--out", default=str(RESULTS / "disagg.json"))
    return parser.parse_args()


def prompts(count: int, length: int, seed: int = 0) -> list[str]:
    """Distinct random prompts (no shared prefix, so no request reuses another's cache)."""
    rng = random.Random(seed)
    return ["".join(rng.choice(string.ascii_lowercase + " ") for _ in range(length)) for _ in range(count)]


def summary(ttfts: list[float], wall_s: float, output_tokens: int) -> dict:
    return {"output_tokens_per_s": output_tokens / wall_s, "ttft_p50_s": statistics.median(ttfts),
            "ttft_max_s": max(ttfts), "wall_s": wall_s}


def stream_one(url: str, model: str, prompt: str, output_len: int, start: float) -> tuple[float, int]:
    """(TTFT, tokens) of one streamed completion; TTFT from the batch's common start."""
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    ttft, tokens = None, 0
    with urllib.request.urlopen(request, timeout=600) as response:
        for line in response:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if ttft is None and event.get("choices"):
                ttft = time.perf_counter() - start
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    assert ttft is not None and tokens == output_len, (ttft, tokens)
    return ttft, tokens


def run_served(args, label: str, texts: list[str]) -> dict:
    flags = DEPLOYMENTS[label]
    with tempfile.TemporaryDirectory(prefix="kvc-up-") as scratch:
        log_dir = os.path.join(args.logs, label.replace("+", "")) if args.logs else scratch
        os.makedirs(log_dir, exist_ok=True)
        up = UpProcess(log_dir, "--model", args.model, "--device", args.device, *flags, timeout_s=300,
                       env={"KVC_DTYPE": args.dtype})
        try:
            concurrent_batch(up.url, args, prompts(len(texts), args.input_len, seed=1))  # warm-up
            return concurrent_batch(up.url, args, texts)
        finally:
            up.stop()


def concurrent_batch(url: str, args, texts: list[str]) -> dict:
    with concurrent.futures.ThreadPoolExecutor(len(texts)) as pool:
        start = time.perf_counter()
        results = list(pool.map(lambda text: stream_one(url, args.model, text, args.output_len, start), texts))
        wall = time.perf_counter() - start
    return summary([r[0] for r in results], wall, sum(r[1] for r in results))


def run_in_process(args, texts: list[str]) -> dict:
    """The colocated engine with the served engines' defaults (mixed steps of `--step-tokens`) on `--threads`
    torch threads, stepped here with no host pool: every request submitted at once."""
    config = EngineConfig()
    torch.set_num_threads(args.threads)
    runner = ModelRunner(preset(args.model), config.num_kv_blocks, config.block_size, config.seed, args.dtype,
                         device=args.device)
    runner.capture_decode_graphs(config.max_batch)  # on CUDA, as a served engine does; elsewhere nothing
    engine = ColocatedEngine(runner, BlockPool(config.num_kv_blocks, config.block_size),
                             BlockHasher(config.hash_algo, config.block_size), config.prefill_chunk, config.max_batch)
    stepper = MixedStepper(engine, config.step_tokens) if config.step_tokens else None
    drive(engine, stepper, prompts(len(texts), args.input_len, seed=1), args.output_len)  # warm-up, as served
    result = drive(engine, stepper, texts, args.output_len)
    del engine, runner
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the served engines need the memory next
    return result


def drive(engine: ColocatedEngine, stepper: MixedStepper | None, texts: list[str], output_len: int) -> dict:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    start, ttft, generated = time.perf_counter(), {}, 0
    for index, text in enumerate(texts):
        token_ids, request_id = ByteTokenizer().encode(text), f"r{index}-{start}"
        engine.submit(PrefillJob(request_id=request_id, token_ids=token_ids, sampling=params, decode_id="",
                                 decode_kv_addr=""),
                      DecodeJob(request_id=request_id, n_prompt_tokens=len(token_ids), sampling=params))
    while engine.has_work:
        for chunk in engine.step() if stepper is None else stepper.step():
            if chunk.token_ids:
                ttft.setdefault(chunk.request_id, time.perf_counter() - start)
            generated += len(chunk.token_ids)
    wall = time.perf_counter() - start
    assert generated == len(texts) * output_len, generated
    return summary(list(ttft.values()), wall, generated)


def main() -> None:
    args = parse_args()
    texts, load_before = prompts(args.concurrency, args.input_len), os.getloadavg()
    runs = {"one process": run_in_process(args, texts)}
    for label in args.only:
        print(f"== {label}", file=sys.stderr, flush=True)
        runs[label] = run_served(args, label, texts)
    base = runs["one process"]
    for run in runs.values():
        run["tokens_per_s_vs_one_process"] = run["output_tokens_per_s"] / base["output_tokens_per_s"]
        run["ttft_p50_vs_one_process"] = run["ttft_p50_s"] / base["ttft_p50_s"]
    machine = {**harness.machine(), "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
               "load_average_before": load_before, "load_average_after": os.getloadavg()}
    result = {"model": args.model, "dtype": args.dtype, "concurrency": args.concurrency, "input_len": args.input_len,
              "output_len": args.output_len, "in_process_threads": args.threads, "machine": machine, "runs": runs}
    harness.write(args.out, result, indent=2)
    print(f"{'':12} {'tok/s':>8} {'x 1proc':>8} {'TTFT p50':>9} {'x 1proc':>8}")
    for label, run in runs.items():
        print(f"{label:12} {run['output_tokens_per_s']:8.1f} {run['tokens_per_s_vs_one_process']:8.2f} "
              f"{run['ttft_p50_s']:9.3f} {run['ttft_p50_vs_one_process']:8.2f}")


if __name__ == "__main__":
    main()
