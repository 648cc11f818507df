"""The device's two ceilings and the engine against them: prefill as a share of matmul peak, decode against the
weight + KV read floor, ours and transformers' in one run.

Usage:
    python3 -m bench.engine.bench_gpu [--model llama3-8b] [--dtype bfloat16] [--device cuda] [--prefill 512 2048 8192]
        [--batches 1 16 64] [--context 1024] [--steps 20] [--no-cuda-graphs] [--eager-too] [--no-transformers]
        [--out bench/results/gpu.json]

On the GPU host (../shared/gpu/README.md): `source .whl/setup.sh && python3 -m bench.engine.bench_gpu`. A CPU smoke
test: `--device cpu --dtype float32 --model tiny --prefill 64 128 --batches 1 4 --context 64 --steps 3`.

In one process, in this order (a section that fails has its error text recorded in the JSON and the run goes
on; the JSON is rewritten after every section, so a run cut off by a time limit keeps what it measured):

1. Ceilings: a size^3 matmul in --dtype (TFLOP/s) and a device-to-device copy (bandwidth counting the bytes read
   and the bytes written), each the median of several repetitions, timed with CUDA events (perf_counter on CPU).
2. kvcentric prefill of one prompt of each --prefill length (`ModelRunner.prefill`, median of --repeat after a
   warm-up). Its share of the matmul peak counts FLOPs = 2 n P L (P: the weights of one layer's projections and
   MLP, L layers) + 2 n^2 H D L (causal attention: QK^T and PV, half of the n x n square each; H heads of D
   dims) + 2 h V (the lm_head, the last row only).
3. kvcentric decode of B sequences (each of --batches) with --context tokens cached each: the cache is zeros and
   the time of a step does not depend on the values, so nothing is prefilled. Median step (synchronized) of
   --steps after --warmup. On CUDA with CUDA graphs (`capture_decode_graphs(max batch)`) unless
   --no-cuda-graphs; with --eager-too again on a runner built with `cuda_graphs=False` (CUDA only). The floor
   of a step reads every weight and every cached token's KV once at the copy bandwidth:
   (num_params x dtype size + B x context x KV bytes per token) / copy bandwidth (16 GB of weights at
   2.92 TB/s: 5.5 ms). It counts the whole embedding table, as the issue's 16 GB does.
4. The same through transformers (`LlamaForCausalLM._from_config`, SDPA, random weights made on the device,
   its default DynamicCache, which grows by concatenation), after the kvcentric runner is freed: prefill
   `model(ids, logits_to_keep=1)`; decode after one B x context prefill, one token per sequence per step.

Writes the JSON (--out, default bench/results/gpu.json) and, beside it with the same stem, the markdown tables
it prints (device named). It does not check results: the weights are random and only times are compared.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import inspect
import math
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvcentric.engine.model.runner import DTYPES, ModelRunner
from kvcentric.model.config import ModelConfig, load_model_config
from bench import harness

RESULTS = harness.RESULTS
BLOCK = 16


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3-8b", help="model preset or checkpoint directory (shape only)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="weights, KV and matmul dtype")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu")
    parser.add_argument("--prefill", type=int, nargs="+", default=[512, 2048, 8192], help="prompt lengths")
    parser.add_argument("--prefill-many", nargs="*", default=["8x512", "4x2048"],
                        help="KxN: K prompts of N tokens in one pass (prefill_many)")
    parser.add_argument("--prefix-chunks", nargs="*", default=["6144:2048"],
                        help="M:C: a chunk of C tokens after a cached prefix of M (a long prompt's later chunk)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64], help="decode batch sizes")
    parser.add_argument("--context", type=int, default=1024, help="tokens cached per decoding sequence")
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps per batch")
    parser.add_argument("--warmup", type=int, default=3, help="untimed decode steps before them")
    parser.add_argument("--repeat", type=int, default=3, help="timed prefills per length (after one warm-up)")
    parser.add_argument("--matmul-size", type=int, default=None, help="n of the n^3 matmul (8192; 512 on CPU)")
    parser.add_argument("--copy-mb", type=int, default=None, help="MiB copied device to device (1024; 64 on CPU)")
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                        help="decode through CUDA graphs (ignored on CPU)")
    parser.add_argument("--eager-too", action="store_true", help="also time decode without CUDA graphs (CUDA)")
    parser.add_argument("--unfused-too", action="store_true",
                        help="also time decode through graphs with torch's norm, rotary and SwiGLU ops (CUDA)")
    parser.add_argument("--attention-splits", type=int, nargs="*", default=[1, 2, 4, 8, 16],
                        help="CUDA: time the paged decode kernel alone at each batch with these context splits")
    parser.add_argument("--no-transformers", dest="transformers", action="store_false",
                        help="skip the transformers rows")
    parser.add_argument("--out", default=str(RESULTS / "gpu.json"), help="JSON output path (the .md beside it)")
    args = parser.parse_args()
    cpu = not args.device.startswith("cuda")
    args.matmul_size = args.matmul_size or (512 if cpu else 8192)
    args.copy_mb = args.copy_mb or (64 if cpu else 1024)
    return args


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def wall_ms(fn: Callable[[], object], device: str, repeat: int, warmup: int = 1) -> list[float]:
    """Milliseconds of each of `repeat` calls after `warmup` untimed ones, synchronized before and after each."""
    samples = []
    for index in range(warmup + repeat):
        sync(device)
        started = time.perf_counter()
        fn()
        sync(device)
        if index >= warmup:
            samples.append((time.perf_counter() - started) * 1e3)
    return samples


def device_ms(fn: Callable[[], object], device: str, repeat: int = 10, warmup: int = 3) -> list[float]:
    """Milliseconds of each call as the device sees it (CUDA events around it; perf_counter on the CPU)."""
    if not device.startswith("cuda"):
        return wall_ms(fn, device, repeat, warmup)
    for _ in range(warmup):
        fn()
    marks = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeat)]
    for start, end in marks:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in marks]


def ceilings(args: argparse.Namespace) -> dict:
    """Matmul FLOP/s in the dtype and device-to-device copy bandwidth (read + write), medians."""
    n = args.matmul_size
    matmul, copy = matmul_ms(n, args.device, DTYPES[args.dtype]), copy_ms(args.copy_mb << 20, args.device)
    matmul_s, copy_s = statistics.median(matmul) / 1e3, statistics.median(copy) / 1e3
    return {"matmul": {"size": n, "dtype": args.dtype, "samples_ms": matmul, "flops": 2 * n**3 / matmul_s},
            "copy": {"bytes": args.copy_mb << 20, "samples_ms": copy,
                     "bytes_per_s": 2 * (args.copy_mb << 20) / copy_s, "counts": "read + write"}}


def matmul_ms(n: int, device: str, dtype: torch.dtype) -> list[float]:
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    c = torch.empty(n, n, device=device, dtype=dtype)
    return device_ms(lambda: torch.matmul(a, b, out=c), device)


def copy_ms(size: int, device: str) -> list[float]:
    source = torch.ones(size, device=device, dtype=torch.uint8)
    target = torch.empty_like(source)
    return device_ms(lambda: target.copy_(source), device)


def prefill_flops(config: ModelConfig, tokens: int) -> float:
    """2 n P L + 2 n^2 H D L + 2 h V (the module docstring)."""
    c = config
    per_layer = c.hidden_size * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads) \
        + 3 * c.hidden_size * c.intermediate_size
    attention = 2 * tokens**2 * c.num_heads * c.head_dim
    return c.num_layers * (2 * tokens * per_layer + attention) + 2 * c.hidden_size * c.vocab_size


def chunk_flops(config: ModelConfig, prefix: int, tokens: int) -> float:
    """A chunk of `tokens` after `prefix` cached ones: the linear layers of `tokens`, attention of each new row to
    the prefix (4 m c H D: scores and values) and causally within the chunk (2 c^2 H D), one row's logits."""
    c = config
    attention = (4 * prefix * tokens + 2 * tokens**2) * c.num_heads * c.head_dim * c.num_layers
    return prefill_flops(config, tokens) - 2 * tokens**2 * c.num_heads * c.head_dim * c.num_layers + attention


def more_shapes(args: argparse.Namespace) -> list[tuple[int, int, int]]:
    """(prompts, tokens, cached prefix) of each --prefill-many (KxN) and --prefix-chunks (M:C) shape."""
    many = [(int(k), int(n), 0) for k, n in (spec.lower().split("x") for spec in args.prefill_many)]
    return many + [(1, int(c), int(m)) for m, c in (spec.split(":") for spec in args.prefix_chunks)]


def more_prefill_rows(config: ModelConfig, args: argparse.Namespace) -> list[dict]:
    """The --prefill-many and --prefix-chunks shapes, each with its FLOPs."""
    return [{"shape": f"{tokens} after {prefix} cached" if prefix else f"{count} x {tokens} prompts, one pass",
             "prompts": count, "tokens": tokens, "prefix": prefix,
             "flops": chunk_flops(config, prefix, tokens) if prefix else count * prefill_flops(config, tokens)}
            for count, tokens, prefix in more_shapes(args)]


def prefill_blocks(args: argparse.Namespace) -> int:
    """Blocks the largest prompt of any prefill shape needs (all prompts of a pass side by side)."""
    spans = [*args.prefill] + [count * tokens + prefix for count, tokens, prefix in more_shapes(args)]
    return math.ceil(max(spans) / BLOCK)


def block_tables(args: argparse.Namespace) -> tuple[int, list[int], list[list[int]]]:
    """Blocks for one runner, the prefill's table and one decode table per sequence of the largest batch: all
    disjoint."""
    prefill = prefill_blocks(args)
    per_sequence = math.ceil((args.context + args.warmup + args.steps + 1) / BLOCK)
    decode = [list(range(prefill + i * per_sequence, prefill + (i + 1) * per_sequence))
              for i in range(max(args.batches))]
    return prefill + per_sequence * max(args.batches) + 4, list(range(prefill)), decode


def make_runner(config: ModelConfig, blocks: int, args: argparse.Namespace, graphs: bool) -> ModelRunner:
    """A runner on the device; on CUDA without graphs, built with `cuda_graphs=False` where the runner has it."""
    if args.device.startswith("cuda") and not graphs:
        eager: dict[str, Any] = {"cuda_graphs": False}  # a dict: a runner without the argument still type-checks
        try:
            return ModelRunner(config, blocks, BLOCK, seed=0, dtype=args.dtype, device=args.device, **eager)
        except TypeError as error:
            if "cuda_graphs" not in str(error):
                raise
            log("this ModelRunner has no cuda_graphs argument: it is eager anyway")
    return ModelRunner(config, blocks, BLOCK, seed=0, dtype=args.dtype, device=args.device)


def ours_prefill(runner: ModelRunner, table: list[int], args: argparse.Namespace, rows: list[dict]) -> None:
    for row in rows:
        measure(row, "ours", functools.partial(ours_prefill_ms, runner, table, row["tokens"], args))


def ours_prefill_ms(runner: ModelRunner, table: list[int], n: int, args: argparse.Namespace) -> list[float]:
    ids = torch.randint(0, runner.config.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    blocks = table[:math.ceil(n / BLOCK)]
    return wall_ms(lambda: runner.prefill(ids, blocks, 0, n), args.device, args.repeat)


def ours_more_prefill(runner: ModelRunner, table: list[int], args: argparse.Namespace, rows: list[dict]) -> None:
    for row in rows:
        measure(row, "ours", functools.partial(ours_more_prefill_ms, runner, table, row, args))


def ours_more_prefill_ms(runner: ModelRunner, table: list[int], row: dict, args: argparse.Namespace) -> list[float]:
    """K prompts side by side in one pass, or one chunk after its prefix (computed once, untimed, first)."""
    n, prefix = row["tokens"], row["prefix"]
    if prefix:
        ids = torch.randint(0, runner.config.vocab_size, (prefix + n,),
                            generator=torch.Generator().manual_seed(n)).tolist()
        runner.prefill(ids, table, 0, prefix)
        return wall_ms(lambda: runner.prefill(ids, table, prefix, prefix + n), args.device, args.repeat)
    per = math.ceil(n / BLOCK)
    chunks = [(torch.randint(0, runner.config.vocab_size, (n,), generator=torch.Generator().manual_seed(i)).tolist(),
               table[i * per:(i + 1) * per], 0, n) for i in range(row["prompts"])]
    return wall_ms(lambda: runner.prefill_many(chunks), args.device, args.repeat)


def ours_decode(runner: ModelRunner, tables: list[list[int]], args: argparse.Namespace, rows: list[dict],
                key: str) -> None:
    for row in rows:
        measure(row, key, functools.partial(ours_decode_ms, runner, tables[:row["batch"]], args))


def ours_decode_ms(runner: ModelRunner, tables: list[list[int]], args: argparse.Namespace) -> list[float]:
    """One token per sequence per step at positions context, context + 1, ... (--warmup, then --steps timed)."""
    batch = len(tables)
    ids = torch.randint(0, runner.config.vocab_size, (batch,), generator=torch.Generator().manual_seed(batch))
    ids_list, positions = ids.tolist(), iter(range(args.context, args.context + args.warmup + args.steps))

    def step() -> None:
        runner.decode(ids_list, [next(positions)] * batch, tables)

    return wall_ms(step, args.device, args.steps, args.warmup)


def measure(row: dict, key: str, samples_ms: Callable[[], list[float]]) -> None:
    """Fill row[key + "_ms"] (the median) and its samples, or row[key + "_error"]; log either."""
    label = ", ".join(f"{k} {row[k]}" for k in ("tokens", "batch") if k in row)
    failure = None
    try:
        samples = samples_ms()
    except Exception as error:  # an OOM at one size must not lose the others
        failure = f"{type(error).__name__}: {error}"
    if failure is not None:
        row[f"{key}_error"] = failure
        log(f"{key} {label}: failed: {failure}")
        free_memory()  # out of the except block: its traceback no longer holds the failed call's tensors
        return
    row[f"{key}_ms"], row[f"{key}_samples_ms"] = statistics.median(samples), samples
    log(f"{key} {label}: {row[f'{key}_ms']:.2f} ms (median of {len(samples)})")


def hf_model(config: ModelConfig, args: argparse.Namespace) -> Any:
    """transformers' LlamaForCausalLM of the same shape, random weights drawn on the device in the dtype."""
    import transformers

    shape: dict[str, Any] = dict(  # a dict: 5.x's typed LlamaConfig lists neither rope_theta nor attn_implementation
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim,
        max_position_embeddings=config.max_position, rope_theta=config.rope_theta, rms_norm_eps=config.rms_norm_eps,
        tie_word_embeddings=config.tie_word_embeddings, attn_implementation="sdpa")
    hf_config = transformers.LlamaConfig(**shape)
    torch.manual_seed(0)
    dtype = DTYPES[args.dtype]
    with torch.device(args.device):
        try:
            model = transformers.LlamaForCausalLM._from_config(hf_config, dtype=dtype)
        except TypeError:  # an older transformers names it torch_dtype (and passes `dtype` on to __init__)
            model = transformers.LlamaForCausalLM._from_config(hf_config, torch_dtype=dtype)
    return model.eval()


def hf_prefill(model: Any, config: ModelConfig, args: argparse.Namespace, rows: list[dict]) -> None:
    for row in rows:
        measure(row, "transformers", functools.partial(hf_prefill_ms, model, config, args, row["tokens"]))


def hf_prefill_ms(model: Any, config: ModelConfig, args: argparse.Namespace, tokens: int) -> list[float]:
    ids = torch.randint(0, config.vocab_size, (1, tokens), device=args.device)

    def prefill() -> None:
        with torch.inference_mode():
            model(ids, use_cache=True, logits_to_keep=1)

    return wall_ms(prefill, args.device, args.repeat)


def hf_decode(model: Any, config: ModelConfig, args: argparse.Namespace, rows: list[dict]) -> None:
    for row in rows:
        measure(row, "transformers", functools.partial(hf_decode_ms, model, config, args, row["batch"]))


def hf_decode_ms(model: Any, config: ModelConfig, args: argparse.Namespace, batch: int) -> list[float]:
    """One B x context prefill (untimed), then one token per sequence per step over its cache."""
    name = cache_argument(model)
    with torch.inference_mode():
        prompt = torch.randint(0, config.vocab_size, (batch, args.context), device=args.device)
        past = getattr(model(prompt, use_cache=True, logits_to_keep=1), name)
        ids = torch.randint(0, config.vocab_size, (batch, 1), device=args.device)

        def step() -> None:
            nonlocal past
            past = getattr(model(ids, use_cache=True, **{name: past}), name)

        return wall_ms(step, args.device, args.steps, args.warmup)


def cache_argument(model: Any) -> str:
    """The name of the KV cache in the model's forward and its output: `cache` from transformers 5.2x (which
    warns about `past_key_values`), `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def add_ratios(result: dict, config: ModelConfig, args: argparse.Namespace) -> None:
    """Shares of the matmul peak (prefill) and ratios to the read floor (decode), where both sides exist."""
    peak = result["ceilings"].get("matmul", {}).get("flops")
    bandwidth = result["ceilings"].get("copy", {}).get("bytes_per_s")
    for row in result["prefill"] + result.get("prefill_more", []):
        for key in ("ours", "transformers"):
            if f"{key}_ms" in row and peak:
                row[f"{key}_flops"] = row["flops"] / (row[f"{key}_ms"] / 1e3)
                row[f"{key}_share_of_peak"] = row[f"{key}_flops"] / peak
    dtype_size = DTYPES[args.dtype].itemsize
    for row in result["decode"]:
        row["read_bytes"] = config.num_params * dtype_size \
            + row["batch"] * args.context * config.kv_bytes_per_token(dtype_size)
        if bandwidth:
            row["floor_ms"] = row["read_bytes"] / bandwidth * 1e3
        for key in ("ours", "eager", "unfused", "transformers"):
            if f"{key}_ms" in row:
                row[f"{key}_tokens_per_s"] = row["batch"] / (row[f"{key}_ms"] / 1e3)
                if "floor_ms" in row:
                    row[f"{key}_over_floor"] = row[f"{key}_ms"] / row["floor_ms"]


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def transformers_version() -> tuple[str | None, str | None]:
    """(version, None), or (None, why it does not import)."""
    try:
        import transformers
    except Exception as error:  # any import failure: the transformers rows are then skipped, with the reason
        return None, f"{type(error).__name__}: {error}"
    return transformers.__version__, None


def header(args: argparse.Namespace, config: ModelConfig, hf_version: str | None) -> dict:
    return {"device": device_name(args.device), "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "machine": harness.machine(),
            "versions": {"torch": torch.__version__, "cuda": torch.version.cuda, "transformers": hf_version},
            "args": vars(args),
            "model": {"name": config.name, "num_params": config.num_params,
                      "weight_bytes": config.num_params * DTYPES[args.dtype].itemsize,
                      "kv_bytes_per_token": config.kv_bytes_per_token(DTYPES[args.dtype].itemsize)},
            "ceilings": {}, "graphs": False, "errors": {}, "skipped": {}}


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown(result: dict) -> str:
    a, ceil = result["args"], result["ceilings"]
    lines = [f"Device: **{result['device']}**; torch {result['versions']['torch']}, transformers "
             f"{result['versions']['transformers']}; model {a['model']} in {a['dtype']}; {result['date']}.", ""]
    if "matmul" in ceil and "copy" in ceil:
        lines += [f"Ceilings: matmul {ceil['matmul']['size']}^3 {ceil['matmul']['flops'] / 1e12:.1f} TFLOP/s; "
                  f"device-to-device copy {ceil['copy']['bytes_per_s'] / 1e12:.3f} TB/s (read + write).", ""]
    lines += ["| prefill tokens | ours ms | ours TFLOP/s | ours share of peak | transformers ms | transformers share |",
              "|---:|---:|---:|---:|---:|---:|"]
    for r in result["prefill"]:
        lines.append(f"| {r['tokens']} | {fmt(r.get('ours_ms'), '.1f')} | {fmt(_tera(r.get('ours_flops')), '.3g')} "
                     f"| {fmt(r.get('ours_share_of_peak'), '.2f')} | {fmt(r.get('transformers_ms'), '.1f')} "
                     f"| {fmt(r.get('transformers_share_of_peak'), '.2f')} |")
    if result.get("prefill_more"):
        lines += ["", "More prefill shapes (ours):", "", "| shape | ms | TFLOP/s | share of peak |",
                  "|---|---:|---:|---:|"]
        for r in result["prefill_more"]:
            lines.append(f"| {r['shape']} | {fmt(r.get('ours_ms'), '.1f')} | {fmt(_tera(r.get('ours_flops')), '.3g')} "
                         f"| {fmt(r.get('ours_share_of_peak'), '.2f')} |")
    ours = "ours (graphs)" if result.get("graphs") else "ours"
    lines += ["", f"Decode, {a['context']} tokens of context per sequence:", "",
              f"| batch | floor ms | {ours} ms | tokens/s | / floor | eager ms | / floor | transformers ms "
              f"| tokens/s | / floor |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["decode"]:
        lines.append(f"| {r['batch']} | {fmt(r.get('floor_ms'), '.2f')} | {fmt(r.get('ours_ms'), '.2f')} "
                     f"| {fmt(r.get('ours_tokens_per_s'), '.0f')} | {fmt(r.get('ours_over_floor'), '.2f')} "
                     f"| {fmt(r.get('eager_ms'), '.2f')} | {fmt(r.get('eager_over_floor'), '.2f')} "
                     f"| {fmt(r.get('transformers_ms'), '.2f')} | {fmt(r.get('transformers_tokens_per_s'), '.0f')} "
                     f"| {fmt(r.get('transformers_over_floor'), '.2f')} |")
    if any("unfused_ms" in r for r in result["decode"]):
        lines += ["", "Decode through graphs with torch's norm, rotary and SwiGLU ops instead of the fused kernels:",
                  "",
                  "| batch | fused ms | unfused ms | unfused / fused |", "|---:|---:|---:|---:|"]
        for r in result["decode"]:
            ratio = r["unfused_ms"] / r["ours_ms"] if "unfused_ms" in r and "ours_ms" in r else None
            lines.append(f"| {r['batch']} | {fmt(r.get('ours_ms'), '.2f')} | {fmt(r.get('unfused_ms'), '.2f')} "
                         f"| {fmt(ratio, '.2f')} |")
    if result.get("attention"):
        splits = a["attention_splits"]
        lines += ["", f"The paged decode kernel alone, one layer, {a['context']} tokens of context: microseconds "
                      "(share of the copy bandwidth) by context splits; * marks the default:", "",
                  "| batch | " + " | ".join(f"splits {n}" for n in splits) + " |",
                  "|---:|" + "---:|" * len(splits)]
        for r in result["attention"]:
            cells = [f"{fmt(r.get(f'splits_{n}_us'), '.1f')} ({fmt(r.get(f'splits_{n}_of_copy_bandwidth'), '.2f')})"
                     + ("*" if n == r["default_splits"] else "") for n in splits]
            lines.append(f"| {r['batch']} | " + " | ".join(cells) + " |")
    errors = result["errors"] | {f"{k.removesuffix('_error')} prefill {r.get('shape', r['tokens'])}": v
                                 for r in result["prefill"] + result.get("prefill_more", [])
                                 for k, v in r.items() if k.endswith("_error")} \
        | {f"{k.removesuffix('_error')} decode batch {r['batch']}": v for r in result["decode"]
           for k, v in r.items() if k.endswith("_error")}
    lines += [""] + [f"- {name} failed: {text.splitlines()[-1] if text else ''}" for name, text in errors.items()]
    lines += [f"- {name} skipped: {why}" for name, why in result["skipped"].items()]
    return "\n".join(lines).rstrip() + "\n"


def _tera(value: float | None) -> float | None:
    return None if value is None else value / 1e12


class Report:
    """The result being built, rewritten to disk (JSON and markdown) after every section."""

    def __init__(self, result: dict, config: ModelConfig, args: argparse.Namespace) -> None:
        self.result, self.config, self.args = result, config, args
        self.started = time.perf_counter()

    def section(self, name: str, body: Callable[[], object]) -> None:
        log(f"== {name}")
        try:
            body()
        except Exception:  # recorded; the next section still runs
            self.result["errors"][name] = traceback.format_exc()
            log(f"{name} failed: {traceback.format_exc().splitlines()[-1]}")
        free_memory()
        self.save()

    def save(self) -> None:
        self.result["elapsed_s"] = time.perf_counter() - self.started
        add_ratios(self.result, self.config, self.args)
        out = harness.write(self.args.out, self.result)
        out.with_suffix(".md").write_text(markdown(self.result))


def run_ours(report: Report, args: argparse.Namespace) -> None:
    config, result = report.config, report.result
    blocks, prefill_table, decode_tables = block_tables(args)
    cuda = args.device.startswith("cuda")
    state: dict[str, Any] = {}

    def build() -> None:
        started = time.perf_counter()
        state["runner"] = make_runner(config, blocks, args, graphs=args.cuda_graphs)
        result["ours_build_s"] = time.perf_counter() - started
        log(f"runner with {blocks} blocks of {BLOCK} built in {result['ours_build_s']:.1f} s")

    def capture() -> None:
        started = time.perf_counter()
        captured = state["runner"].capture_decode_graphs(max(args.batches))  # False: nothing to capture with
        result["graphs"], result["graph_capture_s"] = captured is not False, time.perf_counter() - started
        log(f"decode graphs {'captured' if result['graphs'] else 'NOT captured'} in {result['graph_capture_s']:.1f} s")

    def eager() -> None:
        state["runner"] = make_runner(config, blocks, args, graphs=False)
        ours_decode(state["runner"], decode_tables, args, result["decode"], "eager")

    def unfused() -> None:
        from kvcentric.engine.model.dispatch import use_ops

        runner = state["runner"] = make_runner(config, blocks, args, graphs=True)
        use_ops(runner.model, None)  # torch's ops; the paged kernel and the graphs stay
        runner.capture_decode_graphs(max(args.batches))
        ours_decode(runner, decode_tables, args, result["decode"], "unfused")

    report.section("kvcentric runner", build)
    if "runner" not in state:
        return
    report.section("kvcentric prefill", lambda: ours_prefill(state["runner"], prefill_table, args, result["prefill"]))
    if result["prefill_more"]:
        report.section("kvcentric prefill, more shapes",
                       lambda: ours_more_prefill(state["runner"], prefill_table, args, result["prefill_more"]))
    if cuda and args.cuda_graphs:  # a failed capture is recorded and the decode below runs eager
        report.section("kvcentric decode graphs", capture)
    report.section("kvcentric decode", lambda: ours_decode(state["runner"], decode_tables, args, result["decode"],
                                                           "ours"))
    state.clear()
    if args.eager_too and not (cuda and args.cuda_graphs):
        result["skipped"]["eager"] = "--eager-too needs CUDA with graphs on: the decode above is eager"
    elif args.eager_too:
        free_memory()
        report.section("kvcentric decode eager", eager)
        state.clear()
    if args.unfused_too and cuda and args.cuda_graphs:
        free_memory()
        report.section("kvcentric decode graphs, torch's small ops", unfused)
        state.clear()


def attention_kernel(report: Report, args: argparse.Namespace) -> None:
    """The paged decode kernel alone on one layer's cache, per batch and context split: its read bandwidth (keys
    and values of every cached token once) against the copy bandwidth."""
    from kvcentric.engine.model.kernels.paged import PagedAttention, splits_for

    config, dtype = report.config, DTYPES[args.dtype]
    bandwidth = report.result["ceilings"].get("copy", {}).get("bytes_per_s")
    rows = report.result["attention"] = []
    per_sequence = math.ceil(args.context / BLOCK)
    for batch in args.batches:
        slots = batch * per_sequence * BLOCK
        k_cache = torch.randn(slots, config.num_kv_heads, config.head_dim, dtype=dtype, device=args.device)
        v_cache = torch.randn_like(k_cache)
        tables = torch.arange(batch * per_sequence, device=args.device).view(batch, per_sequence)
        lengths = torch.full((batch,), args.context, device=args.device)
        q = torch.randn(batch, config.num_heads, config.head_dim, dtype=dtype, device=args.device)
        read = 2 * batch * args.context * config.num_kv_heads * config.head_dim * dtype.itemsize
        row: dict[str, Any] = {"batch": batch, "read_bytes": read, "default_splits": splits_for(batch,
                                                                                              config.num_kv_heads)}
        for splits in args.attention_splits:
            kernel = PagedAttention(splits)
            call = functools.partial(kernel.decode, q, k_cache, v_cache, tables, lengths, BLOCK)
            ms = statistics.median(device_ms(call, args.device, repeat=20))
            row[f"splits_{splits}_us"] = ms * 1e3
            if bandwidth:
                row[f"splits_{splits}_of_copy_bandwidth"] = read / (ms / 1e3) / bandwidth
        log(f"attention batch {batch}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items() if k.endswith("_us")))
        rows.append(row)


def run_transformers(report: Report, args: argparse.Namespace) -> None:
    config, result = report.config, report.result
    state: dict[str, Any] = {}

    def build() -> None:
        started = time.perf_counter()
        state["model"] = hf_model(config, args)
        result["transformers_build_s"] = time.perf_counter() - started
        log(f"transformers model built in {result['transformers_build_s']:.1f} s")

    report.section("transformers model", build)
    if "model" not in state:
        return
    report.section("transformers prefill", lambda: hf_prefill(state["model"], config, args, result["prefill"]))
    report.section("transformers decode", lambda: hf_decode(state["model"], config, args, result["decode"]))
    state.clear()


def main() -> int:
    args = parse_args()
    config = load_model_config(args.model)
    hf_version, hf_missing = transformers_version()
    result = header(args, config, hf_version)
    result["prefill"] = [{"tokens": n, "flops": prefill_flops(config, n)} for n in args.prefill]
    result["prefill_more"] = more_prefill_rows(config, args)
    result["decode"] = [{"batch": b, "context": args.context} for b in args.batches]
    report = Report(result, config, args)
    log(f"{result['device']}: {config.name} in {args.dtype}, prefill {args.prefill}, decode batches {args.batches} "
        f"at context {args.context}")
    report.section("ceilings", lambda: result["ceilings"].update(ceilings(args)))
    if "matmul" in result["ceilings"]:
        c = result["ceilings"]
        log(f"matmul {c['matmul']['flops'] / 1e12:.2f} TFLOP/s, copy {c['copy']['bytes_per_s'] / 1e9:.1f} GB/s")
    if args.device.startswith("cuda") and args.attention_splits:
        report.section("paged attention kernel", lambda: attention_kernel(report, args))
    run_ours(report, args)
    if not args.transformers:
        result["skipped"]["transformers"] = "--no-transformers"
    elif hf_missing:
        result["skipped"]["transformers"] = f"import failed: {hf_missing}"
    else:
        run_transformers(report, args)
    report.save()
    print(markdown(result), flush=True)
    log(f"wrote {args.out} and {Path(args.out).with_suffix('.md')} in {result['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
