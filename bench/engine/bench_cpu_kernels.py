"""The CPU kernels of `engine/model/kernels` against what torch does without them, built for one instruction set
(`--isa`: native, avx512, avx2, portable, or all those this CPU runs, one after another), torch held to the same
set (`kernels.capped_env`: the script runs itself again in a process with that environment, as torch picks its
kernels when it is imported). At the shapes of `small` (hidden 512, 8 heads, 4 KV heads of 64, SwiGLU 1408) and
`medium` (the 136M Llama: hidden 1024, 16 heads, 4 KV heads, SwiGLU 2816), fp32, on 2 threads and on 1:

- the small GEMM of each linear layer (q|k|v, o, gate|up, down) at 1 to 128 rows against F.linear (MKL) and
  oneDNN's GEMM on the blocked weight the engine packs (`gemm.pack_weight`), each weight copied to 64 MB or more
  and the copies taken in turn, so they stream from memory as a decode step's do;
- decode attention over the paged cache (its KV in cache, and the KV of the model's layers taken in turn) against
  gathering the blocks for SDPA; prefill of whole prompts against causal SDPA per prompt;
- SwiGLU's silu x up, rotary + cache write and RMSNorm against torch's ops.

Each figure is the least of interleaved calls (`--repeat`, within a time budget each): wall time on 2 threads,
the thread's CPU time on 1 (a crowded 2-core machine deschedules it, and CPU time leaves that out). The ratios
are kernel / torch time: under 1, the kernel is faster. JSON in bench/results/cpu_kernels_<isa>.json.

    .venv/bin/python -m bench.engine.bench_cpu_kernels --isa all
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F


from kvcentric.engine.model import kernels
from kvcentric.engine.model.kernels.isas import ISAS, TORCH_CAPS
from kvcentric.engine.model.batch import AttentionBatch, gather_blocks
from kvcentric.engine.model.gemm import linear, pack_weight, projection_shapes
from kvcentric.engine.model.llama import Rotary
from kvcentric.model.config import ModelConfig, preset
from bench import harness

RESULTS = harness.RESULTS
GEMM_ROWS = (1, 2, 4, 8, 16, 32, 64, 128)
STREAMED_BYTES = 64 << 20  # each weight copied to at least this much, more than the last-level cache
Timed = Callable[[], object]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--isa", choices=(*ISAS, "all"), default="native",
                        help="instruction set of the kernels and of torch (all: each this CPU runs)")
    parser.add_argument("--models", nargs="+", default=["small", "medium"])
    parser.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    parser.add_argument("--repeat", type=int, default=30, help="calls of each (at most)")
    parser.add_argument("--budget-s", type=float, default=4.0, help="seconds one comparison may take")
    parser.add_argument("--out", help="JSON file (default: bench/results/cpu_kernels_<isa>.json)")
    return parser.parse_args(argv)


@functools.cache
def thread_clock_is_fine(tick_s: float = 1e-5) -> bool:
    """Whether this thread's CPU clock ticks finer than `tick_s`. It does on most kernels (ns), but on some VMs it
    moves in whole scheduler ticks (1-4 ms), where a sub-millisecond call would read 0: the wall clock is then used."""
    steps = []
    last = time.thread_time()
    while len(steps) < 5:
        now = time.thread_time()
        if now != last:
            steps.append(now - last)
            last = now
    return min(steps) < tick_s


def least_ms(fns: dict[str, Timed], threads: int, repeat: int, budget_s: float) -> dict[str, float]:
    """The least time of a call of each, the calls interleaved (one of each a round) until `repeat` rounds or the
    budget is spent (at least three rounds). On a crowded machine a call of two threads waits now and then for a
    thread the scheduler took away (ms, where the call takes us): the least call is the one that did not."""
    clock = time.thread_time if threads == 1 and thread_clock_is_fine() else time.perf_counter
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, math.inf)
    start = time.perf_counter()
    for done in range(repeat):
        for name, fn in fns.items():
            begin = clock()
            fn()
            best[name] = min(best[name], clock() - begin)
        spent = time.perf_counter() - start
        if (done >= 2 and spent > budget_s) or spent > 3 * budget_s:  # the portable build's GEMM: seconds a call
            break
    return {name: round(1e3 * seconds, 6) for name, seconds in best.items()}


def figures(ms: dict[str, float]) -> dict[str, float | None]:
    """The times with each torch way's kernel / torch ratio (under 1: the kernel is faster). A clock too coarse for
    the call (some VMs' thread CPU clock ticks in whole milliseconds, so a 1-row GEMM of `tiny` reads 0) gives no
    ratio (None) rather than a division by zero."""
    return {**ms, **{f"kernel/{name.removesuffix('_ms')}": round(ms["kernel_ms"] / ms[name], 3) if ms[name] else None
                     for name in ms if name != "kernel_ms"}}


def gemm_fns(ops: kernels.CpuLayerOps, x: torch.Tensor, out: int, weights: list[torch.Tensor],
             panels: list[torch.Tensor], blocked: list[torch.Tensor]) -> dict[str, Timed]:
    """x times one weight a call, three ways, each way taking the next copy of the weight at each call (so it
    comes from memory, as in a decode step)."""
    turns = {name: iter(range(1 << 30)) for name in ("kernel", "linear", "onednn")}
    return {"kernel_ms": lambda: ops.small_linear(x, panels[next(turns["kernel"]) % len(panels)], out),
            "F.linear_ms": lambda: F.linear(x, weights[next(turns["linear"]) % len(weights)]),
            "onednn_ms": lambda: linear(x, blocked[next(turns["onednn"]) % len(blocked)])}


def time_gemms(ops: kernels.CpuLayerOps, config: ModelConfig, threads: int, args) -> dict:
    """Each linear layer of `config` at GEMM_ROWS rows: the small GEMM against F.linear and oneDNN."""
    results = {}
    generator = torch.Generator().manual_seed(1)
    names = ("qkv", "o", "gate_up", "down")
    for name, (out, width, _) in zip(names, projection_shapes(config)):
        copies = max(2, math.ceil(STREAMED_BYTES / (4 * out * width)))
        weights = [torch.randn(out, width, generator=generator) * 0.02 for _ in range(copies)]
        blocked = [pack_weight(w, True) for w in weights]
        panels = [ops.pack_panels(w) for w in weights]
        by_rows: dict[str, list[float]] = {}  # a list of GEMM_ROWS's figures each
        for rows in GEMM_ROWS:
            x = torch.randn(rows, width, generator=generator)
            ms = least_ms(gemm_fns(ops, x, out, weights, panels, blocked), threads, max(args.repeat, 3 * copies),
                          args.budget_s)
            for key, value in figures(ms).items():
                by_rows.setdefault(key, []).append(value)
        results[f"{name} {width}->{out}"] = by_rows
        print(f"  {config.name} {name} {width}->{out}, {threads} thread(s): kernel/F.linear "
              + " ".join(f"{rows}:{ratio}" for rows, ratio in zip(GEMM_ROWS, by_rows["kernel/F.linear"])), flush=True)
    return results


def decode_case(config: ModelConfig, batch: int, positions: int, layers: int, block_size: int = 16):
    """q and `layers` caches of `batch` sequences of `positions`, their blocks shuffled over each cache."""
    blocks = (positions + block_size - 1) // block_size
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(batch, config.num_heads, config.head_dim, generator=generator)
    caches = [(torch.randn(batch * blocks * block_size, config.num_kv_heads, config.head_dim, generator=generator),
               torch.randn(batch * blocks * block_size, config.num_kv_heads, config.head_dim, generator=generator))
              for _ in range(layers)]
    tables = torch.randperm(batch * blocks, generator=generator).view(batch, blocks)
    return q, caches, tables, torch.full((batch,), positions)


def decode_fns(kernel: kernels.CpuAttention, config: ModelConfig, batch: int, positions: int,
               layers: int) -> dict[str, Timed]:
    q, caches, tables, lengths = decode_case(config, batch, positions, layers)
    turn = iter(range(1 << 30))
    mask = (torch.arange(tables.shape[1] * 16)[None] < lengths[:, None])[:, None, None]

    def ours():
        k, v = caches[next(turn) % layers]
        kernel.decode(q, k, v, tables, lengths, 16)

    def torchs():
        k, v = caches[next(turn) % layers]
        keys, values = gather_blocks(k, tables, 16), gather_blocks(v, tables, 16)
        F.scaled_dot_product_attention(q[:, :, None], keys, values, attn_mask=mask, enable_gqa=True)

    return {"kernel_ms": ours, "torch_ms": torchs}


def prefill_fns(kernel: kernels.CpuAttention, config: ModelConfig, prompts: int, length: int) -> dict[str, Timed]:
    heads, kv_heads = config.num_heads, config.num_kv_heads
    rows = torch.randn(prompts * length, heads + 2 * kv_heads, config.head_dim)
    q, k, v = rows[:, :heads], rows[:, heads:heads + kv_heads], rows[:, heads + kv_heads:]
    out = torch.empty(q.shape)
    starts, lengths = torch.arange(0, prompts * length, length), torch.full((prompts,), length)

    def torchs():  # as the engine without the kernels: KV heads repeated to the query heads, torch's flash kernel
        for start in range(0, prompts * length, length):
            rows = slice(start, start + length)
            F.scaled_dot_product_attention(q[rows].transpose(0, 1)[None],  # 4-D: what the fused kernel takes
                                           *(t[rows].repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)[None]
                                             for t in (k, v)), is_causal=True)

    return {"kernel_ms": lambda: kernel.prefill(q, k, v, out, starts, lengths), "torch_ms": torchs}


def layer_op_fns(ops: kernels.CpuLayerOps, config: ModelConfig, rows: int) -> dict[str, dict[str, Timed]]:
    gate_up = torch.randn(rows, 2 * config.intermediate_size)

    def torch_swiglu():
        gate, up = gate_up.chunk(2, dim=-1)
        F.silu(gate).mul_(up)

    rotary = Rotary(config)
    rotary.compute_tables(torch.device("cpu"), torch.float32)
    heads, kv_heads = config.num_heads, config.num_kv_heads
    qkv = torch.randn(rows, heads + 2 * kv_heads, config.head_dim)
    positions = torch.arange(rows) % 256
    slots = torch.randperm(4 * rows)[:rows]
    k_cache, v_cache = (torch.zeros(4 * rows, kv_heads, config.head_dim) for _ in range(2))

    def torch_rotary():
        rotated = rotary(qkv[:, :heads + kv_heads], AttentionBatch(positions, slots))
        k_cache.index_copy_(0, slots, rotated[:, heads:])
        v_cache.index_copy_(0, slots, qkv[:, heads + kv_heads:])

    hidden, weight = torch.randn(rows, config.hidden_size), torch.randn(config.hidden_size)
    return {"swiglu": {"kernel_ms": lambda: ops.silu_mul(gate_up), "torch_ms": torch_swiglu},
            "rotary_and_cache_write": {
                "kernel_ms": lambda: ops.rotate_store(qkv, heads, kv_heads, rotary.cos, rotary.sin, positions, slots,
                                                      k_cache, v_cache),
                "torch_ms": torch_rotary},
            "rms_norm": {"kernel_ms": lambda: ops.rms_norm(hidden, weight, 1e-5),
                         "torch_ms": lambda: F.rms_norm(hidden, weight.shape, weight, 1e-5)}}


def time_others(kernel: kernels.CpuAttention, ops: kernels.CpuLayerOps, config: ModelConfig, threads: int,
                args) -> dict:
    cases = {
        "decode, 32 x 288, KV in cache": decode_fns(kernel, config, 32, 288, 1),
        f"decode, 32 x 288, {config.num_layers} layers' KV in turn": decode_fns(kernel, config, 32, 288,
                                                                                 config.num_layers),
        "decode, 1 x 2048": decode_fns(kernel, config, 1, 2048, 1),
        "prefill, 4 prompts x 256": prefill_fns(kernel, config, 4, 256),
        "prefill, one 2048-token prompt": prefill_fns(kernel, config, 1, 2048),
        **{f"{name}, {rows} rows": fns for rows in (32, 2048) for name, fns in layer_op_fns(ops, config, rows).items()},
    }
    results = {}
    for name, fns in cases.items():
        results[name] = figures(least_ms(fns, threads, args.repeat, args.budget_s))
        print(f"  {config.name} {name}, {threads} thread(s): kernel/torch {results[name]['kernel/torch']}", flush=True)
    return results


def rerun_capped(args: argparse.Namespace, argv: list[str]) -> int | None:
    """The exit status of this script run again in a process whose torch is held to args.isa (each ISA in turn for
    `all`), or None where this process already is."""
    if args.isa == "all":
        others = [a for i, a in enumerate(argv) if not a.startswith("--isa") and (i == 0 or argv[i - 1] != "--isa")]
        statuses = [subprocess.run([sys.executable, "-m", __spec__.name, *others, "--isa", name]).returncode
                    for name in kernels.runnable()]
        return max(statuses)
    wanted = kernels.capped_env(args.isa)
    if all(os.environ.get(key) == value for key, value in TORCH_CAPS[args.isa].items()):
        return None
    return subprocess.run([sys.executable, "-m", __spec__.name, *argv], env={**os.environ, **wanted}).returncode


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    status = rerun_capped(args, argv)
    if status is not None:
        raise SystemExit(status)
    kernel = kernels.load(args.isa)
    if kernel is None:
        print("SKIPPED: the CPU kernels cannot be built here (no C++ compiler)")
        return
    ops = kernels.CpuLayerOps(kernel.path)
    print(f"kernels built for {kernel.isa} (--isa {args.isa}), torch's CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}: {kernel.path.name}", flush=True)
    results: dict[str, dict] = {}
    load_before = os.getloadavg()
    for threads in args.threads:
        torch.set_num_threads(threads)
        for name in args.models:
            config = preset(name)
            figures_here = {"gemm": time_gemms(ops, config, threads, args),
                            **time_others(kernel, ops, config, threads, args)}
            results.setdefault(f"{threads} thread(s)", {})[name] = figures_here
    record = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "isa": args.isa, "library": kernel.isa,
              "torch_capability": torch.backends.cpu.get_cpu_capability(),
              "env": {key: os.environ.get(key) for key in kernels.capped_env("portable")},
              "machine": harness.machine(),
              "timing": "least of interleaved calls: wall time on 2 threads, the thread's CPU time on 1; "
                        "kernel/X = kernel time / X's time; gemm figures at gemm_rows rows",
              "load_average": {"before": [round(x, 2) for x in load_before],
                               "after": [round(x, 2) for x in os.getloadavg()]},
              "gemm_rows": list(GEMM_ROWS), "results": results}
    out = Path(args.out or RESULTS / f"cpu_kernels_{args.isa}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(compact_json(record) + "\n")
    print(f"wrote {out}")


def compact_json(record: dict) -> str:
    """JSON with each list of numbers on one line."""
    text = json.dumps(record, indent=1)
    return re.sub(r"\[\s+([^\[\]{}]*?)\s+\]", lambda m: "[" + re.sub(r"\s*\n\s*", " ", m.group(1)) + "]", text)


if __name__ == "__main__":
    main()
