"""`kvcentric profile`: time the real model on this hardware and fit the Conductor's cost model.

Prefill is timed over a grid of (new tokens x cached prefix), decode steps over (batch x context);
`CostModel.fit` turns the samples into T_prefill(n_new, n_cached) and T_decode(batch, kv_tokens), and
the fit error is printed. It measures; the Conductor and the simulator use the result.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time

import torch

from kvcentric.core.costmodel import CostModel
from kvcentric.core.block_pool import BlockPool
from kvcentric.engine.config import ProfileConfig
from kvcentric.engine.model.runner import ModelRunner
from kvcentric.model.config import load_model_config


def prefill_grid(limit: int) -> list[tuple[int, int]]:
    """(new, cached) pairs: new tokens doubling from 16, cached prefixes of 0, 1/4 and 1/2 of the limit."""
    sizes = [16 << i for i in range(12) if 16 << i <= limit]
    return [(new, cached) for cached in (0, limit // 4, limit // 2) for new in sizes if new + cached <= limit]


def decode_grid(limit: int) -> list[tuple[int, int]]:
    contexts = [c for c in (32, 128, 512, 2048) if c < limit]
    return [(batch, context) for batch in (1, 4, 16, 32) for context in contexts]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn, repeat: int, device: torch.device) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        _synchronize(device)
        start = time.perf_counter()
        fn()
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def time_prefill(runner: ModelRunner, table: list[int], new: int, cached: int, repeat: int) -> float:
    tokens = torch.randint(0, runner.config.vocab_size, (new + cached,)).tolist()
    if cached:
        runner.prefill(tokens, table, 0, cached)
    return _median_time(lambda: runner.prefill(tokens, table, cached), repeat, runner.device)


def time_decode(runner: ModelRunner, pool: BlockPool, batch: int, context: int, repeat: int) -> float:
    tables = [pool.allocate(pool.blocks_for(context + 1)) for _ in range(batch)]
    try:
        tokens = [1] * batch
        return _median_time(lambda: runner.decode(tokens, [context] * batch, tables), repeat, runner.device)
    finally:
        for table in tables:
            pool.free(table)


def progress(done: int, total: int, label: str) -> None:
    width = 30
    filled = width * done // total
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label:<32}")
    sys.stderr.flush()


def run_profile(config: ProfileConfig) -> dict:
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    model = load_model_config(config.model)
    limit = min(config.max_tokens, model.max_position - 1)
    blocks = (limit + 1) * 32 // config.block_size + 64
    runner = ModelRunner(model, blocks, config.block_size, dtype=config.dtype, device=config.device,
                         cpu_kernels=config.cpu_kernels)
    pool = BlockPool(blocks, config.block_size)
    table = pool.allocate(pool.blocks_for(limit))
    points = [("prefill", p) for p in prefill_grid(limit)] + [("decode", d) for d in decode_grid(limit)]
    prefill, decode = [], []
    for index, (kind, (a, b)) in enumerate(points):
        progress(index, len(points), f"{kind} {a} x {b}")
        if kind == "prefill":
            prefill.append((a, b, time_prefill(runner, table, a, b, config.repeat)))
        else:
            decode.append((a, a * b, time_decode(runner, pool, a, b, config.repeat)))
    progress(len(points), len(points), "fitting")
    sys.stderr.write("\n")
    cost, errors = CostModel.fit(prefill, decode, model.kv_bytes_per_token(runner.k_cache.element_size()))
    cost = dataclasses.replace(cost, source=f"profile:{model.name}@{config.device}")
    return {"cost_model": cost.to_dict(), "fit_error": errors, "model": model.name, "device": config.device,
            "dtype": config.dtype, "threads": torch.get_num_threads(),
            "samples": {"prefill": prefill, "decode": decode}}


def main(config: ProfileConfig) -> int:
    result = run_profile(config)
    with open(config.out, "w") as out:
        json.dump(result, out, indent=2)
    p0, p1, p2, p3 = result["cost_model"]["prefill"]
    d0, d1, d2 = result["cost_model"]["decode"]
    print(f"T_prefill(n, c) = {p0:.3g} + {p1:.3g}*n + {p2:.3g}*n*c + {p3:.3g}*n^2  s")
    print(f"T_decode(b, k)  = {d0:.3g} + {d1:.3g}*b + {d2:.3g}*k  s")
    print(f"fit error: {json.dumps(result['fit_error'])}")
    print(f"wrote {config.out}")
    return 0
