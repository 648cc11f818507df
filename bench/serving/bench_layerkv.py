"""LayerKV on versus off, live on this machine: one colocated engine in process, a paged KV cache sized so long
prompts queue for blocks, Poisson arrivals of long prompts at rising rates, driven by the wall clock. Three
engines see the same arrivals: the plain engine (vLLM-style: a prompt starts when all its blocks fit), LayerKV
(layer-wise placement and offload with the SLO-aware scheduler) and LayerKV without the scheduler (the paper's
ablation). Reported per rate: TTFT mean and P90, TPOT P90, throughput, queueing delay, SLO violations.

The TTFT SLO is the paper's 3 s scaled to this machine: 3 s times the ratio of this engine's measured prefill of
the mean prompt to the Llama-2-7B/A100 roofline's; the TPOT SLO is the paper's 200 ms.

Usage: .venv/bin/python -m bench.serving.bench_layerkv [--model small] [--min-prompt 1024] [--max-prompt 4096]
       [--rates 0.05,0.1,0.2] [--duration-s 60] [--device-tokens 6144] [--decode swap|stream]
Writes bench/results/layerkv_live.json and bench/results/layerkv_live.png.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from kvcentric.core.block_pool import BlockPool
from kvcentric.core.costmodel import CostModel, HardwareSpec
from kvcentric.core.hashing import BlockHasher
from kvcentric.core.layerkv.pool import LayerBlockPool
from kvcentric.core.protocol import DecodeJob, PrefillJob, SamplingParams
from kvcentric.engine.cores.colocated import ColocatedEngine
from kvcentric.engine.kv.layered import LayeredKV
from kvcentric.engine.cores.layerkv import LayerKV
from kvcentric.engine.model.runner import ModelRunner
from kvcentric.model.config import preset
from bench import harness

RESULTS = harness.RESULTS
BLOCK = 16
A100 = HardwareSpec("a100-80gb", devices=1, flops=312e12, mem_bw=2.0e12, mem_bytes=80e9, host_bytes=512e9,
                    dtype_bytes=2, mfu=0.5, mbu=0.7, overhead_s=0.0)
"""The paper's single-GPU setting (an A100-class card) for the roofline the TTFT SLO is scaled by."""
PAPER_TTFT_SLO_S, PAPER_TPOT_SLO_S = 3.0, 0.2
CONFIGS = ("vllm", "layerkv", "layerkv-no-slo")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def arrivals(rate: float, duration_s: float, low: int, high: int, seed: int) -> list[tuple[float, int]]:
    """(time, prompt length) of a Poisson process, lengths uniform in [low, high]."""
    rng, now, out = random.Random(seed), 0.0, []
    while True:
        now += rng.expovariate(rate)
        if now > duration_s:
            return out
        out.append((now, rng.randint(low, high)))


def build(config: str, args) -> ColocatedEngine:
    model = preset(args.model)
    blocks = args.device_tokens // BLOCK
    runner = ModelRunner(model, blocks, BLOCK)
    hasher = BlockHasher(block_size=BLOCK)
    if config == "vllm":
        return ColocatedEngine(runner, BlockPool(blocks, BLOCK), hasher, args.chunk, args.max_batch)
    layer_block_bytes = 2 * BLOCK * runner.layer_token_bytes
    pool = LayerBlockPool(blocks, BLOCK, model.num_layers, (args.host_mb << 20) // layer_block_bytes)
    layered = LayeredKV(runner, pool)
    layered.probe_bandwidth()
    slo = PAPER_TPOT_SLO_S if config == "layerkv" else 0.0
    control = LayerKV(pool, layered, slo, args.threshold, flops=300e9, decode_mode=args.decode)
    return ColocatedEngine(runner, pool, hasher, args.chunk, args.max_batch, layerkv=control)


def serve(engine: ColocatedEngine, load: list[tuple[float, int]], output: int, cap_s: float) -> dict:
    """Drive the engine by the wall clock; per request: arrival, first token and last token times."""
    start, pending, seen = time.monotonic(), list(enumerate(load)), {}
    params = SamplingParams(max_tokens=output, temperature=0.0, ignore_eos=True)
    while (pending or engine.has_work) and time.monotonic() - start < cap_s:
        now = time.monotonic() - start
        while pending and pending[0][1][0] <= now:
            index, (at, length) = pending.pop(0)
            tokens = [(index * 31 + 7 * i) % 256 for i in range(length)]
            job = PrefillJob(request_id=f"r{index}", token_ids=tokens, sampling=params, decode_id="d",
                             decode_kv_addr="-")
            engine.submit(job, DecodeJob(request_id=job.request_id, n_prompt_tokens=length, sampling=params))
            seen[job.request_id] = {"arrival": at, "prompt": length, "tokens": []}
        if not engine.has_work:
            time.sleep(min(0.05, max(0.0, pending[0][1][0] - now)) if pending else 0.01)
            continue
        step(engine, lambda: time.monotonic() - start, seen)
    return seen


def step(engine: ColocatedEngine, clock, seen: dict) -> None:
    """One colocated step as the service runs it (schedule, prefill chunk and decode batch timed, update)."""
    chunk, batch, failed = engine.schedule(clock())
    started = time.perf_counter()
    first = engine.prefill.execute(chunk) if chunk is not None else None
    prefill_s = time.perf_counter() - started
    tokens = engine.decode.execute(batch) if batch else []
    decode_s = time.perf_counter() - started - prefill_s
    if engine.layerkv is not None:
        engine.layerkv.observe_prefill(chunk.end - chunk.start if chunk else 0, chunk.start if chunk else 0,
                                       prefill_s)
        engine.layerkv.observe_decode(decode_s if batch else 0.0)
    at = clock()
    for out in failed + engine.update(chunk, first, batch, tokens):
        seen[out.request_id]["tokens"] += [at] * len(out.token_ids)


def summarize(seen: dict, ttft_slo_s: float, output: int, makespan_s: float) -> dict:
    done = [r for r in seen.values() if len(r["tokens"]) >= output]
    ttft = [r["tokens"][0] - r["arrival"] for r in seen.values() if r["tokens"]]
    tpot = [(r["tokens"][-1] - r["tokens"][0]) / (len(r["tokens"]) - 1) for r in done if len(r["tokens"]) > 1]
    violated = sum(1 for r in seen.values() if len(r["tokens"]) < output or r["tokens"][0] - r["arrival"] > ttft_slo_s
                   or (r["tokens"][-1] - r["tokens"][0]) / max(1, len(r["tokens"]) - 1) > PAPER_TPOT_SLO_S)
    return {"requests": len(seen), "completed": len(done), "ttft_mean_s": statistics.fmean(ttft) if ttft else None,
            "ttft_p90_s": percentile(ttft, 0.9), "tpot_p90_s": percentile(tpot, 0.9),
            "throughput_rps": len(done) / makespan_s if makespan_s else 0.0,
            "tokens_per_s": sum(len(r["tokens"]) for r in seen.values()) / makespan_s if makespan_s else 0.0,
            "slo_violation_rate": violated / len(seen) if seen else 0.0}


def scaled_ttft_slo(args) -> tuple[float, float]:
    """3 s times (this engine's prefill of the mean prompt) / (Llama-2-7B on an A100, roofline)."""
    mean = (args.min_prompt + args.max_prompt) // 2
    engine = build("vllm", args)
    runner, pool = engine.runner, engine.pool
    table = pool.allocate(pool.blocks_for(mean))
    tokens = [i % 256 for i in range(mean)]
    started = time.perf_counter()
    for begin in range(0, mean, args.chunk):
        runner.prefill(tokens, table, begin, min(mean, begin + args.chunk))
    here = time.perf_counter() - started
    paper = CostModel.roofline(preset("llama2-7b"), A100).t_prefill(mean)
    return PAPER_TTFT_SLO_S * here / paper, here


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small")
    parser.add_argument("--min-prompt", type=int, default=1024)
    parser.add_argument("--max-prompt", type=int, default=4096)
    parser.add_argument("--output", type=int, default=32)
    parser.add_argument("--rates", default="0.05,0.1,0.2")
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--device-tokens", type=int, default=6144, help="device KV cache per layer, tokens")
    parser.add_argument("--host-mb", type=int, default=2048)
    parser.add_argument("--threshold", type=float, default=0.1)
    parser.add_argument("--decode", choices=("swap", "stream"), default="swap",
                        help="a decoding request with host layers waits to swap in (swap, the paper's vLLM base) "
                             "or reads them every step (stream)")
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default=str(RESULTS / "layerkv_live.json"))
    args = parser.parse_args()
    context = preset(args.model).max_position
    if args.max_prompt + args.output > context:
        parser.error(f"--max-prompt {args.max_prompt} + --output {args.output} exceed the {args.model} context "
                     f"({context} positions): use --max-prompt {context - args.output} or less")
    torch.set_num_threads(args.threads)
    ttft_slo_s, mean_prefill_s = scaled_ttft_slo(args)
    print(f"mean prompt prefill here {mean_prefill_s:.2f} s -> TTFT SLO {ttft_slo_s:.2f} s; TPOT SLO "
          f"{PAPER_TPOT_SLO_S} s")
    rows = []
    for rate in [float(r) for r in args.rates.split(",")]:
        load = arrivals(rate, args.duration_s, args.min_prompt, args.max_prompt, args.seed)
        for config in CONFIGS:
            engine = build(config, args)
            started = time.monotonic()
            seen = serve(engine, load, args.output, cap_s=4 * args.duration_s)
            row = {"config": config, "rate": rate, **summarize(seen, ttft_slo_s, args.output,
                                                               time.monotonic() - started)}
            if engine.layerkv is not None:
                gauges = engine.layerkv.gauges()
                row["layerkv"] = {k: gauges[k] for k in ("layerkv_prompt_layers_offloaded", "layerkv_bytes_to_host",
                                                         "layerkv_bytes_to_device", "layerkv_held_for_slo",
                                                         "layerkv_forecast_offloads", "layerkv_retained_layers_sum",
                                                         "layerkv_swap_ins", "layerkv_layer_blocks_reloaded")}
                engine.layerkv.layered.close()
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "layerkv"}), flush=True)
            result = {"bench": "layerkv_live", "machine": harness.machine(), "model": args.model, "args": vars(args),
                      "ttft_slo_s": ttft_slo_s, "tpot_slo_s": PAPER_TPOT_SLO_S,
                      "mean_prompt_prefill_s": mean_prefill_s, "rows": rows}
            harness.write(args.out, result)  # after each row: a cut-short run keeps its rows
    plot(result, Path(args.out).with_suffix(".png"))


def plot(result: dict, path: Path) -> None:
    """TTFT mean and P90, TPOT P90, throughput and SLO violations against the rate, one line per config."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = [("ttft_mean_s", "mean TTFT (s)"), ("ttft_p90_s", "P90 TTFT (s)"), ("tpot_p90_s", "P90 TPOT (s)"),
              ("throughput_rps", "throughput (req/s)"), ("slo_violation_rate", "SLO violations")]
    figure, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
    for axis, (key, label) in zip(axes, panels):
        for config in CONFIGS:
            rows = [r for r in result["rows"] if r["config"] == config]
            axis.plot([r["rate"] for r in rows], [r[key] for r in rows], marker="o", label=config)
        axis.set_xlabel("request rate (req/s)")
        axis.set_ylabel(label)
    axes[0].legend()
    figure.suptitle(f"LayerKV vs vLLM-style admission ({result.get('model', '')}, {result.get('where', 'live')})")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
