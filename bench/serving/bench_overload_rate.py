"""Overload at a steady rate: Poisson arrivals well beyond what the cluster sustains, before and after the
conductor's queue-aware admission, in one run.

Issue 19 item 4 (Mooncake §6.1 and §7): with T_queue as the sum of the queued prefills' predicted times
reported by each prefill instance, placements counted until a report lists them and blocks expected at
placement (`--queue-time reported --expect-cache`, "after"), admitted requests should keep TTFT within the
SLO and the rest get 429 with Retry-After from the first seconds; "before" is the earlier estimate (a linear
guess from raw queued tokens, placements forgotten at each report: `--queue-time tokens --no-expect-cache`);
"corrected" is "after" with each instance's predicted TTFT multiplied by the ratio of actual to predicted its
first tokens showed (`--ttft-correction`, the default; "before" and "after" run without it).
Each mode starts its own `kvcentric up`, sends a few requests one at a time (unloaded TTFT and TBT; the
engines' measured models settle), then the Poisson load, and records how every request ended. Writes
bench/results/overload_rate.json. It measures; it asserts nothing.

    .venv/bin/python -m bench.serving.bench_overload_rate --rps 4 --duration-s 60 --modes after,corrected
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import collections
import json
import os
import random
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp

from bench.harness import UpProcess
from bench import harness

RESULTS = harness.RESULTS / "overload_rate.json"
MODES = {"before": {"KVC_QUEUE_TIME": "tokens", "KVC_EXPECT_CACHE": "false", "KVC_TTFT_CORRECTION": "false"},
         "after": {"KVC_QUEUE_TIME": "reported", "KVC_EXPECT_CACHE": "true", "KVC_TTFT_CORRECTION": "false"},
         "corrected": {"KVC_QUEUE_TIME": "reported", "KVC_EXPECT_CACHE": "true", "KVC_TTFT_CORRECTION": "true"}}
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def prompt(index: int, tokens: int, rng: random.Random) -> str:
    """About `tokens` tokens of the byte tokenizer, unique from the first block on (no prefix is shared)."""
    head = f"{index:05d} "
    return head + "".join(rng.choice(LETTERS) for _ in range(tokens - len(head) - 1))


async def one(session: aiohttp.ClientSession, url: str, text: str, max_tokens: int) -> dict:
    """One streamed completion as its client sees it: status, Retry-After, TTFT, mean TBT, error."""
    body = {"prompt": text, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    sent, stamps, row = time.monotonic(), [], {"status": 0, "retry_after": "", "error": ""}
    try:
        async with session.post(url + "/v1/completions", json=body) as response:
            row["status"] = response.status
            row["predicted_ttft_s"] = float(response.headers.get("x-kvcentric-predicted-ttft-s", -1))
            row["prefill"] = response.headers.get("x-kvcentric-prefill", "")
            row["decode"] = response.headers.get("x-kvcentric-decode", "")
            row["request_id"] = response.headers.get("x-request-id", "")
            if response.status != 200:
                row["retry_after"] = response.headers.get("Retry-After", "")
                row["error"] = (await response.text())[:200]
                return row
            async for line in response.content:
                if line.startswith(b"data: {") and b'"text"' in line:
                    stamps.append(time.monotonic())
                if b'"error"' in line:
                    row["status"], row["error"] = 599, line.decode(errors="replace")[:200]
    except (aiohttp.ClientError, TimeoutError) as exc:
        row["status"], row["error"] = 0, f"{type(exc).__name__}: {exc}"
    if stamps:
        row["ttft_s"] = stamps[0] - sent
        row["tbt_s"] = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else 0.0
        row["e2e_s"] = stamps[-1] - sent
    return row


async def poisson(url: str, rps: float, duration_s: float, input_len: int, output_len: int, seed: int,
                  timeout_s: float) -> list[dict]:
    """Poisson arrivals at `rps` for `duration_s`; each row gets its arrival time."""
    rng = random.Random(seed)
    arrivals, t = [], rng.expovariate(rps)
    while t < duration_s:
        arrivals.append(t)
        t += rng.expovariate(rps)
    texts = [prompt(i, input_len, rng) for i in range(len(arrivals))]
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        start = time.monotonic()

        async def at(arrival: float, text: str) -> dict:
            await asyncio.sleep(max(0.0, start + arrival - time.monotonic()))
            return {"arrival_s": round(arrival, 3), **await one(session, url, text, output_len)}
        return await asyncio.gather(*(at(a, x) for a, x in zip(arrivals, texts)))


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


def summarize(rows: list[dict], ttft_slo_s: float, tbt_slo_s: float) -> dict:
    """Counts by status, when the first 429 came, and the admitted requests' TTFT and TBT against the SLOs."""
    statuses = collections.Counter(row["status"] for row in rows)
    done = [row for row in rows if row["status"] == 200 and "ttft_s" in row]
    rejected = [row for row in rows if row["status"] == 429]
    ttft, tbt = [row["ttft_s"] for row in done], [row["tbt_s"] for row in done]
    samples = {str(row["status"]): row["error"] for row in rows if row["error"]}
    return {"requests": len(rows), "by_status": {str(k): v for k, v in sorted(statuses.items())},
            "completed": len(done), "rejected_429": len(rejected),
            "rejected_429_with_retry_after": sum(1 for row in rejected if row["retry_after"]),
            "first_429_at_s": min((row["arrival_s"] for row in rejected), default=None),
            "server_errors_5xx": sum(v for k, v in statuses.items() if k >= 500),
            "ttft_p50_s": quantile(ttft, 0.5), "ttft_p90_s": quantile(ttft, 0.9), "ttft_max_s": quantile(ttft, 1.0),
            "tbt_p50_s": quantile(tbt, 0.5), "tbt_p90_s": quantile(tbt, 0.9),
            "e2e_p50_s": quantile([row["e2e_s"] for row in done], 0.5),
            "ttft_over_predicted_p50": quantile([row["ttft_s"] / row["predicted_ttft_s"] for row in done
                                                 if row.get("predicted_ttft_s", -1) > 0], 0.5),
            "admitted_ttft_within_slo": round(sum(t <= ttft_slo_s for t in ttft) / len(done), 3) if done else None,
            "admitted_tbt_within_2x_slo": round(sum(t <= 2 * tbt_slo_s for t in tbt) / len(done), 3) if done else None,
            "error_samples": samples}


def conductor_gauges(up: UpProcess) -> dict[str, float]:
    """The conductors' rejection and placement counters (from /metrics), summed over the replicas."""
    totals: dict[str, float] = collections.Counter()
    for name, service in up.manifest["services"].items():
        if not name.startswith("conductor") or not service.get("health_url"):
            continue
        with urllib.request.urlopen(service["health_url"].replace("/health", "/metrics"), timeout=5) as response:
            for line in response.read().decode().splitlines():
                if line.startswith(("kvc_rejections_", "kvc_schedule_", "kvc_ttft_correction")) and " " in line:
                    key, value = line.rsplit(" ", 1)
                    if key.startswith("kvc_ttft_correction{"):  # one per conductor and prefill instance
                        totals[key] = float(value)
                    else:
                        totals[key.split("{")[0]] += float(value)
    return dict(totals)


def run_mode(mode: str, args: argparse.Namespace) -> dict:
    env = {**MODES[mode], "KVC_TTFT_SLO_S": str(args.ttft_slo_s), "KVC_TBT_SLO_S": str(args.tbt_slo_s)}
    if args.slo_headroom is not None:
        env["KVC_SLO_HEADROOM"] = str(args.slo_headroom)
    flags = ["--prefill", str(args.prefill), "--decode", str(args.decode), "--model", args.model]
    kept = Path(args.logs) / mode if args.logs else None
    if kept is not None:
        kept.mkdir(parents=True, exist_ok=True)
    with contextlib.nullcontext(str(kept)) if kept is not None else tempfile.TemporaryDirectory() as logs:
        up = UpProcess(logs, *flags, timeout_s=300.0, env=env)
        try:
            unloaded = asyncio.run(poisson(up.url, 1 / args.unloaded_gap_s, args.unloaded_gap_s * args.unloaded,
                                           args.input_len, args.output_len, args.seed + 1, args.timeout_s))
            started = time.monotonic()
            rows = asyncio.run(poisson(up.url, args.rps, args.duration_s, args.input_len, args.output_len, args.seed,
                                       args.timeout_s))
            seconds = time.monotonic() - started
            gauges = conductor_gauges(up)
        finally:
            up.stop()
    done = [row for row in unloaded if "ttft_s" in row]
    return {"env": env, "seconds": round(seconds, 1),
            "unloaded": {"requests": len(unloaded), "ttft_p50_s": quantile([r["ttft_s"] for r in done], 0.5),
                         "tbt_p50_s": quantile([r["tbt_s"] for r in done], 0.5)},
            **summarize(rows, args.ttft_slo_s, args.tbt_slo_s), "conductor": gauges,
            "timeline": timeline(rows), "admitted": [row for row in rows if row["status"] == 200]}


def timeline(rows: list[dict], step_s: float = 5.0) -> list[dict]:
    """Per `step_s` of arrivals: how many were sent, admitted and completed, rejected, and failed."""
    buckets: dict[float, collections.Counter] = collections.defaultdict(collections.Counter)
    for row in rows:
        status = row["status"]
        kind = "ok" if status == 200 else "429" if status == 429 else "error"
        buckets[step_s * int(row["arrival_s"] // step_s)][kind] += 1
    return [{"from_s": k, **buckets[k]} for k in sorted(buckets)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rps", type=float, default=4.0)
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--ttft-slo-s", type=float, default=10.0)
    parser.add_argument("--tbt-slo-s", type=float, default=0.3)
    parser.add_argument("--slo-headroom", type=float, default=None,
                        help="the conductors' --slo-headroom: admit only below (1 - this) x the SLO (default: theirs)")
    parser.add_argument("--prefill", type=int, default=2)
    parser.add_argument("--decode", type=int, default=2)
    parser.add_argument("--model", default="small")
    parser.add_argument("--unloaded", type=int, default=6, help="requests sent first, one every --unloaded-gap-s")
    parser.add_argument("--unloaded-gap-s", type=float, default=3.0)
    parser.add_argument("--modes", default="before,after")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--logs", default="", help="keep every service's log under DIR/<mode> (with "
                                                   "OTEL_TRACES_EXPORTER=console, each request's spans too)")
    args = parser.parse_args()
    runs = {}
    for mode in args.modes.split(","):
        runs[mode] = run_mode(mode, args)
        print(mode, json.dumps({k: v for k, v in runs[mode].items() if k not in ("timeline", "admitted")}),
              flush=True)
    load = os.getloadavg()
    report = {"rps": args.rps, "duration_s": args.duration_s, "input_len": args.input_len,
              "output_len": args.output_len, "ttft_slo_s": args.ttft_slo_s, "tbt_slo_s": args.tbt_slo_s,
              "cluster": f"{args.prefill}P+{args.decode}D {args.model}",
              "machine": {**harness.machine(), "load_average_at_end": round(load[0], 2)},
              "runs": runs}
    harness.write(args.out, report, indent=2)
    print(json.dumps({mode: {k: v for k, v in run.items() if k not in ("timeline", "error_samples", "admitted")}
                      for mode, run in runs.items()}, indent=2))


if __name__ == "__main__":
    main()
