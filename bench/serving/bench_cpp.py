"""Chunked pipeline parallelism (Mooncake §5.1, issue 20): TTFT of single long prompts on one prefill instance
(`kvcentric up --prefill 1`) against a 2-stage prefill group (`--prefill-pipeline 2`), side by side in one
run (both up together, each prompt sent to one and then the other, the order alternating), every engine given
one torch thread; each prompt alone in its cluster (no queueing), fresh tokens (no prefix hits). Greedy first
tokens of both deployments are compared too.

Usage:
    .venv/bin/python -m bench.serving.bench_cpp [--model small-32k] [--lengths 512,2048,8192,16384] [--repeats 2]
        [--chunk 512] [--threads 1]

Writes bench/results/cpp.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from bench.harness import UpProcess
from bench import harness

RESULTS = harness.RESULTS
PATIENT = {"KVC_REJECTION": "never", "KVC_KV_WAIT_S": "3600", "KVC_REQUEST_TIMEOUT_S": "3600", "KVC_TBT_SLO_S": "60"}
"""A long prompt alone on a 2-core box takes minutes: the conductor admits it, decode and gateway wait, and
decode's TBT double-check is as good as off (a 60 s SLO: an 8K context's step predicts past 0.1 s here, and
this bench measures TTFT)."""
DEPLOYMENTS = {"1 instance": ["--prefill", "1"], "2-stage group": ["--prefill", "1", "--prefill-pipeline", "2"]}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small-32k")
    parser.add_argument("--lengths", default="512,2048,8192,16384")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(RESULTS / "cpp.json"))
    return parser.parse_args()


def first_token(url: str, token_ids: list[int]) -> tuple[float, str]:
    """Seconds to the first streamed token of a greedy completion, and its text."""
    body = {"prompt": token_ids, "max_tokens": 2, "temperature": 0, "ignore_eos": True, "stream": True}
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=900) as response:
        for line in response:
            if line.startswith(b"data: {"):
                chunk = json.loads(line[len(b"data: "):])
                if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                    return time.perf_counter() - started, chunk["choices"][0]["text"]
    raise RuntimeError("the stream ended without a token")


def prompts(lengths: list[int], repeats: int) -> dict[int, list[list[int]]]:
    """Fresh random byte prompts (BOS first), the same for both deployments."""
    rng = random.Random(20)
    return {n: [[256] + [rng.randrange(256) for _ in range(n - 1)] for _ in range(repeats)] for n in lengths}


def start(flags: list[str], args) -> UpProcess:
    common = ["--model", args.model, "--decode", "1", "--conductors", "1", "--prefill-chunk", str(args.chunk),
              "--torch-threads", str(args.threads), "--num-kv-blocks", "4096", "--restart", "never"]
    up = UpProcess(tempfile.mkdtemp(prefix="bench-cpp-"), *common, *flags, timeout_s=300, env=PATIENT)
    first_token(up.url, [256] + list(range(255)))  # warm-up
    return up


def measure(clusters: dict[str, UpProcess], cases: dict[int, list[list[int]]], out: str) -> dict:
    """Every prompt on every deployment, interleaved (the order alternating per prompt), so a change in the
    machine's speed falls on both alike."""
    runs: dict[str, dict[int, list]] = {name: {n: [] for n in cases} for name in clusters}
    errors: dict[str, dict[int, str]] = {name: {} for name in clusters}
    names = list(clusters)
    for n, token_lists in cases.items():
        for i, tokens in enumerate(token_lists):
            for name in (names if i % 2 == 0 else names[::-1]):
                if n in errors[name]:
                    continue
                try:
                    runs[name][n].append(first_token(clusters[name].url, tokens))
                except urllib.error.HTTPError as exc:  # recorded, not fatal: the other lengths still run
                    errors[name][n] = f"HTTP {exc.code}: {exc.read().decode(errors='replace')[:500]}"
                    print(f"{name:>14} {n:>6} tokens: {errors[name][n]}", flush=True)
                    continue
                print(f"{name:>14} {n:>6} tokens: TTFT {runs[name][n][-1][0]:.3f} s", flush=True)
        Path(out + ".partial").write_text(json.dumps({"runs": {k: {str(m): r for m, r in v.items()}
                                                               for k, v in runs.items()}}, indent=2))
    rows: dict[str, dict] = {}
    for name in clusters:
        rows[name] = {}
        for n in cases:
            if n in errors[name]:
                rows[name][n] = {"error": errors[name][n]}
                continue
            done = runs[name][n]
            rows[name][n] = {"ttft_s": [round(s, 4) for s, _ in done],
                             "median_ttft_s": round(statistics.median(s for s, _ in done), 4),
                             "first_texts": [text for _, text in done]}
    return rows


def main() -> None:
    args = parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    cases = prompts(lengths, args.repeats)
    clusters: dict[str, UpProcess] = {}
    try:
        for name, flags in DEPLOYMENTS.items():
            clusters[name] = start(flags, args)
        results = measure(clusters, cases, args.out)
    finally:
        for up in clusters.values():
            up.stop()
    single, group = results["1 instance"], results["2-stage group"]
    table = [{"prompt_tokens": n, "single_ttft_s": single[n]["median_ttft_s"],
              "group_ttft_s": group[n]["median_ttft_s"],
              "speedup": round(single[n]["median_ttft_s"] / group[n]["median_ttft_s"], 3),
              "same_first_tokens": single[n]["first_texts"] == group[n]["first_texts"]}
             for n in lengths if "error" not in single[n] and "error" not in group[n]]
    print(f"{'prompt':>8} {'1 instance':>11} {'2 stages':>9} {'speedup':>8} same-tokens")
    for row in table:
        print(f"{row['prompt_tokens']:>8} {row['single_ttft_s']:>10.3f}s {row['group_ttft_s']:>8.3f}s "
              f"{row['speedup']:>7.2f}x {row['same_first_tokens']}")
    out = {"errors": {f"{name} {n}": row["error"] for name, rows in results.items() for n, row in rows.items()
                      if "error" in row},
           "load_average": os.getloadavg(), "model": args.model, "chunk": args.chunk,
           "threads_per_engine": args.threads, "repeats": args.repeats,
           "machine": harness.machine(), "table": table,
           "runs": {name: {str(n): row for n, row in rows.items()} for name, rows in results.items()}}
    harness.write(args.out, out, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
