"""Placement throughput of the Conductor core on one core: 16 prefill + 16 decode instances, the whole
conversation trace, block locations from an in-memory index (kvs-meta's answer without the network).

Usage: .venv/bin/python -m bench.sim.bench_conductor [--prefill 16] [--decode 16] [--repeat 3]
Writes bench/results/conductor.json and prints a table. Timed: prefix matching plus the decision
(`PrefixIndex.match` + `Conductor.schedule`); not timed: storing the placed blocks in the index and
the load reports (one per instance every 0.5 s of trace time), which are the environment's work.
"""

from __future__ import annotations

import argparse
import time

from kvcentric.core.costmodel import CostModel, hardware
from kvcentric.model.config import preset
from kvcentric.core.protocol import LoadReport, Placement, ScheduleRequest
from kvcentric.core.scheduling.conductor import Conductor
from kvcentric.core.scheduling.config import SchedulerConfig
from kvcentric.core.scheduling.prefix import PrefixIndex
from kvcentric.tools.sim import DEFAULT_TRACE
from kvcentric.core.sim.workload import load_trace
from bench import harness

RESULTS = harness.RESULTS / "conductor.json"
TARGET_RPS = 20_000


def reports(prefills: int, decodes: int, now: float) -> list[LoadReport]:
    idle = [LoadReport(instance_id=f"p{i}", role="prefill", cluster="bench", kv_addr=f"p{i}:1", queued_requests=0,
                       queued_tokens=0, running=0, kv_blocks_total=0, kv_blocks_free=0, ts=now, est_queue_s=0.0)
            for i in range(prefills)]
    return idle + [LoadReport(instance_id=f"d{i}", role="decode", cluster="bench", kv_addr=f"d{i}:1", queued_requests=0,
                              queued_tokens=0, running=4, kv_blocks_total=3000, kv_blocks_free=2000, ts=now)
                   for i in range(decodes)]


def run_once(requests, policy: str, rejection: str, prefills: int, decodes: int) -> dict:
    cost = CostModel.roofline(preset("llama2-70b"), hardware("8xA800-800gbps"))
    config = SchedulerConfig(policy=policy, rejection=rejection, block_size=512, link_gbps=800)
    conductor, index = Conductor(config, cost, stale_after_s=float("inf")), PrefixIndex()
    schedule_requests = [ScheduleRequest(request_id=r.request_id, n_tokens=r.input_len, block_hashes=r.hashes,
                                         max_tokens=r.output_len) for r in requests]
    next_report, timed, placed = 0.0, 0.0, 0
    for request, arrival in zip(schedule_requests, (r.arrival_s for r in requests)):
        if arrival >= next_report:
            for report in reports(prefills, decodes, arrival):
                conductor.observe(report, arrival)
            next_report = arrival + 0.5
        started = time.perf_counter()
        hits = index.match(request.block_hashes)
        decision = conductor.schedule(request, hits, arrival)
        timed += time.perf_counter() - started
        if isinstance(decision, Placement):
            placed += 1
            index.add(decision.prefill_id, request.block_hashes)
    return {"seconds": timed, "requests_per_s": len(requests) / timed, "placed": placed,
            "pulls": conductor.stats["pulls"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default=DEFAULT_TRACE)
    parser.add_argument("--prefill", type=int, default=16)
    parser.add_argument("--decode", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    requests = load_trace(args.trace)
    rows = {}
    for policy, rejection in (("kvcentric", "early"), ("kvcentric", "predictive"), ("cache_aware", "early"),
                              ("llumnix", "early"), ("load_balance", "early"), ("random", "never")):
        best = max((run_once(requests, policy, rejection, args.prefill, args.decode) for _ in range(args.repeat)),
                   key=lambda r: r["requests_per_s"])
        rows[f"{policy}/{rejection}"] = best
        print(f"{policy:>12}/{rejection:<10} {best['requests_per_s']:>9,.0f} requests/s  "
              f"({best['placed']} placed, {best['pulls']} pulls)")
    result = {"benchmark": "conductor placement throughput", "requests": len(requests), "prefill": args.prefill,
              "decode": args.decode, "target_requests_per_s": TARGET_RPS, "results": rows,
              "machine": harness.machine()}
    harness.write(RESULTS, result, indent=2)
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
