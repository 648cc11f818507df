"""Load-report gaps of a prefill instance while it pushes a long prompt's KV to a slow decode instance.

Starts `kvcentric up` (1 prefill + 1 decode) on a tiny checkpoint whose context allows the prompt, caps
the KV push bandwidth (--rate-gbps, the slow receiver), sends one long prompt and, meanwhile, short
requests; listens to every `kvc.load.prefill.*` report on NATS and polls the conductor's /health. Writes
the largest gap between two reports, the time the conductor counted no prefill alive, and how the short
requests ended to bench/results/liveness.json. It measures; it asserts nothing.

    .venv/bin/python -m bench.serving.bench_liveness --tokens 16384 --rate-gbps 0.01
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import nats

from tests.checkpoints import build_checkpoint
from bench.harness import UpProcess
from kvcentric.core.protocol import LoadReport, decode
from kvcentric.tools.processes import get_json
from bench import harness

RESULTS = harness.RESULTS / "liveness.json"


def complete(url: str, body: dict, timeout_s: float = 600.0) -> tuple[int, str]:
    """(HTTP status, error message or "") of one completion."""
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            json.load(response)
            return response.status, ""
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}").get("error", {}).get("message", "")


class ReportListener:
    """Every prefill load report's arrival time, from a NATS subscription in a thread of its own."""

    def __init__(self, nats_url: str) -> None:
        self.arrivals: list[float] = []
        self.repeats = 0
        """Reports that only said the prefill lives (its event loop computed no new load)."""
        self.oldest_load_s = 0.0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=asyncio.run, args=(self._listen(nats_url),), daemon=True)
        self.thread.start()

    async def _listen(self, nats_url: str) -> None:
        client = await nats.connect(nats_url)
        await client.subscribe("kvc.load.prefill.*", cb=self._arrived)
        while not self.stop.is_set():
            await asyncio.sleep(0.05)
        await client.close()

    async def _arrived(self, message) -> None:
        self.arrivals.append(time.monotonic())
        report = decode(message.data, LoadReport)
        self.repeats += report.repeat
        self.oldest_load_s = max(self.oldest_load_s, report.load_age_s)

    def gaps(self, start: float, end: float) -> list[float]:
        times = [t for t in self.arrivals if start <= t <= end]
        return [b - a for a, b in zip(times, times[1:])]


def watch_conductor(url: str, until: threading.Event, period_s: float = 0.05) -> float:
    """Seconds the conductor's /health counted no prefill instance alive, polled until `until`."""
    dead_s = 0.0
    while not until.is_set():
        try:
            alive = get_json(url)[1].get("prefill_alive", 0)
        except (OSError, ValueError):
            alive = 0
        dead_s += period_s if not alive else 0.0
        time.sleep(period_s)
    return dead_s


def run(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = build_checkpoint(Path(tmp) / "ckpt", "llama", max_position_embeddings=args.tokens + 256,
                                      num_hidden_layers=args.layers, num_attention_heads=args.kv_heads,
                                      num_key_value_heads=args.kv_heads, head_dim=args.head_dim)
        env = {"KVC_KV_RATE_LIMIT_GBPS": str(args.rate_gbps), "KVC_NUM_KV_BLOCKS": str(args.tokens // 16 + 512)}
        up = UpProcess(args.log_dir or os.path.join(tmp, "logs"), "--model", str(checkpoint), "--num-kv-blocks",
                       str(args.tokens // 16 + 512), env=env)
        try:
            listener = ReportListener(up.manifest["nats_url"])
            time.sleep(1.0)
            done = threading.Event()
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                dead = pool.submit(watch_conductor, up.manifest["services"]["conductor-0"]["health_url"], done)
                started = time.monotonic()
                long = pool.submit(complete, up.url, {"prompt": [3 + i % 250 for i in range(args.tokens)],
                                                      "max_tokens": 1})
                time.sleep(0.5)
                short = []
                while not long.done():
                    short.append(pool.submit(complete, up.url, {"prompt": "hello", "max_tokens": 2}))
                    time.sleep(args.short_every_s)
                long_status = long.result()
                ended = time.monotonic()
                done.set()
                statuses = [f.result() for f in short]
                gaps = listener.gaps(started, ended)
                repeats, oldest_load_s = listener.repeats, listener.oldest_load_s
        finally:
            listener.stop.set()
            up.stop()
    kv_bytes = args.tokens * args.layers * 2 * args.kv_heads * args.head_dim * 4
    return {"tokens": args.tokens, "kv_mib": kv_bytes >> 20, "rate_gbps": args.rate_gbps,
            "long_request_s": round(ended - started, 2),
            "long_status": long_status[0], "reports": len(gaps) + 1,
            "max_report_gap_s": round(max(gaps, default=0.0), 3),
            "gaps_over_0_5_s": sum(g > 0.5 for g in gaps), "repeats": repeats,
            "oldest_load_s": round(oldest_load_s, 3), "conductor_no_prefill_s": round(dead.result(), 2),
            "short_requests": len(statuses), "short_ok": sum(s == 200 for s, _ in statuses),
            "short_errors": sorted({f"{s} {m}" for s, m in statuses if s != 200})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--rate-gbps", type=float, default=0.01, help="KV push cap (the slow receiver)")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--kv-heads", type=int, default=2, help="also the attention heads")
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--short-every-s", type=float, default=0.5)
    parser.add_argument("--log-dir", default="", help="keep the services' logs here")
    parser.add_argument("--label", default="", help="name of this run in the results file")
    args = parser.parse_args()
    result = {"machine": harness.machine(), **run(args)}
    print(json.dumps(result, indent=1))
    previous = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    previous[args.label or f"{args.tokens}-tokens"] = result
    harness.write(RESULTS, previous)


if __name__ == "__main__":
    main()
