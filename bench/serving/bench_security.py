"""What security costs (issue 46): the KV transfer over mutual TLS against plaintext gRPC, and the time to first
token of a `kvcentric up --secure` cluster against a plain one, in the same run on the same machine.

Usage:
    .venv/bin/python -m bench.serving.bench_security [--total-mib 128] [--layer-mib 4] [--rounds 3] [--requests 20]
        [--prompt-words 48] [--model tiny] [--skip-ttft] [--out bench/results/security.json]

- kv: `KVPusher(shared_memory=False)` (the transport between hosts) pushes one request of --total-mib in
  --layer-mib layers to a `KVTransferServicer` in another process whose sink copies every byte out, as into a
  paged cache; once over plaintext gRPC, once over mutual TLS (a certificate of a throwaway CA on each side), in
  interleaved rounds. Also the first call on a new channel (the TLS handshake's share) with a 1-layer push.
- ttft: `kvcentric up` (1 prefill + 1 decode, --model) then `kvcentric up --secure` (NATS over TLS with users,
  the KV push over mutual TLS, Redis AUTH, the gateway on HTTPS with an API key), --rounds/2 times each in turn;
  --requests streamed requests one after another, TTFT as the client sees it (request sent to the first token's
  SSE line), on a connection of its own each (a new TLS handshake each for the secured gateway).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import http.client
import json
import multiprocessing as mp
import os
import ssl
import statistics
import sys
import tempfile
import time
import urllib.parse

import numpy as np

from bench.serving.bench_request_path import log, machine
from bench.transfer.bench_same_host import CopySink, grpc_push
from bench.harness import UpProcess

from kvcentric.runtime.security import TransferTls
from kvcentric.runtime.transfer import KVPusher, KVTransferServicer, start_server
from kvcentric.tools import certs
from bench import harness

RESULTS = harness.RESULTS


def throwaway_tls() -> tuple[TransferTls, TransferTls]:
    """A server's and a client's mutual TLS, both signed by one new CA."""
    now = datetime.datetime.now(datetime.UTC)
    ca = certs.new_ca("bench CA", now)
    pair = [certs.issue(ca, name, ["127.0.0.1", "kvcentric-kv"], now) for name in ("receiver", "sender")]
    return tuple(TransferTls(ca.cert_pem, issued.cert_pem, issued.key_pem) for issued in pair)  # type: ignore


def receiver(total: int, tls: TransferTls | None, ready) -> None:
    async def serve() -> None:
        server, port = await start_server(KVTransferServicer(CopySink(total)), "127.0.0.1", 0, tls=tls)
        ready.send(port)
        await server.wait_for_termination()
    asyncio.run(serve())


async def kv_round(modes: dict, source: np.ndarray, layer_bytes: int, small: np.ndarray) -> dict:
    """One push of `source` per mode on a warm channel, and a 1-layer push on a new one."""
    out = {}
    for mode, (addr, tls) in modes.items():
        pusher = KVPusher(shared_memory=False, tls=tls)
        try:
            first = await grpc_push(pusher, addr, small, small.size)  # a new channel: connect (and handshake)
            seconds = await grpc_push(pusher, addr, source, layer_bytes)
        finally:
            await pusher.close()
        out[mode] = {"bytes_s": source.size / seconds, "first_call_s": first}
    return out


def bench_kv(total_mib: int, layer_mib: int, rounds: int) -> dict:
    total, layer_bytes = total_mib << 20, layer_mib << 20
    source = np.random.default_rng(0).integers(0, 256, total, dtype=np.uint8)
    small = source[:64 << 10]
    server_tls, client_tls = throwaway_tls()
    ctx = mp.get_context("spawn")
    modes, processes = {}, []
    for mode, tls in (("plain", None), ("mtls", server_tls)):
        ours, theirs = ctx.Pipe(duplex=False)
        process = ctx.Process(target=receiver, args=(total, tls, theirs), daemon=True)
        process.start()
        processes.append(process)
        modes[mode] = (f"127.0.0.1:{ours.recv()}", client_tls if tls else None)
    try:
        samples: dict[str, dict[str, list[float]]] = {mode: {"bytes_s": [], "first_call_s": []} for mode in modes}
        for index in range(rounds + 1):  # the first round warms both receivers and is not kept
            measured = asyncio.run(kv_round(modes, source, layer_bytes, small))
            if index == 0:
                continue
            for mode, values in measured.items():
                for key, value in values.items():
                    samples[mode][key].append(value)
            log(f"  kv round {index}/{rounds}: " + ", ".join(
                f"{mode} {v['bytes_s'] / 1e9:.2f} GB/s (first call {v['first_call_s'] * 1e3:.1f} ms)"
                for mode, v in measured.items()))
    finally:
        for process in processes:
            process.terminate()
    summary = {mode: {"best_bytes_s": max(s["bytes_s"]), "median_bytes_s": statistics.median(s["bytes_s"]),
                      "median_first_call_s": statistics.median(s["first_call_s"])} for mode, s in samples.items()}
    return {"total_bytes": total, "layer_bytes": layer_bytes, "rounds": samples, "summary": summary,
            "mtls_over_plain_median_bytes_s": summary["mtls"]["median_bytes_s"] / summary["plain"]["median_bytes_s"]}


def first_token_s(url: str, body: bytes, headers: dict, context: ssl.SSLContext | None) -> float:
    """Seconds from sending a streamed request (on a new connection) to its first token's SSE line."""
    parts = urllib.parse.urlsplit(url)
    started = time.perf_counter()
    if parts.scheme == "https":
        connection: http.client.HTTPConnection = http.client.HTTPSConnection(parts.hostname, parts.port,
                                                                             context=context, timeout=120)
    else:
        connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    try:
        connection.request("POST", "/v1/completions", body, headers)
        response = connection.getresponse()
        assert response.status == 200, response.read()
        while True:
            line = response.readline()
            if not line:
                raise RuntimeError("the stream ended before a token")
            if line.startswith(b"data: {"):
                return time.perf_counter() - started
    finally:
        connection.close()


def ttft_run(secure: bool, model: str, requests: int, prompt_words: int) -> list[float]:
    with tempfile.TemporaryDirectory(prefix="bench-security-") as log_dir:
        up = UpProcess(log_dir, "--model", model, "--conductors", "1", *(["--secure"] if secure else []))
        try:
            headers = {"Content-Type": "application/json"}
            context = None
            if secure:
                folder = up.manifest["secure_dir"]
                with open(os.path.join(folder, "api-keys")) as keys:
                    headers["Authorization"] = f"Bearer {keys.readline().strip()}"
                context = ssl.create_default_context(cafile=os.path.join(folder, "ca.pem"))
            times = []
            for index in range(requests + 2):  # the first two warm the path and are not kept
                prompt = f"request {index}: " + " ".join(f"word{(index * 7 + i) % 97}" for i in range(prompt_words))
                body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0,
                                   "stream": True}).encode()
                seconds = first_token_s(up.url, body, headers, context)
                if index >= 2:
                    times.append(seconds)
            return times
        finally:
            up.stop()


def bench_ttft(model: str, requests: int, prompt_words: int, rounds: int) -> dict:
    samples: dict[str, list[float]] = {"plain": [], "secure": []}
    for index in range(rounds):
        for mode in ("plain", "secure"):
            times = ttft_run(mode == "secure", model, requests, prompt_words)
            samples[mode] += times
            log(f"  ttft round {index + 1}/{rounds}, {mode}: median {statistics.median(times) * 1e3:.1f} ms, "
                f"p90 {np.percentile(times, 90) * 1e3:.1f} ms")
    summary = {mode: {"median_s": statistics.median(t), "p90_s": float(np.percentile(t, 90)), "min_s": min(t)}
               for mode, t in samples.items()}
    return {"model": model, "requests_per_round": requests, "prompt_words": prompt_words, "rounds": rounds,
            "samples_s": samples, "summary": summary,
            "secure_minus_plain_median_s": summary["secure"]["median_s"] - summary["plain"]["median_s"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--total-mib", type=int, default=128, help="KV bytes of one pushed request, MiB")
    parser.add_argument("--layer-mib", type=int, default=4, help="bytes per layer message, MiB")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved KV rounds; TTFT: clusters of each kind")
    parser.add_argument("--requests", type=int, default=20, help="measured requests per cluster")
    parser.add_argument("--prompt-words", type=int, default=48, help="words per prompt")
    parser.add_argument("--model", default="tiny", help="model preset of the clusters")
    parser.add_argument("--skip-ttft", action="store_true", help="only the KV transfer")
    parser.add_argument("--out", default=str(RESULTS / "security.json"), help="JSON output path")
    args = parser.parse_args()
    results: dict = {"machine": machine(), "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                     "load_average_at_start": os.getloadavg()}
    log(f"KV transfer, {args.total_mib} MiB in {args.layer_mib} MiB layers, plaintext vs mutual TLS")
    results["kv"] = bench_kv(args.total_mib, args.layer_mib, args.rounds)
    if not args.skip_ttft:
        log(f"TTFT, kvcentric up vs kvcentric up --secure ({args.model}, {args.requests} requests each)")
        results["ttft"] = bench_ttft(args.model, args.requests, args.prompt_words, max(1, args.rounds // 2 + 1))
    results["load_average_at_end"] = os.getloadavg()  # a shared box: other work running shows here
    harness.write(args.out, results, indent=2)
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
