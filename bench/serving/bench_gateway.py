"""What the gateway, NATS and the conductor add to a request: TTFT against a zero-cost engine stub
(`bench/serving/stub_engine.py`) at a fixed open-loop rate (default 100 requests/s for 10 s), vs the goal
p50 <= 3 ms. Runs nats-server, redis-server, kvs-meta, the conductor, the gateway and the stub here.

Usage:
    .venv/bin/python -m bench.serving.bench_gateway [--rate 100] [--duration-s 10] [--rounds 5] [--prompt-tokens 64]
        [--warmup 50] [--log-dir DIR]

Each request is a streaming /v1/completions with max_tokens=1 sent on schedule whatever the answers do;
TTFT is from the send to the first `data:` event, as a client sees it (the client shares the 2 cores).
Two gateways run on the same stack: `--dispatch conductor` (ours: the conductor hands the jobs to the
engines as it answers) and `--dispatch gateway` (the gateway sends them after the answer); with the HTTP
floor (the same client against `bench/serving/sse_floor.py`, an SSE server with nothing behind it) they are loaded
in interleaved rounds, each for duration-s in all. Reported beside them: the gateways' own TTFT histograms
(request in -> first token out), CPU time per request of every process, each bus hop timed alone and a
bare NATS request/reply round trip on the same server. Writes bench/results/gateway.json.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp
import nats

from kvcentric.tools.processes import Child, free_port, get_json, nats_server_argv, redis_server_argv, wait_for_port
from bench import harness

RESULTS = harness.RESULTS
GOAL_P50_MS = 3.0
DISPATCH_MODES = ("conductor", "gateway")
"""The gateway's --dispatch: ours (the conductor hands the jobs over as it answers) first, then the gateway
sending them after the answer (DESIGN.md's first design), on the same stack in the same run."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=100.0, help="requests per second (open loop)")
    parser.add_argument("--duration-s", type=float, default=10.0, help="how long to send")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="prompt length (token ids)")
    parser.add_argument("--warmup", type=int, default=50, help="sequential requests to each target before measuring")
    parser.add_argument("--rounds", type=int, default=5, help="the load is sent in this many interleaved rounds "
                                                              "per target (conductor, gateway dispatch, HTTP floor)")
    parser.add_argument("--log-dir", default="", help="service logs (default: a temp dir)")
    parser.add_argument("--out", default=str(RESULTS / "gateway.json"), help="where the JSON goes")
    return parser.parse_args()


def start_stack(log_dir: str) -> tuple[list[Child], str, str]:
    """nats, redis, kvs-meta, conductor, stub, gateway; returns the children, the NATS URL, the gateway URL."""
    children = []
    nats_port, redis_port = free_port(), free_port()
    children.append(Child("nats-server", nats_server_argv(nats_port), log_dir))
    children.append(Child("redis-server", redis_server_argv(redis_port), log_dir))
    wait_for_port("127.0.0.1", nats_port, 10)
    wait_for_port("127.0.0.1", redis_port, 10)
    nats_url = f"nats://127.0.0.1:{nats_port}"
    gateway = ["-m", "kvcentric", "gateway", "--model", "tiny", "--log-level", "warning", "--dispatch"]
    services = [("kvs-meta", ["-m", "kvcentric", "kvs-meta", "--redis-url", f"redis://127.0.0.1:{redis_port}/0"]),
                ("conductor", ["-m", "kvcentric", "conductor"]),
                ("stub", [str(Path(__file__).with_name("stub_engine.py")), "--instance-id", "stub"]),
                *((f"gateway-{mode}", [*gateway, mode]) for mode in DISPATCH_MODES)]
    for name, argv in services:
        port = free_port()
        children.append(Child(name, [sys.executable, *argv, "--nats-url", nats_url, "--port", str(port)], log_dir,
                              f"http://127.0.0.1:{port}/health"))
    gateways = {mode: child.health_url.removesuffix("/health") for mode, child in
                zip(DISPATCH_MODES, children[-len(DISPATCH_MODES):])}
    return children, nats_url, gateways


def wait_ready(children: list[Child], gateway: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for child in children:
            if child.process.poll() is not None:
                raise RuntimeError(f"{child.name} exited:\n{child.log_tail()}")
        try:
            status, body = get_json(gateway + "/health")
            if status == 200 and body["prefill_alive"] >= 1 and body["decode_alive"] >= 1:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError("the stack did not become ready")


async def one_request(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[float, float, str]:
    """(TTFT s, e2e s, error or "") of one streaming completion."""
    sent = time.perf_counter()
    ttft = None
    async with session.post(url, json=body) as response:
        if response.status != 200:
            return 0.0, 0.0, f"{response.status}: {(await response.text())[:200]}"
        async for line in response.content:
            if ttft is None and line.startswith(b"data: "):
                ttft = time.perf_counter() - sent
    return ttft or 0.0, time.perf_counter() - sent, ""


async def load(url: str, rate: float, duration_s: float, warmup: int, prompt_tokens: int) -> dict:
    body = {"model": "tiny", "prompt": [65 + i % 26 for i in range(prompt_tokens)], "max_tokens": 1,
            "stream": True, "temperature": 0}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        for _ in range(warmup):
            await one_request(session, url, body)
        count, start = int(rate * duration_s), time.perf_counter()
        tasks = []
        for i in range(count):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one_request(session, url, body)))
        results = await asyncio.gather(*tasks)
        sent_s = time.perf_counter() - start
    return {"results": results, "sent_s": sent_s, "count": count}


async def hops(nats_url: str, n: int = 300) -> dict:
    """Each bus hop of a request timed alone, sequentially: schedule, decode submit, prefill submit + token."""
    from kvcentric.core.hashing import BlockHasher, to_hex
    from kvcentric.core.protocol import (DecodeJob, Placement, PrefillJob, SamplingParams, ScheduleReply,
                                    ScheduleRequest, SubmitAck, Subjects, decode, encode)
    nc = await nats.connect(nats_url)
    tokens = [65 + i % 26 for i in range(64)]
    hashes = [to_hex(h) for h in BlockHasher("sha256_cbor", 16).hash_blocks(tokens)]
    times: dict[str, list[float]] = {"schedule": [], "decode_submit": [], "prefill_submit_and_token": []}
    try:
        for i in range(n):
            rid = f"hop-{i}"
            sent = time.perf_counter()
            ask = ScheduleRequest(request_id=rid, n_tokens=64, block_hashes=hashes, max_tokens=1)
            reply = await nc.request(Subjects.SCHEDULE, encode(ask), timeout=2)
            times["schedule"].append(time.perf_counter() - sent)
            placement = decode(reply.data, ScheduleReply)
            assert isinstance(placement, Placement), placement
            sampling = SamplingParams(max_tokens=1)
            sent = time.perf_counter()
            decode_job = DecodeJob(request_id=rid, n_prompt_tokens=64, sampling=sampling)
            await nc.request(Subjects.submit("decode", placement.decode_id), encode(decode_job), 2)
            times["decode_submit"].append(time.perf_counter() - sent)
            out = await nc.subscribe(Subjects.out(rid))
            sent = time.perf_counter()
            job = PrefillJob(request_id=rid, token_ids=tokens, sampling=sampling, decode_id=placement.decode_id,
                             decode_kv_addr=placement.decode_kv_addr)
            decode((await nc.request(Subjects.submit("prefill", placement.prefill_id), encode(job), 2)).data,
                   SubmitAck)
            await out.next_msg(timeout=2)
            times["prefill_submit_and_token"].append(time.perf_counter() - sent)
            await out.unsubscribe()
    finally:
        await nc.close()
    return {name: percentiles_ms(samples) for name, samples in times.items()}


async def nats_round_trip(nats_url: str, n: int = 1000) -> list[float]:
    """Bare request/reply on the same server, for scale."""
    nc = await nats.connect(nats_url)
    try:
        async def echo(msg):
            await msg.respond(msg.data)
        await nc.subscribe("bench.echo", cb=echo)
        samples = []
        for _ in range(n):
            sent = time.perf_counter()
            await nc.request("bench.echo", b"x" * 64, timeout=1)
            samples.append(time.perf_counter() - sent)
        return samples
    finally:
        await nc.close()


def percentiles_ms(samples: list[float]) -> dict:
    ordered = sorted(samples)
    pick = lambda q: 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "mean": 1000 * statistics.fmean(ordered),
            "n": len(ordered)}


def gateway_histogram_mean_ms(gateway: str, name: str) -> float:
    text = urllib.request.urlopen(gateway + "/metrics", timeout=5).read().decode()
    values = {line.split("{")[0]: float(line.split()[-1]) for line in text.splitlines()
              if line.startswith((f"kvc_{name}_sum", f"kvc_{name}_count"))}
    count = values.get(f"kvc_{name}_count", 0)
    return 1000 * values.get(f"kvc_{name}_sum", 0) / count if count else float("nan")


def loop_factory():
    try:
        import uvloop
        return uvloop.new_event_loop
    except ImportError:
        return None


def main() -> None:
    args = parse_args()
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="kvc-bench-gateway-")
    os.makedirs(log_dir, exist_ok=True)
    children, nats_url, gateways = start_stack(log_dir)
    floor_port = free_port()
    children.append(Child("sse-floor", [sys.executable, str(Path(__file__).with_name("sse_floor.py")),
                                        str(floor_port)], log_dir))
    targets = {**gateways, "floor": f"http://127.0.0.1:{floor_port}"}
    try:
        for gateway in gateways.values():
            wait_ready(children, gateway)
        wait_for_port("127.0.0.1", floor_port, 20)
        runs = {name: {"results": [], "sent_s": 0.0, "count": 0} for name in targets}
        cpu = {name: collections.Counter() for name in targets}
        with asyncio.Runner(loop_factory=loop_factory()) as runner:  # the client on uvloop too, when installed
            rtt = runner.run(nats_round_trip(nats_url))
            breakdown = runner.run(hops(nats_url))
            for url in targets.values():  # warm every target up before the first measured round
                runner.run(load(url + "/v1/completions", args.rate, 0, args.warmup, args.prompt_tokens))
            for round_ in range(args.rounds):  # interleaved, so drift of the machine hits each target alike
                for name, url in targets.items():
                    before = cpu_seconds(children)
                    run = runner.run(load(url + "/v1/completions", args.rate, args.duration_s / args.rounds, 0,
                                          args.prompt_tokens))
                    cpu[name].update({k: v - before[k] for k, v in cpu_seconds(children).items()})
                    for key in ("results", "sent_s", "count"):
                        runs[name][key] += run[key]
                print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr)
        server_ttft_ms = {mode: gateway_histogram_mean_ms(gateway, "ttft_seconds")
                          for mode, gateway in gateways.items()}
    finally:
        for child in reversed(children):
            child.process.terminate()
        for child in reversed(children):
            child.process.wait(10)
    cpu_ms = {name: {k: round(1000 * v / runs[name]["count"], 3) for k, v in spent.items()}
              for name, spent in cpu.items()}
    floor = runs.pop("floor")
    report(args, runs, rtt, breakdown, server_ttft_ms, log_dir, floor, cpu_ms)


def cpu_seconds(children: list[Child]) -> dict[str, float]:
    """User + system CPU seconds each child has used so far (Linux /proc), the client's own included."""
    tick = os.sysconf("SC_CLK_TCK")
    spent = {"client": sum(os.times()[:2])}
    for child in children:
        try:
            fields = Path(f"/proc/{child.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        spent[child.name] = (int(fields[11]) + int(fields[12])) / tick
    return spent


def report(args, runs: dict, rtt: list[float], breakdown: dict, server_ttft_ms: dict, log_dir: str,
           floor: dict, cpu: dict) -> None:
    floor_ms = percentiles_ms([r[0] for r in floor["results"] if not r[2]])
    modes = {}
    for mode, run in runs.items():
        ok = [r for r in run["results"] if not r[2]]
        errors = [r[2] for r in run["results"] if r[2]]
        ttft = percentiles_ms([r[0] for r in ok])
        modes[mode] = {"requests": run["count"], "ok": len(ok), "errors": len(errors), "first_errors": errors[:3],
                       "achieved_rps": run["count"] / run["sent_s"], "ttft_ms": ttft,
                       "e2e_ms": percentiles_ms([r[1] for r in ok]), "gateway_ttft_mean_ms": server_ttft_ms[mode],
                       "above_http_floor_p50_ms": ttft["p50"] - floor_ms["p50"],
                       "cpu_ms_per_request": cpu[mode]}
    ours = modes[DISPATCH_MODES[0]]
    result = {
        "benchmark": "gateway + NATS + conductor overhead: TTFT with a zero-cost engine stub",
        "config": {"rate_rps": args.rate, "duration_s": args.duration_s, "prompt_tokens": args.prompt_tokens,
                   "warmup": args.warmup, "stream": True, "max_tokens": 1},
        "machine": harness.machine(),
        **ours, "dispatch": DISPATCH_MODES[0], "by_dispatch": modes,
        "nats_request_reply_ms": percentiles_ms(rtt), "hops_alone_ms": breakdown, "http_floor_ttft_ms": floor_ms,
        "goal_p50_ms": GOAL_P50_MS, "meets_goal": ours["above_http_floor_p50_ms"] <= GOAL_P50_MS,
        "meets_goal_client_side": ours["ttft_ms"]["p50"] <= GOAL_P50_MS,
        "log_dir": log_dir,
    }
    harness.write(args.out, result, indent=2)
    print(f"NATS request/reply p50 {result['nats_request_reply_ms']['p50']:.3f} ms; hops alone, p50 ms: "
          + ", ".join(f"{k} {v['p50']:.2f}" for k, v in breakdown.items()))
    print(f"HTTP floor (same client, an SSE server with nothing behind it): TTFT p50 {floor_ms['p50']:.2f} ms")
    for mode, m in modes.items():
        ttft = m["ttft_ms"]
        print(f"--dispatch {mode}: {m['ok']}/{m['requests']} ok at {m['achieved_rps']:.1f} req/s; TTFT p50 "
              f"{ttft['p50']:.2f} ms, p90 {ttft['p90']:.2f}, p99 {ttft['p99']:.2f}; above the floor "
              f"{m['above_http_floor_p50_ms']:.2f} ms; gateway-side mean {m['gateway_ttft_mean_ms']:.2f} ms")
        print("  CPU ms per request: " + ", ".join(f"{k} {v:.2f}" for k, v in m["cpu_ms_per_request"].items() if v))
    gateway_above = modes["gateway"]["above_http_floor_p50_ms"]
    print(f"gateway + NATS + conductor add {ours['above_http_floor_p50_ms']:.2f} ms at p50 above the floor "
          f"(goal <= {GOAL_P50_MS} ms: {'met' if result['meets_goal'] else 'NOT met'}); "
          f"{ours['above_http_floor_p50_ms'] / gateway_above:.2f}x of --dispatch gateway -> {args.out}")


if __name__ == "__main__":
    main()
