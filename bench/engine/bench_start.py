"""How long an engine's model takes to build (seeded random weights of a preset), and the host memory it
peaks at, each run in a fresh process (CPU seconds too: on a shared box the wall time says more about
the neighbours): `ModelRunner` with a small KV pool, timed from the call to its
return. A preset cut to --layers layers measures on a box too small for the whole model; the figure for
all the preset's layers is scaled per parameter. Writes bench/results/start.json; asserts nothing.

    .venv/bin/python -m bench.engine.bench_start --model llama2-7b --layers 2 --dtype bfloat16 --label after
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import time
from bench import harness

RESULTS = harness.RESULTS / "start.json"


def measure(model: str, layers: int, dtype: str, device: str) -> dict:
    """In this process: build the runner once; seconds, parameters and the peak RSS it added."""
    import torch

    from kvcentric.engine.model.runner import ModelRunner
    from kvcentric.model.config import preset

    torch.set_num_threads(os.cpu_count() or 1)
    config = preset(model)
    config = dataclasses.replace(config, num_layers=layers or config.num_layers)
    base_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started, cpu_started = time.perf_counter(), time.process_time()
    runner = ModelRunner(config, num_blocks=16, block_size=16, seed=0, dtype=dtype, device=device)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    fused = [(layer.self_attn.qkv[0], layer.mlp.gate_up, layer.self_attn.out and layer.self_attn.out[0],
              layer.mlp.down) for layer in runner.model.layers]  # out and down: packed for oneDNN (or None)
    weights += sum(weight_bytes(t) for group in fused for t in group if t is not None)
    return {"model": model, "layers": config.num_layers, "dtype": dtype, "device": device,
            "params": config.num_params, "seconds": round(seconds, 2),
            "cpu_seconds": round(cpu_seconds, 2),
            "peak_rss_added_gib": round((peak_kib - base_kib) / 2**20, 2), "weights_gib": round(weights / 2**30, 2)}


def weight_bytes(weight) -> int:
    """A fused projection's bytes: both layouts of a CPU fp32 one (`gemm.TwoLayouts`)."""
    from kvcentric.engine.model.gemm import TwoLayouts

    if isinstance(weight, TwoLayouts):
        return weight_bytes(weight.blocked) + weight.panels.numel() * weight.panels.element_size()
    return weight.numel() * weight.element_size()


def scaled(result: dict, model: str) -> dict:
    """The run's seconds per parameter applied to the whole preset."""
    from kvcentric.model.config import preset

    ratio = preset(model).num_params / result["params"]
    return {"full_params": preset(model).num_params, "full_seconds_scaled": round(result["seconds"] * ratio, 1),
            "full_cpu_seconds_scaled": round(result["cpu_seconds"] * ratio, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama2-7b")
    parser.add_argument("--layers", type=int, default=2, help="0: all the preset's layers")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--label", default="", help="name of this run in the results file")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.model, args.layers, args.dtype, args.device)))
        return
    argv = [sys.executable, "-m", __spec__.name, "--child", "--model", args.model, "--layers", str(args.layers),
            "--dtype", args.dtype, "--device", args.device]
    result = json.loads(subprocess.run(argv, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
    result = {**result, **scaled(result, args.model), "machine": harness.machine()}
    print(json.dumps(result, indent=1))
    previous = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    previous[args.label or f"{args.model}-{args.layers}-{args.dtype}-{args.device}"] = result
    harness.write(RESULTS, previous)


if __name__ == "__main__":
    main()
