"""KV transports side by side (`--kv-transport`): GB/s of one request's push per transport and size, against
this machine's memory copy, and the layer-wise prefix load against a whole load with both host-pool layouts.

Usage:
    .venv/bin/python -m bench.transfer.bench_kv_transport [--sizes-mib 1 16 64 256] [--layers 32] [--rounds 3]
        [--model small] [--prefixes 1024 3072] [--requests 3] [--out bench/results/kv_transport.json]

Transports, each from the same source buffer in this process to a `KVTransferServicer` in another process whose
sink copies every layer into one destination buffer (as into a paged cache), CRC-32C checked there as always:
- grpc: the layers' bytes on the gRPC stream over loopback TCP (`--kv-transport grpc`);
- shm: the layers' bytes through a reused shared-memory segment, the stream carrying where they lie (`shm`);
- mooncake: the layers' bytes read by the receiver from the sender's registered memory over Mooncake's Transfer
  Engine on its TCP transport (`mooncake`; only where `mooncake.engine` imports, else listed as absent);
- memcpy: one `numpy.copyto` of the same bytes in one process, the ceiling of any of them here.
A push of S MiB is `--layers` layers of S/layers each, as a model's request. Rounds interleave the transports.

Then `bench_layerwise_load.bench` on the CPU with a block-major and a layer-major host pool.

GPU figures (cuda-ipc, layer-wise loads on CUDA) are not taken here: run them on a GPU machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from bench import harness
from bench.serving.bench_request_path import log
from bench.transfer import bench_layerwise_load
from bench.transfer.bench_same_host import CopySink, grpc_push, memcpy_seconds

from kvcentric.runtime import mooncake  # noqa: E402
from kvcentric.runtime.transfer import KVPusher, KVTransferServicer, start_server  # noqa: E402

RESULTS = harness.RESULTS
MOONCAKE_LANDING_MIB = 64


def receiver(total: int, with_mooncake: bool, ready) -> None:
    async def serve() -> None:
        parts = mooncake.open_mooncake("127.0.0.1", MOONCAKE_LANDING_MIB << 20) if with_mooncake else None
        servicer = KVTransferServicer(CopySink(total), mooncake=parts[1] if parts else None)
        server, port = await start_server(servicer, "127.0.0.1", 0)
        ready.send(port)
        await server.wait_for_termination()
    asyncio.run(serve())


def pushers(total: int, with_mooncake: bool) -> dict[str, KVPusher]:
    made = {"grpc": KVPusher(transport="grpc"), "shm": KVPusher(transport="shm")}
    if with_mooncake:
        parts = mooncake.open_mooncake("127.0.0.1", total)
        if parts is not None:
            made["mooncake"] = KVPusher(transport="mooncake", mooncake=parts[0])
    return made


async def measure(args, addr: str, made: dict[str, KVPusher]) -> dict[str, dict[str, list[float]]]:
    rounds: dict[str, dict[str, list[float]]] = {}
    for size_mib in args.sizes_mib:
        source = np.random.default_rng(size_mib).integers(0, 256, size_mib << 20, dtype=np.uint8)
        layer_bytes = source.size // args.layers
        for pusher in made.values():  # warm-up: connection, the link's choice, first touch
            await grpc_push(pusher, addr, source, layer_bytes)
        row: dict[str, list[float]] = {name: [] for name in [*made, "memcpy"]}
        for _ in range(args.rounds):
            for name, pusher in made.items():
                row[name].append(source.size / 1e9 / await grpc_push(pusher, addr, source, layer_bytes))
            row["memcpy"].append(source.size / 1e9 / memcpy_seconds(source))
            log(f"{size_mib} MiB: " + ", ".join(f"{k} {v[-1]:.2f} GB/s" for k, v in row.items()))
        rounds[f"{size_mib}MiB"] = row
    for name, pusher in made.items():
        link = next(iter(pusher.links.values()))
        assert link.transport == name, f"the {name} pusher went over {link.transport}: {link.reason}"
    return rounds


def summarize(rounds: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, float]]:
    out = {}
    for size, row in rounds.items():
        median = {name: statistics.median(values) for name, values in row.items()}
        out[size] = {**{f"{name}_gb_s": value for name, value in median.items()},
                     **{f"{name}/memcpy": value / median["memcpy"] for name, value in median.items()
                        if name != "memcpy"}}
    return out


def transports(args) -> dict:
    why_not_mooncake = mooncake.available()
    total = max(args.sizes_mib) << 20
    ctx = mp.get_context("spawn")
    ready_recv, ready_send = ctx.Pipe(duplex=False)
    process = ctx.Process(target=receiver, args=(total, not why_not_mooncake, ready_send), daemon=True)
    process.start()
    made = pushers(total, not why_not_mooncake)
    try:
        addr = f"127.0.0.1:{ready_recv.recv()}"
        rounds = asyncio.run(run_and_close(args, addr, made))
    finally:
        process.terminate()
        process.join(5)
    return {"rounds_gb_s": rounds, "summary": summarize(rounds),
            "mooncake": "measured" if "mooncake" in made else f"absent: {why_not_mooncake or 'did not start'}"}


async def run_and_close(args, addr: str, made: dict[str, KVPusher]) -> dict[str, dict[str, list[float]]]:
    try:
        return await measure(args, addr, made)
    finally:  # the pushers' segments are unlinked even on a failed run
        await asyncio.gather(*(pusher.close() for pusher in made.values()))


def layouts(args) -> dict:
    out = {}
    for layout in ("block", "layer"):
        flags = ["--model", args.model, "--prefixes", *map(str, args.prefixes), "--suffix", str(args.suffix),
                 "--requests", str(args.requests), "--layout", layout]
        result = bench_layerwise_load.bench(bench_layerwise_load.parse_args(flags))
        out[layout] = [{key: row[key] for key in ("prefix", "p50_s", "layerwise_over_whole", "layerwise_over_floor")}
                       for row in result["rows"]]
    for block, layer in zip(out["block"], out["layer"]):
        block["loader_layer_over_block"] = layer["p50_s"]["loader"] / block["p50_s"]["loader"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 16, 64, 256], help="push sizes, MiB")
    parser.add_argument("--layers", type=int, default=32, help="layers a push is split into")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per size")
    parser.add_argument("--model", default="small", help="model preset of the prefix-load part")
    parser.add_argument("--prefixes", type=int, nargs="+", default=[1024, 3072], help="prefix lengths loaded")
    parser.add_argument("--suffix", type=int, default=256, help="new tokens after the prefix")
    parser.add_argument("--requests", type=int, default=3, help="measured requests per prefix, mode and layout")
    parser.add_argument("--out", default=str(RESULTS / "kv_transport.json"), help="JSON output path")
    args = parser.parse_args()
    started = time.perf_counter()
    report = {"config": vars(args), "machine": harness.machine(), "load_average_before": os.getloadavg(),
              "transports": transports(args), "prefix_load_cpu": layouts(args),
              "unmeasured": "cuda-ipc and every GPU figure (layer-wise loads on CUDA, 1P+1D TTFT on one GPU)",
              "seconds": 0.0}
    report["seconds"] = time.perf_counter() - started
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    log(f"wrote {out}")
    for size, row in report["transports"]["summary"].items():
        print(f"{size:8} " + "  ".join(f"{k} {v:.3f}" for k, v in row.items()))
    for layout, rows in report["prefix_load_cpu"].items():
        for row in rows:
            print(f"{layout}-major, prefix {row['prefix']}: layerwise/whole {row['layerwise_over_whole']:.2f}, "
                  f"loader {row['p50_s']['loader'] * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
