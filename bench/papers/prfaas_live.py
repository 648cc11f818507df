"""Prefill-as-a-Service live on this machine: two datacenters (two nats-server processes joined by a NATS
gateway), the PrfaaS prefill in one with its KV push rate-limited to emulate the cross-datacenter link,
the PD cluster (prefill, decode, conductor with the topology, kvs-meta, gateway) in the other; a mix of
short and long prompts goes through the gateway, and the routing and the link's egress are measured.

Usage:
    .venv/bin/python -m bench.papers.prfaas_live [--model small] [--threshold 256] [--link-gbps 0.1]
        [--short 12] [--long 8] [--concurrency 2] [--adjust-s 0] [--out bench/results/prfaas_live.json]

The threshold t is in uncached tokens and scaled to CPU-sized prompts (the paper's 19.4K would be
beyond the `small` model's 4096-token context). Prompts are random token ids, so nothing is cached and
l = the prompt length: long ones (> t) should prefill in the prfaas cluster, short ones in the PD cluster.
"""

from __future__ import annotations


import argparse
import asyncio
import random
import sys
import threading
import time

import aiohttp

from tests.twodc import TwoDatacenters, TwoDCConfig
from bench import harness

RESULTS = harness.RESULTS


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--threshold", type=int, default=256, help="t, uncached tokens")
    parser.add_argument("--link-gbps", type=float, default=0.1, help="the cross-datacenter link (rate limit)")
    parser.add_argument("--adjust-s", type=float, default=0.0, help="conductor's short-term t steps (0: fixed t)")
    parser.add_argument("--short", type=int, default=12, help="short prompts (32..200 tokens)")
    parser.add_argument("--long", type=int, default=8, help="long prompts (512..1536 tokens)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", default="")
    parser.add_argument("--out", default=str(RESULTS / "prfaas_live.json"))
    return parser.parse_args(argv)


def workload(args) -> list[list[int]]:
    """Random prompts (no shared prefix), short and long interleaved in a seeded order."""
    rng = random.Random(args.seed)
    lengths = [rng.randint(32, 200) for _ in range(args.short)] + [rng.randint(512, 1536) for _ in range(args.long)]
    rng.shuffle(lengths)
    return [[rng.randrange(256) for _ in range(n)] for n in lengths]


async def send_all(url: str, model: str, prompts: list[list[int]], max_tokens: int, concurrency: int) -> list[dict]:
    gate = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        async def one(index: int, prompt: list[int]) -> dict:
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            async with gate:
                started = time.monotonic()
                async with session.post(f"{url}/v1/completions", json=body) as response:
                    await response.read()
                    return {"index": index, "prompt_tokens": len(prompt), "status": response.status,
                            "prefill": response.headers.get("x-kvcentric-prefill", ""),
                            "decode": response.headers.get("x-kvcentric-decode", ""),
                            "latency_s": round(time.monotonic() - started, 3)}
        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


class ConductorWatch(threading.Thread):
    """Samples the conductor's PrfaaS view (t, egress utilization) while the requests run."""

    def __init__(self, dcs: TwoDatacenters, every_s: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.dcs, self.every_s, self.samples, self.done = dcs, every_s, [], threading.Event()

    def run(self) -> None:
        start = time.monotonic()
        while not self.done.wait(self.every_s):
            try:
                status = self.dcs.health("conductor")["prfaas"]
            except (OSError, KeyError, ValueError):
                continue
            self.samples.append({"t_s": round(time.monotonic() - start, 2), "threshold": status["threshold"],
                                 "egress_utilization": status["egress_utilization"].get("prfaas", 0.0)})


def summarize(args, records: list[dict], egress: dict, watch: ConductorWatch, conductor: dict) -> dict:
    def count(kind: str, where: str) -> int:
        return sum(1 for r in records if r["class"] == kind and r["prefill"].startswith(f"prefill-{where}"))
    routing = {kind: {"requests": sum(r["class"] == kind for r in records), "remote_prfaas": count(kind, "prfaas"),
                      "local_pd": count(kind, "pd")} for kind in ("long", "short")}
    peak = max((s["egress_utilization"] for s in watch.samples), default=0.0)
    return {"config": vars(args), "routing": routing, "egress": {**egress, "conductor_peak_utilization": peak},
            "all_ok": all(r["status"] == 200 for r in records), "conductor_prfaas": conductor,
            "threshold_samples": watch.samples, "requests": records}


def egress_figures(before: dict, after: dict, wall_s: float, link_gbps: float) -> dict:
    stats_before, stats_after = before["stats"], after["stats"]
    sent = stats_after.get("push_bytes_streamed", 0) - stats_before.get("push_bytes_streamed", 0)
    per_push = max(after.get("link_bandwidth", {}).values(), default=0.0)
    return {"rate_limit_gbps": link_gbps, "kv_bytes_sent": sent, "pushes": stats_after.get("push_streams_sent", 0),
            "per_push_gbps": round(per_push * 8 / 1e9, 4), "mean_over_run_gbps": round(sent * 8 / 1e9 / wall_s, 4),
            "run_s": round(wall_s, 2)}


def report(result: dict) -> str:
    egress, lines = result["egress"], ["class   requests  -> prfaas (remote)  -> pd (local)"]
    for kind, row in result["routing"].items():
        lines.append(f"{kind:<7} {row['requests']:>8}  {row['remote_prfaas']:>17}  {row['local_pd']:>11}")
    lines.append(f"egress of the prfaas prefill: {egress['kv_bytes_sent'] / 2**20:.1f} MiB in {egress['pushes']} "
                 f"pushes; per push {egress['per_push_gbps']:.3f} Gbps (link_bandwidth) vs the "
                 f"{egress['rate_limit_gbps']} Gbps limit; mean over the {egress['run_s']} s run "
                 f"{egress['mean_over_run_gbps']:.3f} Gbps; conductor's peak egress utilization "
                 f"{egress['conductor_peak_utilization']:.0%}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    config = TwoDCConfig(model=args.model, threshold=args.threshold, link_gbps=args.link_gbps,
                         adjust_s=args.adjust_s, log_dir=args.log_dir)
    prompts = workload(args)
    print(f"prfaas_live: starting two datacenters ({args.model}, t = {args.threshold} tokens, link "
          f"{args.link_gbps} Gbps)", flush=True)
    with TwoDatacenters(config) as dcs:
        print(f"prfaas_live: ready; NATS gateway pd <-> prfaas connected: {dcs.gateways_connected()}; "
              f"logs in {dcs.log_dir}", flush=True)
        before, watch = dcs.health("prefill-prfaas-0"), ConductorWatch(dcs)
        watch.start()
        started = time.monotonic()
        records = asyncio.run(send_all(dcs.url, args.model, prompts, args.max_tokens, args.concurrency))
        wall_s = time.monotonic() - started
        time.sleep(0.3)  # one more load report
        watch.done.set()
        egress = egress_figures(before, dcs.health("prefill-prfaas-0"), wall_s, args.link_gbps)
        conductor = dcs.health("conductor")["prfaas"]
    for record in records:
        record["class"] = "long" if record["prompt_tokens"] > args.threshold else "short"
    result = summarize(args, records, egress, watch, conductor)
    harness.write(args.out, harness.record("prfaas_live", **result))
    print(report(result))
    print(f"prfaas_live: wrote {args.out}")
    return 0 if result["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
