"""Single-core throughput of kvcentric.core.hashing (tokens/s per algorithm) vs a cbor2 sha256_cbor reference.

Usage: PYTHONPATH=libs python -m bench.sim.bench_hashing [--tokens 32768] [--block-size 16] [--repeat 7]
Writes bench/results/hashing.json and prints a table.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import random
import time

import cbor2

from kvcentric.core.hashing import HASH_ALGOS, NONE_HASH, BlockHasher
from bench import harness

RESULTS = harness.RESULTS / "hashing.json"
TARGET_TOKENS_PER_S = 2_000_000


def cbor2_reference(token_ids: list[int], block_size: int) -> list[bytes]:
    """vLLM-style sha256_cbor chain using cbor2 (the slow baseline)."""
    parent, out = NONE_HASH, []
    for i in range(0, len(token_ids) // block_size * block_size, block_size):
        payload = (parent, tuple(token_ids[i : i + block_size]), None)
        parent = hashlib.sha256(cbor2.dumps(payload, canonical=True)).digest()
        out.append(parent)
    return out


def best_time(fn, repeat: int) -> float:
    """Best wall time of ``repeat`` calls (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def run(n_tokens: int, block_size: int, repeat: int, vocab: int) -> dict:
    rng = random.Random(0)
    tokens = [rng.randrange(vocab) for _ in range(n_tokens)]
    results = {}
    for algo in HASH_ALGOS:
        hasher = BlockHasher(algo, block_size)
        results[algo] = n_tokens / best_time(functools.partial(hasher.hash_blocks, tokens), repeat)
    baseline = n_tokens / best_time(lambda: cbor2_reference(tokens, block_size), max(1, repeat // 2))
    assert cbor2_reference(tokens, block_size) == BlockHasher("sha256_cbor", block_size).hash_blocks(tokens)
    return {
        "config": {"tokens": n_tokens, "block_size": block_size, "vocab": vocab, "repeat": repeat},
        "machine": harness.machine(),
        "tokens_per_s": {a: round(v) for a, v in results.items()},
        "baseline_cbor2_sha256_cbor_tokens_per_s": round(baseline),
        "ratio_sha256_cbor_vs_cbor2": harness.ratio(results["sha256_cbor"], baseline, 2),
        "target_tokens_per_s": TARGET_TOKENS_PER_S,
        "all_meet_target": all(v >= TARGET_TOKENS_PER_S for v in results.values()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32_768)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--vocab", type=int, default=128_256, help="token ids drawn from [0, vocab)")
    args = ap.parse_args()
    res = run(args.tokens, args.block_size, args.repeat, args.vocab)
    harness.write(RESULTS, res, indent=2)
    base = res["baseline_cbor2_sha256_cbor_tokens_per_s"]
    print(f"{'algo':<22}{'tokens/s':>14}{'vs cbor2':>10}")
    for algo, tps in res["tokens_per_s"].items():
        print(f"{algo:<22}{tps:>14,}{tps / base:>9.1f}x")
    print(f"{'cbor2 reference':<22}{base:>14,}{1:>9.1f}x")
    print(f"target {TARGET_TOKENS_PER_S:,} tokens/s met by all: {res['all_meet_target']}  -> {RESULTS}")


if __name__ == "__main__":
    main()
