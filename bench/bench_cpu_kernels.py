"""The CPU kernels of `engine/kernels` against what torch does without them, one call each at the shapes of the
`small` model (8 query heads, 4 KV heads, head size 64, hidden 512, SwiGLU 1408), fp32, side by side in one
process: decode attention over the paged cache (its KV in cache, and the KV of 8 layers taken in turn, so out
of it, as in the engine) against gathering the blocks for SDPA; prefill of 8 prompts x 256 against causal SDPA
per prompt; RMSNorm, SwiGLU and rotary + cache write against torch's ops; the 32 linear layers of a decode step
(every weight of the 8 layers in turn, as a step reads them) through the small GEMM against oneDNN's GEMM on
the blocked weights the engine packs (`llama.pack_weight`), the "torch" column. Medians of `--repeat` calls; JSON in
bench/results/cpu_kernels.json.

    .venv/bin/python bench/bench_cpu_kernels.py [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "libs"))

from kvcentric.engine import kernels  # noqa: E402
from kvcentric.engine.llama import AttentionBatch, Rotary, gather_blocks, linear, pack_weight  # noqa: E402
from kvcentric.model.config import preset  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--out", default=str(RESULTS / "cpu_kernels.json"))
    return parser.parse_args()


def median_ms(fn, repeat: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(1e3 * statistics.median(times), 3)


def decode_case(batch: int, positions: int, layers: int, block_size: int = 16):
    """q and `layers` caches of `batch` sequences of `positions`, their blocks shuffled over each cache."""
    config = preset("small")
    blocks = (positions + block_size - 1) // block_size
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(batch, config.num_heads, config.head_dim, generator=generator)
    caches = [(torch.randn(batch * blocks * block_size, config.num_kv_heads, config.head_dim, generator=generator),
               torch.randn(batch * blocks * block_size, config.num_kv_heads, config.head_dim, generator=generator))
              for _ in range(layers)]
    tables = torch.randperm(batch * blocks, generator=generator).view(batch, blocks)
    return q, caches, tables, torch.full((batch,), positions)


def time_decode(kernel: kernels.CpuAttention, batch: int, positions: int, layers: int, repeat: int) -> dict:
    q, caches, tables, lengths = decode_case(batch, positions, layers)
    turn = iter(range(1 << 30))
    mask = (torch.arange(tables.shape[1] * 16)[None] < lengths[:, None])[:, None, None]

    def ours():
        k, v = caches[next(turn) % layers]
        kernel.decode(q, k, v, tables, lengths, 16)

    def torchs():
        k, v = caches[next(turn) % layers]
        keys, values = gather_blocks(k, tables, 16), gather_blocks(v, tables, 16)
        F.scaled_dot_product_attention(q[:, :, None], keys, values, attn_mask=mask, enable_gqa=True)

    return {"kernel_ms": median_ms(ours, repeat), "torch_ms": median_ms(torchs, repeat)}


def time_prefill(kernel: kernels.CpuAttention, prompts: int, length: int, repeat: int) -> dict:
    config = preset("small")
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

    return {"kernel_ms": median_ms(lambda: kernel.prefill(q, k, v, out, starts, lengths), repeat),
            "torch_ms": median_ms(torchs, repeat)}


def time_layer_ops(ops: kernels.CpuLayerOps, rows: int, repeat: int) -> dict:
    config = preset("small")
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
    return {"rms_norm": {"kernel_ms": median_ms(lambda: ops.rms_norm(hidden, weight, 1e-5), repeat),
                         "torch_ms": median_ms(lambda: F.rms_norm(hidden, weight.shape, weight, 1e-5), repeat)},
            "swiglu": {"kernel_ms": median_ms(lambda: ops.silu_mul(gate_up), repeat),
                       "torch_ms": median_ms(torch_swiglu, repeat)},
            "rotary_and_cache_write": {
                "kernel_ms": median_ms(lambda: ops.rotate_store(qkv, heads, kv_heads, rotary.cos, rotary.sin,
                                                                positions, slots, k_cache, v_cache), repeat),
                "torch_ms": median_ms(torch_rotary, repeat)}}


def time_decode_linears(ops: kernels.CpuLayerOps, rows: int, repeat: int) -> dict:
    """A decode step's q|k|v, o, gate|up and down projections of all 8 layers of `small` (94 MB of weights, read
    in turn as a step reads them), `rows` rows: the small GEMM's panels against oneDNN's blocked weights."""
    config = preset("small")
    hidden, inner = config.hidden_size, config.intermediate_size
    q_kv = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    shapes = [(q_kv, hidden), (hidden, config.num_heads * config.head_dim), (2 * inner, hidden), (hidden, inner)]
    generator = torch.Generator().manual_seed(1)
    weights = [torch.randn(out, width, generator=generator) * 0.02 for _ in range(config.num_layers)
               for out, width in shapes]
    blocked = [pack_weight(w, True) for w in weights]
    panels = [ops.pack_panels(w) for w in weights]
    inputs = {width: torch.randn(rows, width, generator=generator) for _, width in shapes}

    def onednn():
        for w, b in zip(weights, blocked):
            linear(inputs[w.shape[1]], b)

    def small():
        for w, p in zip(weights, panels):
            ops.small_linear(inputs[w.shape[1]], p, w.shape[0])

    return {"kernel_ms": median_ms(small, repeat), "torch_ms": median_ms(onednn, repeat)}


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    kernel, ops = kernels.load(), kernels.load_layer_ops()
    if kernel is None or ops is None:
        print("SKIPPED: the CPU kernels cannot be built here (no C++ compiler)")
        return
    results = {
        "decode, 32 x 288, KV in cache": time_decode(kernel, 32, 288, 1, args.repeat),
        "decode, 32 x 288, 8 layers' KV in turn": time_decode(kernel, 32, 288, 8, args.repeat),
        "decode, 1 x 2048": time_decode(kernel, 1, 2048, 1, args.repeat),
        "prefill, 8 prompts x 256": time_prefill(kernel, 8, 256, args.repeat),
        "prefill, one 2048-token prompt": time_prefill(kernel, 1, 2048, max(5, args.repeat // 5)),
        **{f"{name}, {rows} rows": figures for rows in (32, 2048)
           for name, figures in time_layer_ops(ops, rows, args.repeat).items()},
        **{f"decode step's linear layers, {rows} rows (torch: oneDNN)": time_decode_linears(ops, rows, args.repeat)
           for rows in (1, 8, 16, 32, 64, 128, 256)},
    }
    for figures in results.values():
        figures["ratio"] = round(figures["torch_ms"] / figures["kernel_ms"], 2)
    record = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "threads": args.threads,
              "machine": {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__},
              "library": kernel.path.name, "results": results}
    print("| one call, `small`, fp32 | torch | kernel | torch / kernel |\n|---|---:|---:|---:|")
    for name, figures in results.items():
        print(f"| {name} | {figures['torch_ms']} ms | {figures['kernel_ms']} ms | {figures['ratio']}x |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
