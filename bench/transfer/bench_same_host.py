"""Same-host KV handoff: loopback gRPC push vs a shared-memory segment, for the same bytes, against this
machine's memcpy (issue 12, item 3: peers on one host may skip the network).

Usage:
    .venv/bin/python -m bench.transfer.bench_same_host [--total-mib 256] [--layer-mib 2 8] [--rounds 3]
        [--out bench/results/same_host.json]

Every path starts from the same source buffer (the sender's KV) and ends with every byte copied into a
destination buffer in the receiving process (the receiver's paged cache), with a CRC-32C computed on each
side as the messenger does:
- grpc: `KVPusher(shared_memory=False)` streams header, layers (key, value, checksum) and commit over
  loopback TCP to a `KVTransferServicer` in another process, whose sink copies each layer into the destination.
- grpc+shm: the same, with `KVPusher`'s default for a peer on this host: the layers' bytes go through a
  reused shared-memory segment and the gRPC stream carries only where they lie (what the engines do).
- shm: the least a shared-memory handoff costs here: one segment (made once, reused), each layer copied into
  it and its offset named over a pipe, the receiver copying it out.
- memcpy: one `numpy.copyto` of the same bytes in one process (the ceiling of any handoff here).
Rounds interleave the paths; the JSON keeps every round, and the summary the best and the median.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import sys
import time
from multiprocessing import shared_memory

import numpy as np

from bench.serving.bench_request_path import log, machine

from kvcentric.proto import kv_pb2
from kvcentric.runtime.kvwire import LayerData
from kvcentric.runtime.transfer import KVPusher, KVTransferServicer, checksum, start_server
from bench import harness

RESULTS = harness.RESULTS


class CopySink:
    """The receiver's sink: every layer copied into one destination buffer, as into a paged cache."""

    copies_bytes = True

    def __init__(self, total: int) -> None:
        self.dest = np.zeros(total, dtype=np.uint8)
        self.offset = 0

    async def begin(self, header) -> None:
        self.offset = 0

    def write(self, request_id: str, chunk: LayerData) -> None:
        for part in (chunk.key, chunk.value):
            size = len(part)
            self.dest[self.offset:self.offset + size] = np.frombuffer(part, dtype=np.uint8)
            self.offset += size

    def commit(self, request_id, commit) -> None: ...
    def abort(self, request_id, reason, retryable=False) -> None: ...


def grpc_receiver(total: int, ready) -> None:
    async def serve() -> None:
        server, port = await start_server(KVTransferServicer(CopySink(total)), "127.0.0.1", 0)
        ready.send(port)
        await server.wait_for_termination()
    asyncio.run(serve())


async def grpc_push(pusher: KVPusher, addr: str, source: np.ndarray, layer_bytes: int) -> float:
    async def items():
        half = layer_bytes // 2  # the header announces the bytes that follow (the segment's size)
        yield kv_pb2.KVHeader(request_id="bench", num_layers=source.size // layer_bytes, num_tokens=1,
                              num_kv_heads=1, head_dim=half // 4, dtype="float32")
        for index, offset in enumerate(range(0, source.size, layer_bytes)):
            key = source[offset:offset + half].tobytes()
            value = source[offset + half:offset + layer_bytes].tobytes()
            yield LayerData(index, 0, 1, key, value, checksum(key, value))
        yield kv_pb2.KVCommit(first_token=0, total_bytes=source.size)
    started = time.perf_counter()
    await pusher.push(addr, items())
    return time.perf_counter() - started


def shm_receiver(total: int, conn) -> None:
    dest = np.zeros(total, dtype=np.uint8)
    segment = shared_memory.SharedMemory(name=conn.recv())
    view = np.ndarray((segment.size,), dtype=np.uint8, buffer=segment.buf)
    while conn.recv() is not None:
        while (layer := conn.recv()) != "commit":
            offset, nbytes, crc = layer
            if checksum(segment.buf[offset:offset + nbytes]) != crc:
                raise ValueError("checksum mismatch")
            dest[offset:offset + nbytes] = view[offset:offset + nbytes]
        conn.send("done")
    del view
    segment.close()


def shm_push(conn, segment, source: np.ndarray, layer_bytes: int) -> float:
    started = time.perf_counter()
    view = np.ndarray((source.size,), dtype=np.uint8, buffer=segment.buf)
    conn.send("push")
    for offset in range(0, source.size, layer_bytes):
        view[offset:offset + layer_bytes] = source[offset:offset + layer_bytes]
        conn.send((offset, layer_bytes, checksum(segment.buf[offset:offset + layer_bytes])))
    conn.send("commit")
    assert conn.recv() == "done"
    return time.perf_counter() - started


def memcpy_seconds(source: np.ndarray) -> float:
    dest = np.zeros_like(source)
    started = time.perf_counter()
    np.copyto(dest, source)
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--total-mib", type=int, default=256, help="bytes of one request's KV, MiB")
    parser.add_argument("--layer-mib", type=int, nargs="+", default=[2, 8], help="bytes per layer message, MiB")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per layer size")
    parser.add_argument("--out", default=str(RESULTS / "same_host.json"), help="JSON output path")
    args = parser.parse_args()
    total = args.total_mib << 20
    source = np.random.default_rng(0).integers(0, 256, total, dtype=np.uint8)
    ctx = mp.get_context("spawn")
    ready_recv, ready_send = ctx.Pipe(duplex=False)
    grpc_process = ctx.Process(target=grpc_receiver, args=(total, ready_send), daemon=True)
    ours, theirs = ctx.Pipe()
    shm_process = ctx.Process(target=shm_receiver, args=(total, theirs), daemon=True)
    grpc_process.start()
    shm_process.start()
    addr = f"127.0.0.1:{ready_recv.recv()}"
    segment = shared_memory.SharedMemory(create=True, size=total)
    ours.send(segment.name)
    rounds: dict[str, dict[str, list[float]]] = {}
    try:
        rounds = asyncio.run(measure(args, addr, ours, segment, source))
    finally:
        ours.send(None)
        grpc_process.terminate()
        shm_process.join(5)
        segment.close()
        segment.unlink()
    report = {"config": vars(args), "machine": machine(), "bytes": total, "rounds_gb_s": rounds,
              "summary": summarize(rounds)}
    harness.write(args.out, report, indent=2)
    log(f"wrote {args.out}")
    for key, row in report["summary"].items():
        print(f"{key:16} " + "  ".join(f"{k} {v:.3f}" for k, v in row.items()))
    return 0


async def measure(args, addr: str, conn, segment, source: np.ndarray) -> dict[str, dict[str, list[float]]]:
    inline, shared = KVPusher(shared_memory=False), KVPusher()
    try:
        return await measure_with(args, addr, conn, segment, source, inline, shared)
    finally:  # unlink the pusher's segments even on a failed run
        await inline.close()
        await shared.close()


async def measure_with(args, addr, conn, segment, source, inline, shared) -> dict[str, dict[str, list[float]]]:
    rounds: dict[str, dict[str, list[float]]] = {}
    gb = source.size / 1e9
    for layer_mib in args.layer_mib:
        layer_bytes = layer_mib << 20
        await grpc_push(inline, addr, source, layer_bytes)  # warm-up: connection, first touch
        await grpc_push(shared, addr, source, layer_bytes)
        shm_push(conn, segment, source, layer_bytes)
        row: dict[str, list[float]] = {"grpc": [], "grpc+shm": [], "shm": [], "memcpy": []}
        for _ in range(args.rounds):
            row["grpc"].append(gb / await grpc_push(inline, addr, source, layer_bytes))
            row["grpc+shm"].append(gb / await grpc_push(shared, addr, source, layer_bytes))
            row["shm"].append(gb / shm_push(conn, segment, source, layer_bytes))
            row["memcpy"].append(gb / memcpy_seconds(source))
            log(f"{layer_mib} MiB layers: " + ", ".join(f"{k} {v[-1]:.2f} GB/s" for k, v in row.items()))
        rounds[f"{layer_mib}MiB"] = row
    assert shared.stats["shm_bytes_sent"] > 0 and inline.stats.get("shm_bytes_sent", 0) == 0
    return rounds


def summarize(rounds: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, float]]:
    out = {}
    for size, row in rounds.items():
        best = {k: max(v) for k, v in row.items()}
        median = {k: statistics.median(v) for k, v in row.items()}
        out[size] = {**{f"{k}_best": v for k, v in best.items()}, **{f"{k}_median": v for k, v in median.items()},
                     "grpc+shm/grpc_median": median["grpc+shm"] / median["grpc"],
                     "shm/grpc_median": median["shm"] / median["grpc"],
                     "grpc/memcpy_median": median["grpc"] / median["memcpy"],
                     "grpc+shm/memcpy_median": median["grpc+shm"] / median["memcpy"]}
    return out


if __name__ == "__main__":
    sys.exit(main())
