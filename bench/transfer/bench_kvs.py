"""kvs-meta benchmarks against real nats-server, redis-server and a `kvcentric kvs-meta` process.

1. Latency of one batch query of 64 block hashes over NATS (`kvc.kvs.query`): p50/p90/p99 (goal p50 <= 1.5 ms),
   beside a bare NATS request/reply to a trivial responder in the same run (the floor).
2. Throughput of key lookups in batches of 1,000 (goal >= 100,000 lookups/s).

Usage: python -m bench.transfer.bench_kvs [--blocks 100000] [--queries 2000]
Writes bench/results/kvs.json and prints the figures.
"""

from __future__ import annotations


import argparse
import asyncio
import random
import statistics
import subprocess
import sys
import time

import nats

from bench.harness import spawn_service

from kvcentric.tools.processes import free_port, nats_server_argv, redis_server_argv, wait_for_port
from kvcentric.core.protocol import BlockStored, KVEventBatch, KVSQuery, KVSReply, Subjects, decode, encode
from bench import harness

RESULTS = harness.RESULTS


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def start_servers() -> tuple[list[subprocess.Popen], str]:
    nats_port, redis_port = free_port(), free_port()
    processes = [subprocess.Popen(nats_server_argv(nats_port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
                 subprocess.Popen(redis_server_argv(redis_port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    wait_for_port("127.0.0.1", nats_port, 10)
    wait_for_port("127.0.0.1", redis_port, 10)
    url = f"nats://127.0.0.1:{nats_port}"
    kvs_meta, _ = spawn_service("kvs-meta", url, "--redis-url", f"redis://127.0.0.1:{redis_port}/0",
                                "--log-level", "warning", quiet=False)
    return processes + [kvs_meta], url


async def populate(nc, blocks: int, nodes: int = 16) -> list[str]:
    hashes = [f"{random.getrandbits(128):032x}" for _ in range(blocks)]
    for start in range(0, blocks, 5000):
        batch = [BlockStored(node_id=f"node-{(start // 5000) % nodes}", block_hashes=hashes[start:start + 5000])]
        await nc.publish(Subjects.kv_events("bench"), encode(KVEventBatch(events=batch)))
    await nc.flush()
    probe = KVSQuery(block_hashes=hashes[-1:])
    for _ in range(200):  # wait until the last batch is in Redis
        if decode((await nc.request(Subjects.KVS_QUERY, encode(probe), timeout=5)).data, KVSReply).holders[0]:
            return hashes
        await asyncio.sleep(0.05)
    raise RuntimeError("the events did not reach Redis")


async def latencies(nc, subject: str, payload_of, count: int) -> list[float]:
    out = []
    for i in range(count):
        payload = payload_of(i)
        started = time.perf_counter()
        await nc.request(subject, payload, timeout=5)
        out.append(time.perf_counter() - started)
    return out


def summary(samples: list[float]) -> dict:
    ordered = sorted(samples)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3  # noqa: E731
    return {"p50_ms": pick(0.5), "p90_ms": pick(0.9), "p99_ms": pick(0.99), "mean_ms": statistics.mean(ordered) * 1e3}


async def run(args) -> dict:
    processes, url = start_servers()
    try:
        nc = await nats.connect(url)
        async def echo(msg) -> None:
            await msg.respond(b"ok")
        await nc.subscribe("bench.echo", cb=echo)
        log(f"populating {args.blocks} block hashes")
        hashes = await populate(nc, args.blocks)
        batch64 = lambda i: encode(KVSQuery(block_hashes=random.sample(hashes, 64)))  # noqa: E731
        await latencies(nc, Subjects.KVS_QUERY, batch64, 100)  # warm-up
        floor = summary(await latencies(nc, "bench.echo", lambda i: b"x", args.queries))
        query = summary(await latencies(nc, Subjects.KVS_QUERY, batch64, args.queries))
        log(f"64-key query p50 {query['p50_ms']:.2f} ms (bare NATS request/reply p50 {floor['p50_ms']:.2f} ms)")
        batch1000 = [encode(KVSQuery(block_hashes=random.sample(hashes, 1000))) for _ in range(50)]
        started = time.perf_counter()
        for payload in batch1000:
            await nc.request(Subjects.KVS_QUERY, payload, timeout=10)
        rate = 50 * 1000 / (time.perf_counter() - started)
        log(f"lookups in batches of 1000: {rate:,.0f}/s")
        await nc.close()
        return {"blocks": args.blocks, "query_64": query, "nats_request_reply_floor": floor,
                "query_64_over_floor_p50": query["p50_ms"] / floor["p50_ms"], "lookups_per_s_batch_1000": rate}
    finally:
        for process in reversed(processes):  # kvs-meta before the servers it uses
            process.terminate()
            process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=100_000)
    parser.add_argument("--queries", type=int, default=2000)
    result = asyncio.run(run(parser.parse_args()))
    harness.write(RESULTS / "kvs.json", result, indent=2)
    print(f"64-key batch query over NATS: p50 {result['query_64']['p50_ms']:.2f} ms (goal <= 1.5), "
          f"bare request/reply {result['nats_request_reply_floor']['p50_ms']:.2f} ms")
    print(f"lookups in batches of 1,000: {result['lookups_per_s_batch_1000']:,.0f}/s (goal >= 100,000)")


if __name__ == "__main__":
    main()
