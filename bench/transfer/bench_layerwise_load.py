"""Layer-wise prefix load from the host pool (Mooncake §5.2) against a whole load before the compute, side by side.

Usage:
    .venv/bin/python -m bench.transfer.bench_layerwise_load [--model small] [--prefixes 1024 3072] [--suffix 256]
        [--requests 5] [--threads 1] [--device cpu] [--dtype float32] [--layout block]
        [--out bench/results/layerwise_load.json]

On a GPU machine (bench/engine/gpu_check.sh): `--device cuda --dtype bfloat16 --model llama3-8b`; the host pool is then
pinned and the layer copies run on a side stream.

In one process, two `PrefillEngine`s with the same weights, each with a host pool that holds the prompt's prefix
and a device cache that does not (forgotten after every request with `BlockPool.uncache`): `layerwise` loads the
prefix one layer at a time on a worker while the layers compute (what the engines do by default), `whole` copies
every block before the first layer runs (`--no-layerwise-load`); `--layout layer` gives both a layer-major host
pool (`--host-pool-layout layer`: a layer's rows of consecutive slots are one range, copied without a gather).
Requests alternate between the two, so the VM's drift hits both alike. TTFT is from submit to the first token
(one chunk: the suffix). Also timed, alone: the whole load and the compute of the suffix over a cached prefix.
The physical floor of TTFT is the larger of the two (the load entirely hidden); the whole load's cost is their
sum.

Writes the JSON (machine, per-mode samples, p50s, ratios to the floor and between the modes).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from bench.serving.bench_request_path import log, machine

from kvcentric.core.block_pool import BlockPool
from kvcentric.core.hashing import BlockHasher
from kvcentric.core.protocol import PrefillJob, SamplingParams
from kvcentric.engine.kv.kvpool import HostBlockPool
from kvcentric.engine.cores.prefill import PrefillEngine
from kvcentric.engine.model.runner import ModelRunner
from kvcentric.model.config import preset
from bench import harness

RESULTS = harness.RESULTS
BLOCK = 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small", help="model preset (default: small; prompts up to 4095)")
    parser.add_argument("--prefixes", type=int, nargs="+", default=[1024, 3072], help="prefix lengths in the host pool")
    parser.add_argument("--suffix", type=int, default=256, help="new tokens computed after the prefix")
    parser.add_argument("--requests", type=int, default=5, help="measured requests per prefix and mode")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the compute")
    parser.add_argument("--device", default="cpu", help="torch device: cpu or cuda")
    parser.add_argument("--dtype", default="float32", help="compute and KV dtype: float32 or bfloat16")
    parser.add_argument("--layout", default="block", choices=["block", "layer"], help="the host pool's layout")
    parser.add_argument("--out", default=str(RESULTS / "layerwise_load.json"), help="JSON output path")
    return parser.parse_args(argv)


def make_engine(config, blocks: int, layerwise: bool, device: str, dtype: str, layout: str = "block") -> PrefillEngine:
    runner = ModelRunner(config, blocks, BLOCK, seed=0, dtype=dtype, device=device)
    host = HostBlockPool(4 * blocks, runner.block_bytes, pin_memory=device.startswith("cuda"),  # prefix + suffixes
                         layers=config.num_layers if layout == "layer" else 0)
    return PrefillEngine(runner, BlockPool(blocks, BLOCK), BlockHasher(block_size=BLOCK), chunk_tokens=1 << 16,
                         host=host, layerwise_load=layerwise)


def prefill(engine: PrefillEngine, tokens: list[int], name: str) -> float:
    """Seconds from submit to the first token; afterwards the device cache forgets every block (the host
    pool keeps them), so the next request finds its prefix in the host pool only."""
    job = PrefillJob(request_id=name, token_ids=tokens, sampling=SamplingParams(max_tokens=1, temperature=0.0),
                     decode_id="d", decode_kv_addr="")
    started = time.perf_counter()
    engine.submit(job)
    chunk = engine.schedule()
    assert chunk is not None and chunk.last, "the bench runs each prompt as one chunk"
    engine.execute(chunk)
    ttft = time.perf_counter() - started
    engine.update(chunk)
    engine.finish(chunk.work)
    assert engine.writer is not None
    engine.writer.collect(wait=True)
    engine.pool.uncache(list(range(engine.pool.num_blocks)))
    return ttft


def whole_load_s(engine: PrefillEngine, tokens: list[int], prefix: int) -> float:
    """The whole load alone: the prefix's blocks copied from the host pool into the cache."""
    assert engine.host is not None
    hashes = engine.hashes(tokens)[:prefix // BLOCK]
    blocks = engine.pool.allocate(len(hashes))
    sync(engine)
    started = time.perf_counter()
    for depth, (block, block_hash) in enumerate(zip(blocks, hashes)):
        engine.runner.write_block(block, engine.host.view(block_hash, depth))
    sync(engine)
    spent = time.perf_counter() - started
    engine.pool.free(blocks)
    return spent


def loader_s(engine: PrefillEngine, tokens: list[int], prefix: int) -> tuple[float, float]:
    """The layer-wise loader's own work, alone: every layer's `load_host_layer` back to back (how fast the
    worker can feed the compute), and of that the host-side gather of each layer's rows."""
    assert engine.host is not None
    hashes = engine.hashes(tokens)[:prefix // BLOCK]
    slots = [engine.host.slot_of[block_hash] for block_hash in hashes]
    blocks = engine.pool.allocate(len(hashes))
    runner, layers = engine.runner, engine.runner.config.num_layers
    sync(engine)
    started = time.perf_counter()
    for layer in range(layers):
        runner.load_host_layer(layer, engine.host.rows(layers), slots, blocks)
    sync(engine)
    loader = time.perf_counter() - started
    rows = runner.host_rows(engine.host.rows(layers)).flatten(-3)
    index = torch.tensor(slots, dtype=torch.long)
    part = torch.empty((len(slots), 2, rows.shape[-1]), dtype=runner.dtype)
    started = time.perf_counter()
    for layer in range(layers):
        torch.index_select(rows[:, layer], 0, index, out=part)
    gather = time.perf_counter() - started
    engine.pool.free(blocks)
    return loader, gather


def compute_s(engine: PrefillEngine, tokens: list[int], prefix: int) -> float:
    """The suffix alone, its prefix already in the cache (whatever bytes: the time does not depend on them)."""
    blocks = engine.pool.allocate(engine.pool.blocks_for(len(tokens)))
    sync(engine)
    started = time.perf_counter()
    engine.runner.prefill(tokens, blocks, prefix, len(tokens))
    sync(engine)
    spent = time.perf_counter() - started
    engine.pool.free(blocks)
    return spent


def sync(engine: PrefillEngine) -> None:
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize(engine.runner.device)


def bench(args) -> dict:
    torch.set_num_threads(args.threads)
    config = preset(args.model)
    blocks = (max(args.prefixes) + args.suffix) // BLOCK + 8
    engines = {"layerwise": make_engine(config, blocks, True, args.device, args.dtype, args.layout),
               "whole": make_engine(config, blocks, False, args.device, args.dtype, args.layout)}
    rows = []
    for prefix in args.prefixes:
        generator = torch.Generator().manual_seed(prefix)
        head = torch.randint(0, config.vocab_size, (prefix,), generator=generator).tolist()
        for name, engine in engines.items():  # the prefix into the host pool; unmeasured
            prefill(engine, head + [0], f"warm-{name}-{prefix}")
        samples: dict[str, list[float]] = {"layerwise": [], "whole": [], "load": [], "compute": [], "loader": [],
                                           "gather": []}
        for index in range(args.requests):  # a new suffix each time: only the prefix is in the host pool
            tokens = head + torch.randint(0, config.vocab_size, (args.suffix,), generator=generator).tolist()
            order = list(engines.items()) if index % 2 == 0 else list(reversed(engines.items()))
            for name, engine in order:
                samples[name].append(prefill(engine, tokens, f"{name}-{prefix}-{index}"))
            samples["load"].append(whole_load_s(engines["whole"], tokens, prefix))
            samples["compute"].append(compute_s(engines["whole"], tokens, prefix))
            loader, gather = loader_s(engines["whole"], tokens, prefix)
            samples["loader"].append(loader)
            samples["gather"].append(gather)
        p50 = {name: statistics.median(values) for name, values in samples.items()}
        floor = max(p50["load"], p50["compute"])
        row = {"prefix": prefix, "suffix": args.suffix, "samples": samples, "p50_s": p50, "floor_s": floor,
               "layerwise_over_floor": p50["layerwise"] / floor, "whole_over_floor": p50["whole"] / floor,
               "layerwise_over_whole": p50["layerwise"] / p50["whole"]}
        rows.append(row)
        log(f"prefix {prefix}: TTFT p50 layerwise {p50['layerwise'] * 1e3:.1f} ms, whole {p50['whole'] * 1e3:.1f} "
            f"ms (load {p50['load'] * 1e3:.1f} ms + compute {p50['compute'] * 1e3:.1f} ms); layerwise/whole "
            f"{row['layerwise_over_whole']:.2f}, layerwise/floor {row['layerwise_over_floor']:.2f}; the loader alone "
            f"{p50['loader'] * 1e3:.1f} ms, its host gathers {p50['gather'] * 1e3:.1f} ms")
    device = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu"
    return {"machine": machine(), "device": device, "dtype": args.dtype, "model": args.model, "threads": args.threads,
            "layout": args.layout, "load_average": os.getloadavg(), "rows": rows}


def main() -> int:
    args = parse_args()
    result = bench(args)
    out = harness.write(args.out, result)
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
