"""Workloads for the simulator: Mooncake JSONL traces replayed at a speed, or Poisson arrivals with given
lengths and cache ratio; it builds request lists and runs nothing.

Trace format (Mooncake §4, `shared/traces/README.md`): one JSON object per line with `timestamp` (ms),
`input_length`, `output_length` and `hash_ids`, one prefix-hash id per 512-token block.
"""

from __future__ import annotations

import dataclasses
import math
import random
from pathlib import Path

import msgspec


@dataclasses.dataclass(slots=True)
class SimRequest:
    request_id: str
    arrival_s: float
    input_len: int
    output_len: int
    hashes: list[str]
    """Prefix-hash keys of the request's blocks (trace ids as strings), one per block, partial last included."""
    priority: int = 0


class _TraceLine(msgspec.Struct):
    timestamp: int
    input_length: int
    output_length: int
    hash_ids: list[int]


def load_trace(path: str | Path, speed: float = 1.0, limit: int = 0) -> list[SimRequest]:
    """Requests of a Mooncake JSONL trace; arrival times divided by `speed`, the first `limit` only if > 0."""
    if speed <= 0:
        raise ValueError(f"--speed must be positive, got {speed}")
    decoder = msgspec.json.Decoder(_TraceLine)
    names: dict[int, str] = {}
    requests = []
    with open(path, "rb") as lines:
        for index, line in enumerate(lines):
            if limit and index >= limit:
                break
            if not line.strip():
                continue
            try:
                item = decoder.decode(line)
            except msgspec.DecodeError as exc:
                raise ValueError(f"{path}:{index + 1}: not a trace line: {exc}") from None
            hashes = [names.get(h) or names.setdefault(h, str(h)) for h in item.hash_ids]
            requests.append(SimRequest(f"r{index}", item.timestamp / 1000.0 / speed, item.input_length,
                                       max(1, item.output_length), hashes))
    requests.sort(key=lambda r: r.arrival_s)
    return requests


def poisson_workload(rps: float, num_requests: int, input_len: int, output_len: int, cache_ratio: float,
                     block_tokens: int = 512, prefixes: int = 16, seed: int = 0) -> list[SimRequest]:
    """Poisson arrivals at `rps`; each request's first `cache_ratio` of blocks is one of `prefixes` shared
    prefixes (chosen uniformly), the rest is unique to it, so after warm-up about `cache_ratio` of the
    blocks can be served from cache."""
    if rps <= 0 or num_requests < 1 or input_len < 1 or output_len < 1 or not 0 <= cache_ratio <= 1:
        raise ValueError("need rps > 0, num_requests >= 1, lengths >= 1 and 0 <= cache_ratio <= 1")
    rng = random.Random(seed)
    blocks = math.ceil(input_len / block_tokens)
    shared = int(cache_ratio * blocks)
    now, requests = 0.0, []
    for index in range(num_requests):
        prefix = rng.randrange(prefixes)
        hashes = [f"p{prefix}.{b}" for b in range(shared)] + [f"u{index}.{b}" for b in range(shared, blocks)]
        requests.append(SimRequest(f"r{index}", now, input_len, output_len, hashes))
        now += rng.expovariate(rps)
    return requests
