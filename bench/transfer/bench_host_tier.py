"""TTFT with the host KV pool on vs off, and 1P+1D vs colocated, side by side (issue 12, items 2 and 3).

Usage:
    .venv/bin/python -m bench.transfer.bench_host_tier [--model small] [--lengths 1024 2048 4000] [--requests 5]
        [--engine-only | --live-only] [--out bench/results/host_tier.json]

Two parts, both on this machine's CPU (the JSON names it):

1. In one process, a `ColocatedEngine` (1 torch thread) runs each prompt alone; TTFT is from submit to the
   first token out of `update`. Three variants on the same prompts, interleaved: no host pool; the host pool
   written behind the compute (`HostWriter`, what the engines do); and the blocks copied before the first
   token goes out (the write-behind waited for inside the step: what `finish` did before the write-behind).
   Also timed: how long `finish` holds the engine's thread in each (what the host tier puts on the first
   token's path, free of the VM's drift, which swamps a few milliseconds in TTFTs of seconds).
2. Four `kvcentric up` clusters alive at once: colocated and 1P+1D, each with the default 256 MiB host pool
   and with `KVC_HOST_POOL_MB=0`. Requests go one at a time, round-robin over the four (each round starting
   with the next mode), so the VM's drift hits every mode alike; each prompt is new to every cluster (random
   ids, no prefix hits). TTFT is request sent -> first SSE token chunk.

Writes bench/results/host_tier.json (machine, per-mode samples, p50s and the ratios on/off and PD/colocated).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import torch

from bench.serving.bench_request_path import log, machine, make_prompts, stream_request
from bench.harness import UpProcess

from kvcentric.core.block_pool import BlockPool
from kvcentric.core.hashing import BlockHasher
from kvcentric.core.protocol import DecodeJob, PrefillJob, SamplingParams
from kvcentric.engine.cores.colocated import ColocatedEngine
from kvcentric.engine.kv.kvpool import HostBlockPool
from kvcentric.engine.model.runner import ModelRunner
from kvcentric.model.config import preset
from bench import harness

RESULTS = harness.RESULTS
MODES = {  # name -> (kvcentric up flags, environment)
    "colocated_host_on": (["--colocated", "1"], {}),
    "colocated_host_off": (["--colocated", "1"], {"KVC_HOST_POOL_MB": "0"}),
    "pd_host_on": (["--prefill", "1", "--decode", "1"], {}),
    "pd_host_off": (["--prefill", "1", "--decode", "1"], {"KVC_HOST_POOL_MB": "0"}),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small", help="model preset (default: small; its longest prompt is 4095)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4000], help="prompt lengths")
    parser.add_argument("--requests", type=int, default=5, help="measured requests per length and mode")
    parser.add_argument("--output-tokens", type=int, default=4, help="tokens generated per request")
    parser.add_argument("--host-pool-mb", type=int, default=256, help="host pool of the engine-level part")
    parser.add_argument("--engine-only", action="store_true", help="skip the clusters")
    parser.add_argument("--live-only", action="store_true", help="skip the one-process part")
    parser.add_argument("--out", default=str(RESULTS / "host_tier.json"), help="JSON output path")
    return parser.parse_args()


# ---------------------------------------------------------------- one process

def engine_ttft(engine: ColocatedEngine, prompt: list[int], name: str) -> float:
    """Seconds from submit to the first token of one prompt run alone; the request is then ended."""
    job = PrefillJob(request_id=name, token_ids=prompt, sampling=SamplingParams(max_tokens=4, temperature=0.0,
                                                                                 ignore_eos=True),
                     decode_id="c", decode_kv_addr="")
    started = time.perf_counter()
    engine.submit(job, DecodeJob(request_id=name, n_prompt_tokens=len(prompt), sampling=job.sampling))
    while not any(c.token_ids for c in engine.step()):
        pass
    ttft = time.perf_counter() - started
    engine.cancel(name)
    if engine.prefill.writer is not None:
        engine.prefill.writer.collect(wait=True)  # between requests, so each starts with an idle writer
    return ttft


def time_finish(engine: ColocatedEngine, spent: list[float]) -> None:
    """Record how long each `finish` holds the engine's thread: what the host tier adds to the first token."""
    finish = engine.prefill.finish

    def timed(work) -> None:
        started = time.perf_counter()
        finish(work)
        spent.append(time.perf_counter() - started)
    engine.prefill.finish = timed  # type: ignore[method-assign]


def copy_before_first_token(engine: ColocatedEngine) -> None:
    """The pre-write-behind path: `finish` returns only once the blocks are in the host pool."""
    finish = engine.prefill.finish

    def finish_then_wait(work) -> None:
        finish(work)
        assert engine.prefill.writer is not None
        engine.prefill.writer.collect(wait=True)
    engine.prefill.finish = finish_then_wait  # type: ignore[method-assign]


def bench_engine(args, prompts: dict[int, list[list[int]]]) -> dict:
    torch.set_num_threads(1)
    config, block_size = preset(args.model), 16
    blocks = 2 * max(args.lengths) // block_size + 64
    engines = {}
    for variant in ("off", "behind", "before"):
        runner = ModelRunner(config, blocks, block_size, seed=0)
        host = HostBlockPool((args.host_pool_mb << 20) // runner.block_bytes, runner.block_bytes) \
            if variant != "off" else None
        engines[variant] = ColocatedEngine(runner, BlockPool(blocks, block_size), BlockHasher(block_size=block_size),
                                           512, 8, host)
    copy_before_first_token(engines["before"])
    finishes: dict[str, list[float]] = {v: [] for v in engines}
    for variant, engine in engines.items():
        time_finish(engine, finishes[variant])
    samples: dict[str, dict[int, list[float]]] = {v: {n: [] for n in prompts} for v in engines}
    finish_ms: dict[str, float] = {}
    for n, batch in prompts.items():
        for i, prompt in enumerate(batch):
            for variant, engine in engines.items():
                ttft = engine_ttft(engine, prompt, f"{variant}-{n}-{i}")
                if i > 0:  # the first of each length warms up
                    samples[variant][n].append(ttft)
        p50 = {v: statistics.median(samples[v][n]) * 1e3 for v in engines}
        held = {v: statistics.median(finishes[v][-len(batch):]) * 1e3 for v in engines}
        finish_ms.update({f"{v}/{n}": held[v] for v in engines})
        log(f"engine {n:>5} tokens: TTFT p50 off {p50['off']:.1f} ms, write-behind {p50['behind']:.1f} ms, "
            f"copy before the first token {p50['before']:.1f} ms; finish() holds the thread "
            f"{held['off']:.2f} / {held['behind']:.2f} / {held['before']:.2f} ms")
    return {**summarize(samples, [("behind", "off"), ("before", "off")]), "finish_ms_p50": finish_ms}


# ---------------------------------------------------------------- clusters

def bench_clusters(args, prompts: dict[int, list[list[int]]]) -> dict:
    clusters: dict[str, UpProcess] = {}
    try:
        for mode, (flags, env) in MODES.items():
            log_dir = tempfile.mkdtemp(prefix=f"kvc-host-tier-{mode}-")
            log(f"starting {mode} (logs in {log_dir})")
            clusters[mode] = UpProcess(log_dir, "--model", args.model, *flags, timeout_s=300.0, env=env)
        samples: dict[str, dict[int, list[float]]] = {m: {n: [] for n in prompts} for m in clusters}
        for n, batch in prompts.items():
            for i, prompt in enumerate(batch):
                order = list(clusters.items())
                for mode, cluster in order[i % len(order):] + order[:i % len(order)]:  # each goes first in turn
                    ttft = stream_request(cluster.port, prompt, args.output_tokens)["ttft_s"]
                    if i > 0:
                        samples[mode][n].append(ttft)
            p50 = {m: statistics.median(samples[m][n]) * 1e3 for m in clusters}
            log(f"live {n:>5} tokens: " + ", ".join(f"{m} {v:.1f} ms" for m, v in p50.items()))
    finally:
        for cluster in clusters.values():
            cluster.stop()
    pairs = [("colocated_host_on", "colocated_host_off"), ("pd_host_on", "pd_host_off"),
             ("pd_host_on", "colocated_host_on"), ("pd_host_off", "colocated_host_off")]
    return summarize(samples, pairs)


def summarize(samples: dict[str, dict[int, list[float]]], pairs: list[tuple[str, str]]) -> dict:
    p50 = {m: {str(n): statistics.median(v) * 1e3 for n, v in by_n.items()} for m, by_n in samples.items()}
    ratios = {f"{a}/{b}": {n: p50[a][n] / p50[b][n] for n in p50[a]} for a, b in pairs}
    return {"ttft_ms_p50": p50, "ratios": ratios,
            "samples_ms": {m: {str(n): [round(s * 1e3, 2) for s in v] for n, v in by_n.items()}
                           for m, by_n in samples.items()}}


def main() -> int:
    args = parse_args()
    prompts = make_prompts(args.lengths, args.requests + 1, seed=1)
    report: dict = {"config": {k: v for k, v in vars(args).items() if k != "out"}, "machine": machine()}
    if not args.live_only:
        report["engine"] = bench_engine(args, prompts)
    if not args.engine_only:
        report["live"] = bench_clusters(args, prompts)
    out = harness.write(args.out, report, indent=2)
    log(f"wrote {out}")
    for part in ("engine", "live"):
        for pair, by_n in report.get(part, {}).get("ratios", {}).items():
            print(f"{part:6} {pair:42} " + "  ".join(f"{n}: {r:.3f}x" for n, r in by_n.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
