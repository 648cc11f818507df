"""The races of the kernel choice (`choice.py`): for a kernel site, the kernel's call and what the engine runs
without it, on made-up tensors of the model's shapes, and the timing of the two side by side.

Each torch side is the engine's own fallback (`gemm.linear`/`linear_add` over the same weight layout, gather +
SDPA, SDPA over the KV heads repeated, `llama.Rotary` and two index copies, torch's RMSNorm and SwiGLU). Weights and
decode KV come in as many copies as a step reads from memory rather than cache (more than the last-level cache
holds, at most one per layer), each call taking the next. It times; it decides nothing.
"""

from __future__ import annotations

import itertools
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.nn.functional as F

from kvcentric.engine.model.batch import AttentionBatch, gather_blocks
from kvcentric.engine.model.gemm import linear, linear_add, pack_weight
from kvcentric.engine.model.llama import Rotary

if TYPE_CHECKING:
    from kvcentric.engine.model.kernels import CpuAttention, CpuLayerOps
    from kvcentric.engine.model.kernels.choice import Site, Target

T = TypeVar("T")
Call = Callable[[], object]
Prepared = Callable[[int], tuple[Call, Call]]
"""rows -> (the kernel's call, torch's) at that row count."""

PAIRS = 16
"""The most samples of each side, interleaved (kernel first, then torch first, ...); the fastest of each is kept."""
MIN_PAIRS = 5
CASE_S = 0.01
"""After MIN_PAIRS, sampling stops once the case has taken this long."""
CLEAR_PAIRS = 3
CLEAR_RATIO = 2.0
"""After CLEAR_PAIRS, sampling stops where one side is this many times as fast as the other."""
SAMPLE_S = 0.0002
"""A sample is one call, or as many calls as take about this long. Short samples: on a loaded machine (a thread of
the team descheduled for a slice of several ms) the fastest of many short ones is one that nothing disturbed."""
COPIES_BYTES = 256 << 20
"""The most memory one site's copies take."""


def race(kernel: Call, torch_op: Call) -> tuple[float, float, bool]:
    """Seconds a call of each takes, the fastest of their samples taken in turn (a burst of load from elsewhere
    slows both sides' samples, not one side's), and whether the machine was quiet for most of them (`crowded`)."""
    started = time.perf_counter()
    calls = (calls_per_sample(kernel), calls_per_sample(torch_op))
    sides, best = (kernel, torch_op), [math.inf, math.inf]
    turns = crowded_turns = 0
    while not settled(turns, time.perf_counter() - started, best[0] / best[1] if turns else 1.0):
        crowded_turns += crowded()
        for side in ((0, 1) if turns % 2 == 0 else (1, 0)):
            best[side] = min(best[side], sample(sides[side], calls[side]))
        turns += 1
    return best[0], best[1], 2 * crowded_turns <= turns


def settled(turns: int, elapsed_s: float, ratio: float) -> bool:
    if turns >= PAIRS or (turns >= MIN_PAIRS and elapsed_s > CASE_S):
        return True
    return turns >= CLEAR_PAIRS and not 1 / CLEAR_RATIO < ratio < CLEAR_RATIO


def calls_per_sample(fn: Call) -> int:
    """Calls in a sample, from the first call's time (which warms up: allocations, oneDNN's primitive for this
    shape; it may overstate a call, so a sample may be shorter than SAMPLE_S)."""
    return max(1, min(1000, int(SAMPLE_S / max(sample(fn, 1), 1e-9))))


def sample(fn: Call, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def crowded() -> bool:
    """More threads want to run now than this process may use cores (Linux's /proc/loadavg; False where it has
    none): a thread of the team may be waiting for one, and a sample taken now says little about the kernel."""
    try:
        with open("/proc/loadavg") as loadavg:
            running = int(loadavg.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return False
    return running > CORES


def prepare(site: Site, target: Target, attention: CpuAttention, ops: CpuLayerOps | None) -> Prepared:
    """The races of one site, its tensors made now (a GEMM's weights) or per row count."""
    if site.kernel == "decode_attention":
        return decode_attention(target, attention)
    if site.kernel == "prefill_attention":
        return prefill_attention(target, attention)
    assert ops is not None, site.kernel
    if site.kernel.startswith("gemm"):
        return gemm(target, ops, *site.shape)
    return {"rms_norm": rms_norm, "silu_mul": silu_mul, "rotate_store": rotate_store}[site.kernel](target, ops)


def noise(*shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
    """Values that look random to a kernel, made at memory speed (a short random run repeated), every page
    written."""
    count = math.prod(shape)
    run = torch.randn(min(count, 1 << 16), generator=torch.Generator().manual_seed(count)) * scale
    return run.repeat(-(-count // run.numel()))[:count].view(shape).to(dtype)


def last_level_cache_bytes() -> int:
    """The largest CPU cache's size (Linux's sysfs; 32 MiB where it does not say)."""
    try:
        caches = Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")
        largest = max(caches, key=lambda cache: int((cache / "level").read_text()))
        size = (largest / "size").read_text().strip()
        return int(size[:-1]) << 10 if size.endswith("K") else int(size)
    except (OSError, ValueError):
        return 32 << 20


def copies(each_bytes: int, layers: int) -> int:
    """How many copies of a tensor each side of a race cycles through: more than the last-level cache holds (a step
    reads its weights and KV from memory), at most one per layer and COPIES_BYTES."""
    wanted = -(-3 * last_level_cache_bytes() // (2 * max(each_bytes, 1)))
    return max(1, min(wanted, layers, COPIES_BYTES // max(each_bytes, 1)))


def cycling(items: list[T]) -> Callable[[], T]:
    turn = itertools.cycle(items)
    return lambda: next(turn)


def gemm(target: Target, ops: CpuLayerOps, out_features: int, in_features: int, residual: int) -> Prepared:
    """The small GEMM over its panels against `gemm.linear` (or `linear_add`) over the engine's weight layout."""
    plain = noise(out_features, in_features, scale=0.02)
    count = copies(plain.numel() * 4, target.config.num_layers)
    first_blocked, first_panels = pack_weight(plain, target.onednn), ops.pack_panels(plain)
    if first_panels is None:  # not a site: `Target.gemm_sites` takes only the shapes it packs
        raise ValueError(f"the small GEMM does not take a [{out_features}, {in_features}] weight")
    blocked = [first_blocked, *(first_blocked.clone() for _ in range(count - 1))]
    panels = [first_panels, *(first_panels.clone() for _ in range(count - 1))]

    def at(rows: int) -> tuple[Call, Call]:
        x = noise(rows, in_features)
        add = noise(rows, out_features) if residual else None
        next_panels, next_blocked = cycling(panels), cycling(blocked)
        if add is None:
            return (lambda: ops.small_linear(x, next_panels(), out_features),
                    lambda: linear(x, next_blocked()))
        return (lambda: ops.small_linear(x, next_panels(), out_features, None, add),
                lambda: linear_add(x, next_blocked(), None, add))

    return at


def decode_attention(target: Target, attention: CpuAttention) -> Prepared:
    """One query row per sequence over its paged KV read in place, against gathering the blocks for masked SDPA."""
    c, block, context = target.config, target.block_size, target.decode_context
    per_row = -(-context // block)

    def at(batch: int) -> tuple[Call, Call]:
        slots = batch * per_row * block
        each = 2 * slots * c.num_kv_heads * c.head_dim * torch.tensor([], dtype=target.dtype).element_size()
        caches = [tuple(noise(slots, c.num_kv_heads, c.head_dim, dtype=target.dtype) for _ in range(2))
                  for _ in range(copies(each, c.num_layers))]
        tables = torch.randperm(batch * per_row, generator=torch.Generator().manual_seed(batch)).view(batch, per_row)
        lengths = torch.full((batch,), context)
        q = noise(batch, c.num_heads, c.head_dim, dtype=target.dtype)
        mask = (torch.arange(per_row * block)[None] < lengths[:, None])[:, None, None, :]
        kernel_cache, torch_cache = cycling(caches), cycling(caches)
        gqa = c.num_heads != c.num_kv_heads

        def kernel() -> object:
            k_cache, v_cache = kernel_cache()
            return attention.decode(q, k_cache, v_cache, tables, lengths, block)

        def torchs() -> object:
            k_cache, v_cache = torch_cache()
            keys, values = gather_blocks(k_cache, tables, block), gather_blocks(v_cache, tables, block)
            return F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask,
                                                  enable_gqa=gqa).squeeze(2)

        return kernel, torchs

    return at


def prefill_attention(target: Target, attention: CpuAttention) -> Prepared:
    """One whole prompt attending causally to itself, against SDPA over its KV heads repeated to the query heads
    (`llama.Attention.heads_first`, what the engine runs)."""
    c = target.config
    heads, kv_heads, dim = c.num_heads, c.num_kv_heads, c.head_dim

    def at(tokens: int) -> tuple[Call, Call]:
        rows = noise(tokens, heads + 2 * kv_heads, dim, dtype=target.dtype)
        q, k, v = rows[:, :heads], rows[:, heads:heads + kv_heads], rows[:, heads + kv_heads:]
        out = torch.empty((tokens, heads, dim), dtype=target.dtype)
        starts, lengths = torch.tensor([0]), torch.tensor([tokens])

        def heads_first(x: torch.Tensor) -> torch.Tensor:
            x = x.view(1, tokens, x.shape[1], dim).transpose(1, 2)
            return x.repeat_interleave(heads // x.shape[1], dim=1) if x.shape[1] != heads else x

        def torchs() -> None:
            attended = F.scaled_dot_product_attention(heads_first(q), heads_first(k), heads_first(v), is_causal=True)
            out[:] = attended.transpose(1, 2).reshape(tokens, heads, dim)

        return (lambda: attention.prefill(q, k, v, out, starts, lengths)), torchs

    return at


def rms_norm(target: Target, ops: CpuLayerOps) -> Prepared:
    c = target.config
    weight = noise(c.hidden_size)

    def at(rows: int) -> tuple[Call, Call]:
        x = noise(rows, c.hidden_size)
        return (lambda: ops.rms_norm(x, weight, c.rms_norm_eps),
                lambda: F.rms_norm(x, weight.shape, weight, c.rms_norm_eps))

    return at


def silu_mul(target: Target, ops: CpuLayerOps) -> Prepared:
    width = target.config.intermediate_size

    def at(rows: int) -> tuple[Call, Call]:
        gate_up = noise(rows, 2 * width)

        def torchs() -> object:
            gate, up = gate_up.chunk(2, dim=-1)
            return F.silu(gate).mul_(up)

        return (lambda: ops.silu_mul(gate_up)), torchs

    return at


def rotate_store(target: Target, ops: CpuLayerOps) -> Prepared:
    """Rotary of q and k with the KV cache write in one pass, against `llama.Rotary` (its tables gathered once per
    step, as every layer after the first has them) and two index copies."""
    c = target.config
    heads, kv_heads = c.num_heads, c.num_kv_heads
    rotary = Rotary(c)
    rotary.compute_tables(torch.device("cpu"), torch.float32)

    def at(rows: int) -> tuple[Call, Call]:
        generator = torch.Generator().manual_seed(rows)
        qkv = noise(rows, heads + 2 * kv_heads, c.head_dim)
        positions = torch.randint(0, c.max_position, (rows,), generator=generator)
        slots = torch.randperm(max(4 * rows, 1024), generator=generator)[:rows]
        k_cache, v_cache = (torch.zeros(max(4 * rows, 1024), kv_heads, c.head_dim) for _ in range(2))
        batch = AttentionBatch(positions, slots)

        def torchs() -> None:
            rotated = rotary(qkv[:, :heads + kv_heads], batch)
            k_cache.index_copy_(0, slots, rotated[:, heads:])
            v_cache.index_copy_(0, slots, qkv[:, heads + kv_heads:])

        return (lambda: ops.rotate_store(qkv, heads, kv_heads, rotary.cos, rotary.sin, positions, slots, k_cache,
                                         v_cache)), torchs

    return at
