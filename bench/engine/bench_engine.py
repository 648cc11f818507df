"""Engine benchmarks, each against its baseline in the same run.

1. Prefill FLOP/s of the `small` shape at 1024 tokens, as a ratio to fp32 matmul FLOP/s (goal >= 0.6).
2. 64 requests of mixed lengths (prompts 32-1024, outputs 16-256): our continuous batching (colocated
   engine: chunked prefill + decode batch per step) against `transformers` `generate` with static
   batches of the same size, on the same checkpoint; total wall time (goal: ours >= 1.3x faster).

Usage: python -m bench.engine.bench_engine [--device cpu|cuda] [--requests 64] [--batch 16]
Writes bench/results/engine.json (engine-cuda.json on CUDA) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvcentric.core.block_pool import BlockPool
from kvcentric.engine.cores.colocated import ColocatedEngine
from kvcentric.engine.model.runner import ModelRunner
from kvcentric.core.hashing import BlockHasher
from kvcentric.model.config import load_model_config, preset
from kvcentric.core.protocol import DecodeJob, PrefillJob, SamplingParams
from bench import harness

RESULTS = harness.RESULTS


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def matmul_flops(device: str, dtype: torch.dtype, size: int = 2048, repeat: int = 10) -> float:
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    a @ b
    sync(device)
    start = time.perf_counter()
    for _ in range(repeat):
        a @ b
    sync(device)
    return 2 * size**3 * repeat / (time.perf_counter() - start)


def prefill_flop_count(config, tokens: int) -> float:
    """Matmul FLOPs of one prefill: projections and MLP for every token, causal attention, one lm_head row."""
    c = config
    per_token = 2 * c.hidden_size * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads) \
        + 2 * 3 * c.hidden_size * c.intermediate_size
    attention = 2 * 2 * c.num_heads * c.head_dim * tokens * (tokens + 1) / 2
    return c.num_layers * (per_token * tokens + attention) + 2 * c.hidden_size * c.vocab_size


def bench_prefill(config, device: str, dtype: str, tokens: int = 1024, rounds: int = 5) -> dict:
    """Best of `rounds` for the prefill and for a 2048^3 matmul, interleaved so both see the same machine."""
    runner = ModelRunner(config, tokens // 16 + 8, 16, dtype=dtype, device=device)
    table = list(range(tokens // 16 + 1))
    ids = torch.randint(0, config.vocab_size, (tokens,)).tolist()
    runner.prefill(ids, table, 0)
    seconds, peak = [], []
    for _ in range(rounds):
        sync(device)
        start = time.perf_counter()
        runner.prefill(ids, table, 0)
        sync(device)
        seconds.append(time.perf_counter() - start)
        peak.append(matmul_flops(device, runner.dtype, repeat=5))
    flops = prefill_flop_count(config, tokens) / min(seconds)
    return {"tokens": tokens, "seconds": min(seconds), "flops": flops, "matmul_flops": max(peak),
            "ratio": flops / max(peak)}


def workload(n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([1] + [rng.randrange(3, 250) for _ in range(rng.randint(32, 1024) - 1)], rng.randint(16, 256))
            for _ in range(n)]


def save_small_checkpoint(directory: Path) -> Path:
    import transformers

    c = preset("small")
    config = transformers.LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                                      intermediate_size=c.intermediate_size, num_hidden_layers=c.num_layers,
                                      num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
                                      max_position_embeddings=c.max_position, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    return directory


def run_ours(checkpoint: Path, requests, batch: int, device: str) -> float:
    config = load_model_config(str(checkpoint))
    blocks = sum(len(p) + n for p, n in requests) // 16 + len(requests) + 64
    runner = ModelRunner(config, blocks, 16, device=device)
    engine = ColocatedEngine(runner, BlockPool(blocks, 16), BlockHasher(block_size=16), chunk_tokens=1024,
                             max_batch=batch)
    start = time.perf_counter()
    for i, (prompt, out) in enumerate(requests):
        params = SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True)
        engine.submit(PrefillJob(request_id=f"r{i}", token_ids=prompt, sampling=params, decode_id="",
                                 decode_kv_addr=""),
                      DecodeJob(request_id=f"r{i}", n_prompt_tokens=len(prompt), sampling=params))
    generated = 0
    while engine.has_work:
        generated += sum(len(c.token_ids) for c in engine.step())
    sync(device)
    assert generated == sum(n for _, n in requests), generated
    return time.perf_counter() - start


def run_transformers(checkpoint: Path, requests, batch: int, device: str) -> float:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.float32).to(device).eval()
    start = time.perf_counter()
    for first in range(0, len(requests), batch):
        group = requests[first:first + batch]
        longest = max(len(p) for p, _ in group)
        ids = torch.zeros((len(group), longest), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (prompt, _) in enumerate(group):  # left padding, as batched generation needs
            ids[row, longest - len(prompt):] = torch.tensor(prompt)
            mask[row, longest - len(prompt):] = 1
        new = max(n for _, n in group)  # a static batch runs until its longest output is done
        with torch.no_grad():
            model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=0)
        log(f"  transformers batch {first // batch + 1}/{-(-len(requests) // batch)} done")
    sync(device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--skip-decode", action="store_true", help="only the prefill FLOP/s part")
    args = parser.parse_args()
    log(f"prefill FLOP/s of 'small' at 1024 tokens on {args.device}")
    result = {"device": args.device, "threads": torch.get_num_threads(),
              "prefill": bench_prefill(preset("small"), args.device, "float32")}
    if not args.skip_decode:
        requests = workload(args.requests)
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint = save_small_checkpoint(Path(tmp))
            log(f"{len(requests)} requests, continuous batching (ours), batch {args.batch}")
            ours = run_ours(checkpoint, requests, args.batch, args.device)
            log(f"static batches of {args.batch} with transformers generate")
            theirs = run_transformers(checkpoint, requests, args.batch, args.device)
        result["decode"] = {"measured_at": time.strftime("%Y-%m-%d %H:%M"), "requests": len(requests),
                            "batch": args.batch, "ours_s": ours, "transformers_s": theirs,
                            "ratio": harness.ratio(theirs, ours), "output_tokens": sum(n for _, n in requests),
                            "prompt_tokens": sum(len(p) for p, _ in requests)}
    RESULTS.mkdir(exist_ok=True)
    name = "engine.json" if args.device == "cpu" else f"engine-{args.device.split(':')[0]}.json"
    path = RESULTS / name
    if "decode" not in result and path.exists():  # keep the last decode comparison when it was skipped
        previous = json.loads(path.read_text()).get("decode")
        if previous:
            result["decode"] = previous
    harness.write(path, harness.record("bench_engine", **result), indent=2)
    p = result["prefill"]
    print(f"prefill 1024 tok: {p['flops'] / 1e9:.1f} GFLOP/s vs matmul {p['matmul_flops'] / 1e9:.1f} GFLOP/s "
          f"= {p['ratio']:.2f} (goal >= 0.6)")
    if "decode" in result:
        d = result["decode"]
        print(f"64 mixed requests: ours {d['ours_s']:.1f} s, transformers static batches {d['transformers_s']:.1f} s "
              f"= {d['ratio']:.2f}x (goal >= 1.3)")


if __name__ == "__main__":
    main()
