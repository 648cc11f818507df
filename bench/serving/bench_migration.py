"""Detection and migration time of streams whose decode instance is killed mid-stream.

Starts `kvcentric up --prefill 2 --decode 2`, and in each round opens --streams concurrent streaming
completions (greedy, ignore_eos, --max-tokens each); once every stream has its first token it SIGKILLs the
decode instance serving the most of them, reads every stream to its end, and waits for `up` to restart
the instance. For each stream it records how it ended, its token count and, for the killed instance's
streams, the longest stall of the stream after the kill (detection + migration; tokens already in flight
come first). The gateway's
`kvc_migration_detect_seconds` and `kvc_migration_gap_seconds` are read at the end. Writes
bench/results/migration.json. It measures; it asserts nothing.

    .venv/bin/python -m bench.serving.bench_migration --rounds 3 --streams 6
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import signal
import statistics
import tempfile
import threading
import time
import urllib.request

from bench.harness import UpProcess
from kvcentric.tools.processes import get_json
from bench import harness

RESULTS = harness.RESULTS / "migration.json"


def read_stream(port: int, body: dict, first: threading.Barrier, killed: dict, placed: list[str]) -> dict:
    """One streaming completion read to its end: how it ended, its decode instance, the kill-to-next-token time."""
    import http.client
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    connection.request("POST", "/v1/completions", json.dumps({**body, "stream": True,
                                                              "stream_options": {"include_usage": True}}),
                       {"Content-Type": "application/json"})
    response = connection.getresponse()
    record = {"status": response.status, "decode": response.getheader("x-kvcentric-decode", ""),
              "tokens": 0, "error": "", "stall_s": None}
    placed.append(record["decode"])
    waited, times = False, []
    for line in response:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        event = json.loads(line[6:])
        if not waited:
            waited = True
            first.wait(120)
        if "error" in event:
            record["error"] = event["error"]["message"]
        if event.get("usage"):
            record["tokens"] = event["usage"]["completion_tokens"]
        if "at" in killed and event.get("choices"):
            times.append(time.monotonic())
    connection.close()
    if "at" in killed and times:
        after = [killed["at"], *(t for t in times if t > killed["at"])]
        record["stall_s"] = max(b - a for a, b in zip(after, after[1:]))
    return record


def histogram(url: str, name: str) -> dict:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    values = {kind: sum(float(line.split()[-1]) for line in lines if line.startswith(f"kvc_{name}_{kind}"))
              for kind in ("sum", "count")}
    return {**values, "mean": values["sum"] / values["count"] if values["count"] else None}


def all_alive(up: UpProcess) -> bool:
    health = get_json(up.reload()["services"]["conductor-0"]["health_url"])[1]
    return health.get("prefill_alive") == 2 and health.get("decode_alive") == 2


def one_round(up: UpProcess, streams: int, max_tokens: int, round_index: int) -> dict:
    first = threading.Barrier(streams + 1)
    killed: dict = {}
    placed: list[str] = []
    bodies = [{"prompt": [3 + (i * 7 + s * 13 + round_index) % 250 for i in range(200)], "max_tokens": max_tokens,
               "temperature": 0, "ignore_eos": True} for s in range(streams)]
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        futures = [pool.submit(read_stream, up.port, body, first, killed, placed) for body in bodies]
        first.wait(120)  # every stream has its first token, and its decode instance in its headers
        decode = collections.Counter(placed).most_common(1)[0][0]
        os.kill(up.reload()["services"][decode]["pid"], signal.SIGKILL)
        killed["at"] = time.monotonic()
        records = [f.result() for f in futures]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if all_alive(up):
                break
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.2)
    return {"killed": decode, "streams": records}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=1500)
    parser.add_argument("--model", default="tiny")
    args = parser.parse_args()
    up = UpProcess(tempfile.mkdtemp(prefix="bench-migration-"), "--prefill", "2", "--decode", "2",
                   "--model", args.model, timeout_s=300.0)
    try:
        rounds = [one_round(up, args.streams, args.max_tokens, r) for r in range(args.rounds)]
        detect, gap = histogram(up.url, "migration_detect_seconds"), histogram(up.url, "migration_gap_seconds")
    finally:
        up.stop()
    moved = [s for r in rounds for s in r["streams"] if s["decode"] == r["killed"]]
    ends = collections.Counter("ok" if s["tokens"] == args.max_tokens and not s["error"] else "failed"
                               for r in rounds for s in r["streams"])
    stalls = [s["stall_s"] for s in moved if s["stall_s"] is not None]
    result = {"machine": harness.machine(), "model": args.model,
              "streams_per_round": args.streams, "rounds": args.rounds, "max_tokens": args.max_tokens,
              "ends": dict(ends), "streams_on_killed_decode": len(moved),
              "stall_after_kill_s": {"median": statistics.median(stalls) if stalls else None,
                                     "max": max(stalls) if stalls else None},
              "gateway_migration_detect_seconds": detect, "gateway_migration_gap_seconds": gap, "detail": rounds}
    harness.write(RESULTS, result, indent=2)
    print(json.dumps({k: v for k, v in result.items() if k != "detail"}, indent=2))


if __name__ == "__main__":
    main()
