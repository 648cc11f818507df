"""Request-path overhead: one request at a time through a whole `kvcentric up` cluster (gateway -> NATS ->
conductor -> prefill -> gRPC KV push -> decode -> NATS -> SSE) vs the same work in one process
(`kvcentric.engine.model.local.generate`), for several prompt lengths.

Usage:
    .venv/bin/python -m bench.serving.bench_request_path [--model small] [--lengths 64 512 1536]
        [--output-tokens 32] [--requests 8] [--warmup 1] [--seed 0] [--log-dir DIR] [--no-plot]

For each prompt length it sends --requests sequential streaming requests of random token ids (0..255,
a new prompt every request, so the prefill side's prefix cache never hits) with temperature 0 and
ignore_eos, and records TTFT (request sent -> first SSE data chunk), end-to-end latency (-> `[DONE]`)
and the mean time between tokens, TBT = (last token chunk - first token chunk) / (tokens - 1). The
single-process reference runs the same prompts with torch.set_num_threads(1), like the engines that
`up` starts on a 2-core box: TTFT = the runner's prefill of the prompt, e2e = the whole generate call.
The single-process part runs first, with no cluster alive, so the two do not share the CPU.

Writes bench/results/request_path.json (config, machine, per-length rows, ratios, engine stats, log
findings) and bench/results/request_path.png (p50 TTFT bars; skipped if matplotlib is missing), and
prints a markdown table for the README. The cluster is always stopped (SIGTERM, wait, kill).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvcentric.core.block_pool import BlockPool
from kvcentric.engine.model.local import generate
from kvcentric.engine.model.runner import ModelRunner
from bench.harness import UpProcess
from kvcentric.tools.processes import get_json
from kvcentric.model.config import preset
from kvcentric.model.tokenizer import ByteTokenizer
from kvcentric.core.protocol import SamplingParams
from bench import harness

RESULTS = harness.RESULTS
LOG_PROBLEM = re.compile(r"Traceback|ERROR|CRITICAL|WARNING|Exception|failed", re.IGNORECASE)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small", help="model preset (default: small)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 512, 1536], help="prompt lengths")
    parser.add_argument("--output-tokens", type=int, default=32, help="tokens generated per request")
    parser.add_argument("--requests", type=int, default=8, help="measured requests per length")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured requests per length, per path")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and of the prompts")
    parser.add_argument("--num-kv-blocks", type=int, default=2048, help="KV blocks per engine")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--log-dir", default="", help="cluster log dir (default: a new temp dir)")
    parser.add_argument("--startup-timeout", type=float, default=180.0, help="seconds to wait for `up`")
    parser.add_argument("--out", default=str(RESULTS / "request_path.json"), help="JSON output path")
    parser.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    return parser.parse_args()


# ---------------------------------------------------------------- workload


def make_prompts(lengths: list[int], count: int, seed: int) -> dict[int, list[list[int]]]:
    """`count` distinct random prompts of ids 0..255 per length (no shared prefix between any two)."""
    rng = random.Random(seed)
    return {n: [[rng.randrange(256) for _ in range(n)] for _ in range(count)] for n in lengths}


def kv_bytes(model: str, n_tokens: int) -> int:
    """Bytes of fp32 KV pushed prefill -> decode: layers*tokens*2*kv_heads*head_dim*4."""
    c = preset(model)
    return c.num_layers * n_tokens * 2 * c.num_kv_heads * c.head_dim * 4


def summarize(samples: list[dict]) -> dict:
    """p50/mean/min/max of TTFT and e2e (ms), mean TBT (ms); tokens per request."""
    ttft = [s["ttft_s"] * 1e3 for s in samples]
    e2e = [s["e2e_s"] * 1e3 for s in samples]
    tbt = [s["tbt_s"] * 1e3 for s in samples]
    return {"n": len(samples), "ttft_ms_p50": statistics.median(ttft), "ttft_ms_mean": statistics.fmean(ttft),
            "ttft_ms_min": min(ttft), "ttft_ms_max": max(ttft),
            "e2e_ms_p50": statistics.median(e2e), "e2e_ms_mean": statistics.fmean(e2e),
            "e2e_ms_min": min(e2e), "e2e_ms_max": max(e2e),
            "tbt_ms_mean": statistics.fmean(tbt), "tokens": [s["tokens"] for s in samples]}


# ---------------------------------------------------------------- single process


def timed_generate(runner: ModelRunner, pool: BlockPool, prompt: list[int], params: SamplingParams) -> dict:
    """One `generate` call; TTFT is when runner.prefill returns (the first sample is microseconds)."""
    marks: dict[str, float] = {}
    prefill = runner.prefill

    def timed_prefill(*args, **kwargs):
        logits = prefill(*args, **kwargs)
        marks["prefilled"] = time.perf_counter()
        return logits

    runner.prefill = timed_prefill
    try:
        t0 = time.perf_counter()
        out, reason = generate(runner, pool, prompt, params)
        end = time.perf_counter()
    finally:
        del runner.prefill  # back to the bound method
    ttft = marks["prefilled"] - t0
    return {"ttft_s": ttft, "e2e_s": end - t0, "tbt_s": (end - marks["prefilled"]) / max(1, len(out) - 1),
            "tokens": len(out), "finish_reason": reason, "token_ids": out}


def bench_single(args, prompts: dict[int, list[list[int]]]) -> dict[int, list[dict]]:
    torch.set_num_threads(1)
    runner = ModelRunner(preset(args.model), args.num_kv_blocks, args.block_size, args.seed)
    pool = BlockPool(args.num_kv_blocks, args.block_size)
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
    results = {}
    for n, batch in prompts.items():
        samples = [timed_generate(runner, pool, p, params) for p in batch]
        results[n] = samples[args.warmup:]
        s = summarize(results[n])
        log(f"single  {n:>5} tokens: p50 TTFT {s['ttft_ms_p50']:8.1f} ms, p50 e2e {s['e2e_ms_p50']:8.1f} ms, "
            f"TBT {s['tbt_ms_mean']:6.2f} ms")
    return results


# ---------------------------------------------------------------- cluster


def read_sse(response: http.client.HTTPResponse, t0: float) -> dict:
    """Timestamps of the first and last token chunks and of [DONE]; text and usage."""
    first = last = done = None
    text, usage = [], None
    while line := response.readline():
        if not line.startswith(b"data: "):
            continue
        now, payload = time.perf_counter(), line[6:].strip()
        if payload == b"[DONE]":
            done = now
            break
        event = json.loads(payload)
        if "error" in event:
            raise RuntimeError(f"stream error: {event['error']}")
        if event.get("usage"):
            usage = event["usage"]
        if event.get("choices"):
            first = now if first is None else first
            last = now
            text.append(event["choices"][0]["text"])
    if first is None or done is None:
        raise RuntimeError("stream ended without a token chunk or [DONE]")
    return {"first": first - t0, "last": last - t0, "done": done - t0, "text": "".join(text), "usage": usage}


def stream_request(port: int, prompt: list[int], max_tokens: int) -> dict:
    """One streaming /v1/completions request on a fresh connection; times from just before sending."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
                       "stream": True, "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        t0 = time.perf_counter()
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:500]!r}")
        sse = read_sse(response, t0)
    finally:
        conn.close()
    tokens = sse["usage"]["completion_tokens"] if sse["usage"] else max_tokens
    return {"ttft_s": sse["first"], "e2e_s": sse["done"], "tbt_s": (sse["last"] - sse["first"]) / max(1, tokens - 1),
            "tokens": tokens, "text": sse["text"]}


def bench_cluster(args, port: int, prompts: dict[int, list[list[int]]]) -> dict[int, list[dict]]:
    results = {}
    for n, batch in prompts.items():
        samples = []
        for i, prompt in enumerate(batch):
            samples.append(stream_request(port, prompt, args.output_tokens))
            tag = "warm-up" if i < args.warmup else f"{i - args.warmup + 1}/{args.requests}"
            log(f"  disagg {n:>5} tokens {tag:>7}: TTFT {samples[-1]['ttft_s'] * 1e3:8.1f} ms, "
                f"e2e {samples[-1]['e2e_s'] * 1e3:8.1f} ms")
        results[n] = samples[args.warmup:]
        s = summarize(results[n])
        log(f"disagg  {n:>5} tokens: p50 TTFT {s['ttft_ms_p50']:8.1f} ms, p50 e2e {s['e2e_ms_p50']:8.1f} ms, "
            f"TBT {s['tbt_ms_mean']:6.2f} ms")
    return results


def engine_stats(log_dir: str) -> dict:
    """The /health stats of every engine (KV bytes moved, prefix-cache hits), read before stopping."""
    with open(os.path.join(log_dir, "cluster.json")) as manifest:
        services = json.load(manifest)["services"]
    stats = {}
    for name, service in services.items():
        if name.startswith(("prefill", "decode")):
            try:
                stats[name] = get_json(service["health_url"], 2.0)[1].get("stats", {})
            except (OSError, ValueError) as exc:
                stats[name] = {"error": str(exc)}
    return stats


def log_findings(log_dir: str, limit: int = 20) -> dict[str, list[str]]:
    """Lines in the cluster's service logs that look like warnings, errors or tracebacks."""
    findings = {}
    for path in sorted(Path(log_dir).glob("*.log")):
        lines = [f"{i}: {line.rstrip()}" for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
                 if LOG_PROBLEM.search(line)]
        if lines:
            findings[path.name] = lines[:limit] + ([f"... {len(lines) - limit} more"] if len(lines) > limit else [])
    return findings


def run_cluster(args, prompts) -> tuple[dict, dict, dict, str]:
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="kvc-bench-")
    os.makedirs(log_dir, exist_ok=True)
    log(f"starting `kvcentric up --model {args.model}` (logs in {log_dir})")
    t0 = time.perf_counter()
    cluster = UpProcess(log_dir, "--model", args.model, "--prefill", "1", "--decode", "1", "--seed", str(args.seed),
                        "--num-kv-blocks", str(args.num_kv_blocks), "--block-size", str(args.block_size),
                        timeout_s=args.startup_timeout)
    try:
        log(f"cluster ready in {time.perf_counter() - t0:.1f} s on port {cluster.port}")
        results = bench_cluster(args, cluster.port, prompts)
        stats = engine_stats(log_dir)
    finally:
        log("stopping the cluster")
        cluster.stop()
    return results, stats, log_findings(log_dir), log_dir


# ---------------------------------------------------------------- report


def rows(args, single: dict, disagg: dict) -> list[dict]:
    out = []
    for n in args.lengths:
        s, d = summarize(single[n]), summarize(disagg[n])
        out.append({"prompt_tokens": n, "output_tokens": args.output_tokens,
                    "kv_bytes_per_request": kv_bytes(args.model, n),
                    "single": s, "disagg": d,
                    "ratio": {"ttft_p50": d["ttft_ms_p50"] / s["ttft_ms_p50"],
                              "e2e_p50": d["e2e_ms_p50"] / s["e2e_ms_p50"],
                              "tbt_mean": d["tbt_ms_mean"] / s["tbt_ms_mean"]},
                    "overhead_ms": {"ttft_p50": d["ttft_ms_p50"] - s["ttft_ms_p50"],
                                    "e2e_p50": d["e2e_ms_p50"] - s["e2e_ms_p50"]}})
    return out


def outputs_match(single: dict, disagg: dict) -> dict:
    """Greedy decoding: the cluster's text should equal the single-process tokens decoded."""
    tokenizer, checked, mismatched = ByteTokenizer(), 0, []
    for n in single:
        for i, (s, d) in enumerate(zip(single[n], disagg[n])):
            checked += 1
            if tokenizer.decode(s["token_ids"]) != d["text"]:
                mismatched.append(f"{n} tokens, request {i}")
    return {"checked": checked, "mismatched": mismatched}


def markdown(args, table: list[dict]) -> str:
    lines = ["| prompt tokens | KV moved | TTFT p50 disagg | TTFT p50 single | TTFT ratio | e2e p50 disagg | "
             "e2e p50 single | e2e ratio | TBT disagg | TBT single | TBT ratio |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in table:
        s, d, q = r["single"], r["disagg"], r["ratio"]
        lines.append(f"| {r['prompt_tokens']} | {r['kv_bytes_per_request'] / 2**20:.1f} MiB | "
                     f"{d['ttft_ms_p50']:.1f} ms | {s['ttft_ms_p50']:.1f} ms | {q['ttft_p50']:.2f}x | "
                     f"{d['e2e_ms_p50']:.0f} ms | {s['e2e_ms_p50']:.0f} ms | {q['e2e_p50']:.2f}x | "
                     f"{d['tbt_ms_mean']:.2f} ms | {s['tbt_ms_mean']:.2f} ms | {q['tbt_mean']:.2f}x |")
    return "\n".join(lines)


def plot(table: list[dict], model: str, path: Path) -> str:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed; no PNG (pip install matplotlib into .venv to get one)"
    labels = [str(r["prompt_tokens"]) for r in table]
    x, width = range(len(table)), 0.38
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar([i - width / 2 for i in x], [r["disagg"]["ttft_ms_p50"] for r in table], width, label="disaggregated")
    ax.bar([i + width / 2 for i in x], [r["single"]["ttft_ms_p50"] for r in table], width, label="single process")
    for i, r in zip(x, table):
        ax.annotate(f"{r['ratio']['ttft_p50']:.2f}x", (i - width / 2, r["disagg"]["ttft_ms_p50"]),
                    ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), labels)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("p50 TTFT (ms)")
    ax.set_title(f"TTFT, model '{model}': disaggregated vs single process (1 torch thread)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"


def machine() -> dict:
    """The machine record (the harness's); the benches that import it from here use it the same way."""
    return harness.machine()


def main() -> int:
    args = parse_args()
    started = time.perf_counter()
    prompts = make_prompts(args.lengths, args.warmup + args.requests, args.seed)
    log(f"single process: model {args.model}, lengths {args.lengths}, {args.requests} requests "
        f"(+{args.warmup} warm-up) of {args.output_tokens} tokens each")
    single = bench_single(args, prompts)
    disagg, stats, findings, log_dir = run_cluster(args, prompts)
    table = rows(args, single, disagg)
    match = outputs_match(single, disagg)
    elapsed = time.perf_counter() - started
    report = {"config": {k: v for k, v in vars(args).items() if k != "out"}, "machine": machine(),
              "rows": table, "ratios": {str(r["prompt_tokens"]): r["ratio"] for r in table},
              "outputs_match": match, "engine_stats": stats, "log_findings": findings, "log_dir": log_dir,
              "wall_s": elapsed}
    for rs in (single, disagg):  # keep the JSON small: no token ids / text per request
        for samples in rs.values():
            for s in samples:
                s.pop("token_ids", None), s.pop("text", None)
    report["samples"] = {"single": {str(n): v for n, v in single.items()},
                         "disagg": {str(n): v for n, v in disagg.items()}}
    out = harness.write(args.out, report, indent=2)
    log(f"wrote {out}")
    if not args.no_plot:
        log(plot(table, args.model, out.with_suffix(".png")))
    print_summary(args, table, match, stats, findings, elapsed)
    return 0 if not match["mismatched"] else 1


def print_summary(args, table, match, stats, findings, elapsed) -> None:
    print(f"\nModel `{args.model}`, {args.output_tokens} output tokens, {args.requests} sequential streaming "
          f"requests per length, 1 prefill + 1 decode, 1 torch thread per engine, {os.cpu_count()} CPUs.\n")
    print(markdown(args, table))
    print(f"\noutputs identical to single process: {match['checked'] - len(match['mismatched'])}/{match['checked']}"
          + (f" (mismatch: {', '.join(match['mismatched'])})" if match["mismatched"] else ""))
    for name, s in stats.items():
        keys = ("kv_bytes_received", "prefill_tokens_computed", "prefill_tokens_cached", "bytes_received")
        print(f"{name}: " + ", ".join(f"{k}={s[k]}" for k in keys if k in s))
    if findings:
        print("\nsuspicious lines in the cluster logs:")
        for name, lines in findings.items():
            print(f"  {name}:\n    " + "\n    ".join(lines))
    print(f"\ntotal wall time {elapsed:.1f} s")


if __name__ == "__main__":
    sys.exit(main())
