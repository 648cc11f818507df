"""Many concurrent streams against the default `kvcentric up` cluster: how each request ended.

Issue 15's overload case: N concurrent short streaming completions at once, beyond what the decode
instance's KV cache holds. Every request should complete or get a 429 with Retry-After (decode room
is admission: KV waits in the decode's host staging, the conductor rejects before prefill when no
decode has room); none should get a 5xx. Writes the counts by status, a sample of each error, and the
decode instance's staging and block figures to bench/results/live_overload.json. It measures; it asserts
nothing.

    .venv/bin/python -m bench.serving.live_overload --streams 500
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import tempfile
import time
import urllib.request

import aiohttp

from bench.harness import UpProcess
from bench import harness

RESULTS = harness.RESULTS / "live_overload.json"
PROMPT = "Decode capacity is admission, not failure: KV waits in host memory until blocks free. "


async def stream(session: aiohttp.ClientSession, url: str, index: int, max_tokens: int,
                 repeat: int) -> tuple[int, str, str]:
    """(status, Retry-After, error message or "") of one streamed completion."""
    body = {"model": "tiny", "prompt": f"{index} {PROMPT * repeat}", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True}
    try:
        async with session.post(url + "/v1/completions", json=body) as response:
            text = await response.text()
            if response.status != 200:
                return response.status, response.headers.get("Retry-After", ""), text[:200]
            error = "" if "[DONE]" in text and '"error"' not in text else text[-200:]
            return (200 if not error else 599), "", error
    except (aiohttp.ClientError, TimeoutError) as exc:
        return 0, "", f"{type(exc).__name__}: {exc}"


async def burst(url: str, streams: int, max_tokens: int, repeat: int,
                timeout_s: float) -> list[tuple[int, str, str]]:
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        return await asyncio.gather(*(stream(session, url, i, max_tokens, repeat) for i in range(streams)))


def summarize(results: list[tuple[int, str, str]], seconds: float) -> dict:
    statuses = collections.Counter(status for status, _, _ in results)
    samples = {str(status): error for status, _, error in reversed(results) if error}
    return {"by_status": {str(k): v for k, v in sorted(statuses.items())}, "seconds": round(seconds, 1),
            "completed": statuses[200], "rejected_429": statuses[429],
            "rejected_429_without_retry_after": sum(1 for s, r, _ in results if s == 429 and not r),
            "server_errors_5xx": sum(v for k, v in statuses.items() if k >= 500),
            "no_answer": statuses[0], "error_samples": samples}


def rejections(up: UpProcess) -> dict[str, float]:
    """The conductors' rejection counters (from /metrics), summed over the replicas."""
    totals: dict[str, float] = collections.Counter()
    for name, service in up.manifest["services"].items():
        if not name.startswith("conductor") or not service.get("health_url"):
            continue
        with urllib.request.urlopen(service["health_url"].replace("/health", "/metrics"), timeout=5) as response:
            for line in response.read().decode().splitlines():
                if line.startswith("kvc_rejections_") and " " in line:
                    key, value = line.rsplit(" ", 1)
                    totals[key] += float(value)
    return dict(totals)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=500)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-repeat", type=int, default=1, help="the prompt is this many sentences (~90 "
                        "tokens each)")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("up_flags", nargs="*", help="more flags for `kvcentric up` (after --)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as logs:
        up = UpProcess(logs, *args.up_flags)
        try:
            started = time.monotonic()
            results = asyncio.run(burst(up.url, args.streams, args.max_tokens, args.prompt_repeat,
                                          args.timeout_s))
            summary = summarize(results, time.monotonic() - started)
            time.sleep(1.0)
            decode = {k: v for k, v in up.health("decode-0")["stats"].items()
                      if k.startswith(("kv_blocks", "kv_staging", "kv_staged", "kv_refused", "preemptions",
                                       "requests_"))}
            conductor = rejections(up)
        finally:
            up.stop()
    report = {"streams": args.streams, "max_tokens": args.max_tokens, "prompt_repeat": args.prompt_repeat,
              "up_flags": args.up_flags,
              "machine": harness.machine(), **summary,
              "decode_after": decode, "conductor": conductor}
    harness.write(RESULTS, report, indent=2)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
