"""The LLaMA-family transformer in torch (LLaMA, Mistral, Qwen2), reading and writing a paged KV cache.

RMSNorm, rotary embeddings (half-split as in the reference LLaMA; linear and llama3 scaling), grouped-
query attention (optional q/k/v bias, Mistral's sliding window), SwiGLU MLP, optional tied embeddings.
Module names follow Hugging Face's, so a checkpoint's tensors load by name. It computes logits for
given tokens; it does not schedule, allocate blocks or sample. The cache is one tensor per key/value:
[num_layers, num_slots, num_kv_heads, head_dim] with slot = block * block_size + offset.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple, Protocol, TypeGuard, cast

import torch
import torch.nn.functional as F
from torch import nn

from kvcentric.model.config import ModelConfig

LayerHook = Callable[[int, torch.Tensor, torch.Tensor], None]
"""Called as hook(layer, keys, values) once a layer has written the KV of the new tokens to the cache;
keys/values are [new_tokens, num_kv_heads, head_dim] (rotary already applied to keys)."""


class LayerOps(Protocol):
    """Fused versions of a layer's small ops for a device (`kernels/fused.py`, the GPU's), each one launch."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def rotate_store(self, qkv: torch.Tensor, heads: int, kv_heads: int, cos: torch.Tensor, sin: torch.Tensor,
                     positions: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def fits(self, qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool: ...


class SmallGemm(Protocol):
    """A GEMM for few rows over weights in a layout of its own (`kernels.CpuLayerOps`, `kernels/gemm.cpp`)."""

    def pack_panels(self, weight: torch.Tensor) -> torch.Tensor | None: ...

    def small_linear(self, x: torch.Tensor, panels: torch.Tensor, out_features: int, bias: torch.Tensor | None = None,
                     residual: torch.Tensor | None = None) -> torch.Tensor | None: ...


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.ops: LayerOps | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:  # one fused kernel, the same arithmetic
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """Per-pair rotary frequencies, with linear or llama3 scaling applied (as Meta's LLaMA 3.1 defines it)."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = dict(config.rope_scaling)
    kind = scaling.get("rope_type")
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor, low, high = (float(scaling[k]) for k in ("factor", "low_freq_factor", "high_freq_factor"))
        old_context = float(scaling["original_max_position_embeddings"])
        wavelength = 2 * math.pi / inv_freq
        scaled = torch.where(wavelength > old_context / low, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelength - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelength >= old_context / high) & (wavelength <= old_context / low)
        return torch.where(medium, smoothed, scaled)
    if kind:
        raise ValueError(f"rope scaling {kind!r} is not supported (linear, llama3)")
    return inv_freq


class Rotary(nn.Module):
    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        angles = self.angles()
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def angles(self) -> torch.Tensor:
        """[max_position, head_dim] rotation angles, in fp32 on the current default device."""
        angles = torch.outer(torch.arange(self.config.max_position, dtype=torch.float32),
                             rope_inverse_frequencies(self.config))
        return torch.cat([angles, angles], dim=-1)

    def compute_tables(self, device: torch.device, dtype: torch.dtype) -> None:
        """Fill cos and sin on `device` in `dtype` (a model built on the meta device has none): computed
        in fp32 on the CPU, so every device gets the same tables."""
        with torch.device("cpu"):
            angles = self.angles()
        self.cos = angles.cos().to(device, dtype)
        self.sin = angles.sin().to(device, dtype)

    def forward(self, x: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """x: [tokens, heads, head_dim], rotated by the batch's positions into a new tensor. The halves are
        computed apart (x1·cos - x2·sin, x2·cos + x1·sin), with no concatenated copy of x; the position
        tables are gathered once per batch and shared by every layer."""
        if batch.rotation is None:
            half = x.shape[-1] // 2
            batch.rotation = (self.cos[batch.positions, :half].unsqueeze(1).to(x.dtype),
                              self.sin[batch.positions, :half].unsqueeze(1).to(x.dtype))
        cos, sin = batch.rotation
        half = cos.shape[-1]
        x1, x2 = x[..., :half], x[..., half:]
        out = torch.empty_like(x)
        first, second = out[..., :half], out[..., half:]
        torch.mul(x1, cos, out=first)
        first.sub_(x2 * sin)
        torch.mul(x2, cos, out=second)
        second.add_(x1 * sin)
        return out


SMALL_GEMM_ROWS = int(os.environ.get("KVC_SMALL_GEMM_ROWS", "128"))
"""A CPU linear layer over at most this many rows (a decode step's, a small mixed step's) runs through the small
GEMM (`TwoLayouts`; KVC_SMALL_GEMM_ROWS=0: never, and no second layout is made). Against oneDNN over `small`'s 32
weights in turn (`bench/bench_cpu_kernels.py`, 2-core box, 2026-11-27): 1.25-1.48x as fast at 1-32 rows, 1.13x at
64 and 1.07x at 128 on one thread, 1.28-2.21x, 1.18x and 1.08x on two; level at 256 (docs/performance.md,
"Decode's linear layers")."""


class TwoLayouts:
    """A linear layer's fp32 CPU weight in two layouts: oneDNN's (`pack_weight`) for a step of many rows, and the
    small GEMM's panels for one of at most `rows` (`SmallGemm`, `small_rows`). Twice the weight's memory."""

    def __init__(self, blocked: torch.Tensor, panels: torch.Tensor, out_features: int, gemm: SmallGemm,
                 rows: int = SMALL_GEMM_ROWS) -> None:
        self.blocked, self.panels, self.out_features, self.gemm = blocked, panels, out_features, gemm
        self.rows = rows

    def small(self, x: torch.Tensor, bias: torch.Tensor | None,
              residual: torch.Tensor | None = None) -> torch.Tensor | None:
        """The small GEMM's x @ weightᵀ (+ bias) (+ residual), or None where x has too many rows or is not one it
        takes."""
        if x.shape[0] > self.rows:
            return None
        return self.gemm.small_linear(x, self.panels, self.out_features, bias, residual)


Weight = torch.Tensor | TwoLayouts
"""What a fused projection holds: a torch weight (oneDNN's layout or plain), or both CPU layouts."""


def small_rows(gemm: SmallGemm, out_features: int, in_features: int) -> int:
    """Most rows the small GEMM runs for a weight of this shape: the engine's choice where the GEMM comes with one
    (`kernels/chosen.py`: only where it beats torch's GEMM on this CPU), else SMALL_GEMM_ROWS; never more."""
    chosen = getattr(gemm, "small_rows", None)
    return SMALL_GEMM_ROWS if chosen is None else min(SMALL_GEMM_ROWS, chosen(out_features, in_features))


def two_layouts(weight: Weight, gemm: SmallGemm) -> Weight:
    """`weight` with the small GEMM's panels beside it where the GEMM takes it and runs it for some rows (else as it
    is: no second layout)."""
    if isinstance(weight, TwoLayouts):
        return weight
    rows = small_rows(gemm, weight.shape[0], weight.shape[1])
    if rows <= 0:
        return weight
    plain = weight.to_dense() if weight.is_mkldnn else weight  # oneDNN's blocked layout gives the weight back whole
    panels = gemm.pack_panels(plain)
    return weight if panels is None else TwoLayouts(weight, panels, plain.shape[0], gemm, rows)


def projection_shapes(config: ModelConfig) -> list[tuple[int, int, bool]]:
    """(out_features, in_features, with a residual) of a layer's fused projections as `fuse` makes them: q|k|v, o,
    gate|up, down (the ones `TwoLayouts` may hold)."""
    heads, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden, inner = config.hidden_size, config.intermediate_size
    return [(heads + 2 * kv, hidden, False), (hidden, heads, True), (2 * inner, hidden, False), (hidden, inner, True)]


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weightᵀ + bias; a weight packed by `pack_weight` runs through oneDNN's GEMM, a few rows over
    `TwoLayouts` through the small GEMM."""
    if isinstance(weight, TwoLayouts):
        out = weight.small(x, bias)
        if out is not None:
            return out
        weight = weight.blocked
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def linear_add(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None,
               residual: torch.Tensor) -> torch.Tensor:
    """residual + x @ weightᵀ + bias; with a packed weight the sum is the GEMM's own post-op (no pass of its
    own over the result; the same fp32 sum)."""
    if isinstance(weight, TwoLayouts):
        out = weight.small(x, bias, residual)
        if out is not None:
            return out
        weight = weight.blocked
    if weight.is_mkldnn and residual.is_contiguous():
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, weight, bias, "add")
    return residual + linear(x, weight, bias)


def can_pack(weight: torch.Tensor) -> bool:
    """oneDNN takes fp32 weights on the CPU (where torch has it)."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()


PACK_ROWS = 32
"""The row count oneDNN is told to expect when it lays a weight out (`pack_weight`). Its blocked layout runs every
row count measured about as fast whatever the hint (2026-11-26, 2-core box: 8, 32 and 1024 within 2% at M = 8,
32, 256 and 2048)."""


def pack_weight(weight: torch.Tensor, pack: bool) -> torch.Tensor:
    """`weight` in oneDNN's own blocked layout when `pack` (and possible), else as it is. On this project's CPU
    box (2 cores, AVX-512) oneDNN's fp32 GEMM ran 1.6-2.2x faster than the default (MKL's): 444 against 202
    GFLOP/s for 256 x 512 x 2816, 59 against 37 for one row. The blocked layout (`_reorder_linear_weight`, what
    Inductor's freezing packs with) against oneDNN's plain one (`to_mkldnn`), same process, interleaved: 32 rows
    345 → 438 GFLOP/s, 8 rows 189 → 334, 2048 rows 475 → 493; the same sums (bitwise equal at 32 and 2048 rows,
    fp32 rounding at one). Where the reorder op is missing the plain layout is used."""
    weight = weight.detach()
    if not (pack and can_pack(weight)):
        return weight
    reorder = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
    try:
        return reorder(weight.contiguous(), PACK_ROWS) if reorder is not None else weight.to_mkldnn()
    except RuntimeError:
        return weight.to_mkldnn()


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.sliding_window = c.sliding_window
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=c.o_proj_bias)
        self.qkv: tuple[Weight, torch.Tensor | None] | None = None
        self.out: tuple[Weight, torch.Tensor | None] | None = None
        self.ops: LayerOps | None = None

    def fuse(self, pack: bool = False) -> None:
        """One q|k|v matmul instead of three (same numbers, bigger and faster GEMM); call after loading.
        `pack`: the weights go into oneDNN's layout (`pack_weight`), o_proj's too."""
        weight = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])
        bias = torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias]) if self.q_proj.bias is not None \
            else None
        self.qkv = (pack_weight(weight, pack), None if bias is None else bias.detach())
        del self.q_proj, self.k_proj, self.v_proj
        if pack and can_pack(self.o_proj.weight):
            bias = self.o_proj.bias
            self.out = (pack_weight(self.o_proj.weight, pack), None if bias is None else bias.detach())
            del self.o_proj

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.qkv is None:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        sizes = (self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.num_kv_heads * self.head_dim)
        return linear(x, *self.qkv).split(sizes, dim=-1)

    def output(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + o_proj(x)."""
        return residual + self.o_proj(x) if self.out is None else linear_add(x, *self.out, residual)

    def rotated(self, x: torch.Tensor, batch: AttentionBatch, rotary: Rotary,
                qkv: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """q and k rotated (in one pass when q|k|v came from one GEMM, or is given), v: [tokens, heads, head_dim]
        each."""
        tokens, heads, kv_heads = x.shape[0], self.num_heads, self.num_kv_heads
        if self.qkv is None:
            q, k, v = self.project(x)
            return (rotary(q.reshape(tokens, heads, self.head_dim), batch),
                    rotary(k.reshape(tokens, kv_heads, self.head_dim), batch),
                    v.reshape(tokens, kv_heads, self.head_dim))
        if qkv is None:
            qkv = linear(x, *self.qkv).view(tokens, heads + 2 * kv_heads, self.head_dim)
        qk = rotary(qkv[:, :heads + kv_heads], batch)
        return qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads:]

    def stored(self, x: torch.Tensor, batch: AttentionBatch, rotary: Rotary, k_cache: torch.Tensor,
               v_cache: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q and k rotated, v ([tokens, heads, head_dim] each), k and v written to the batch's cache slots: in one
        launch with the fused ops (after the q|k|v GEMM), else rotary then two index copies."""
        qkv = None
        if self.ops is not None and self.qkv is not None:
            qkv = linear(x, *self.qkv).view(x.shape[0], self.num_heads + 2 * self.num_kv_heads, self.head_dim)
            if self.ops.fits(qkv, k_cache, v_cache):
                return self.ops.rotate_store(qkv, self.num_heads, self.num_kv_heads, rotary.cos, rotary.sin,
                                             batch.positions, batch.write_slots, k_cache, v_cache)
        q, k, v = self.rotated(x, batch, rotary, qkv)
        k_cache.index_copy_(0, batch.write_slots, k)
        v_cache.index_copy_(0, batch.write_slots, v)
        return q, k, v

    def forward(self, x, batch: AttentionBatch, rotary: Rotary, k_cache, v_cache, residual):
        """residual + the attention output, and this step's k and v."""
        tokens = x.shape[0]
        q, k, v = self.stored(x, batch, rotary, k_cache, v_cache)
        gqa = self.num_heads != self.num_kv_heads
        padded = None
        rows = batch.padded
        if rows is not None:  # decode: one new token per sequence, one batched call
            if batch.kernels is not None:  # over the cache in place (CPU kernel)
                padded = batch.kernels.decode(q[batch.padded_start:], k_cache, v_cache, rows.blocks, rows.lengths,
                                              batch.block_size, self.sliding_window)
            if padded is None:
                if rows.mask is None:  # rows laid out for the kernels alone (CUDA graphs): SDPA cannot mask them
                    raise RuntimeError("the attention kernels declined decode rows that have no mask")
                keys = gather_blocks(k_cache, rows.blocks, batch.block_size)
                values = gather_blocks(v_cache, rows.blocks, batch.block_size)
                padded = F.scaled_dot_product_attention(q[batch.padded_start:].unsqueeze(2), keys, values,
                                                        attn_mask=rows.mask, enable_gqa=gqa).squeeze(2)
        if padded is not None and batch.padded_start == 0:
            out = padded
        else:  # prefill slices, and in a mixed step the decode rows after them
            out = torch.empty_like(q)
            if padded is not None:
                out[batch.padded_start:] = padded
            fresh = batch.fresh_rows()
            if fresh is not None and batch.kernels is not None and batch.kernels.prefill(q, k, v, out, *fresh):
                fresh = None  # every whole prompt computed by the kernel in one call (fresh: inside any window)
            for run in fresh_runs(batch.sequences) if fresh is not None else ():  # one length: one SDPA call
                start, end, length = run[0].start, run[-1].end, run[0].end - run[0].start
                attended = F.scaled_dot_product_attention(
                    self.heads_first(q[start:end], len(run), length), self.heads_first(k[start:end], len(run), length),
                    self.heads_first(v[start:end], len(run), length), is_causal=True)
                out[start:end] = attended.transpose(1, 2).reshape(end - start, self.num_heads, self.head_dim)
            for seq in batch.sequences:
                if seq.fresh:
                    continue
                keys = self.heads_first(k_cache[seq.context_slots], 1, seq.context_slots.shape[0])
                values = self.heads_first(v_cache[seq.context_slots], 1, seq.context_slots.shape[0])
                attended = F.scaled_dot_product_attention(  # 4-D: the fused kernels want a batch dim
                    q[seq.start:seq.end].transpose(0, 1)[None], keys, values, attn_mask=seq.mask,
                    is_causal=seq.causal)
                out[seq.start:seq.end] = attended[0].transpose(0, 1)
        return self.output(out.reshape(tokens, -1), residual), k, v

    def heads_first(self, x: torch.Tensor, count: int, length: int) -> torch.Tensor:
        """[count, heads, length, head_dim] from `count` runs of `length` rows of [rows, heads, head_dim],
        KV heads repeated to the query heads: the fused CPU kernels take only equal head counts (no GQA)."""
        x = x.view(count, length, x.shape[1], self.head_dim).transpose(1, 2)
        group = self.num_heads // x.shape[1]
        return x.repeat_interleave(group, dim=1) if group > 1 else x


def gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """[batch, kv_heads, blocks * block_size, head_dim] from a [slots, kv_heads, head_dim] cache, copying
    whole blocks (contiguous runs) rather than single slots."""
    by_block = cache.view(-1, block_size, *cache.shape[1:])
    batch, count = blocks.shape
    return by_block[blocks].view(batch, count * block_size, *cache.shape[1:]).transpose(1, 2)


MLP_ROWS = 512
"""A CPU MLP over more rows runs this many at a time: the gate|up output of 512 rows of `small` (5.8 MB) stays in
the cache for SwiGLU and the down projection, where 2048 rows (23 MB) went out to memory and back. The GEMMs
are as fast on 512 rows as on 2048. Measured in one process (2026-11-26, 2-core box, 32 x 256-token prompts in
mixed steps of 2048 tokens, 6 runs alternating): prefill 1.25-1.30 s -> 1.16-1.20 s; 256 rows no better."""


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

        self.gate_up: Weight | None = None
        self.down: Weight | None = None
        self.ops: LayerOps | None = None
        self.look: Callable[[], None] | None = None
        """`LlamaModel.look`, called between the gate|up and the down projection."""

    def fuse(self, pack: bool = False) -> None:
        """One gate|up matmul instead of two; call after loading. `pack`: oneDNN's layout, down_proj's too."""
        self.gate_up = pack_weight(torch.cat([self.gate_proj.weight, self.up_proj.weight]), pack)
        del self.gate_proj, self.up_proj
        if pack and can_pack(self.down_proj.weight):
            self.down = pack_weight(self.down_proj.weight, pack)
            del self.down_proj

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + the MLP of x; on the CPU, MLP_ROWS rows at a time (see there)."""
        if x.shape[0] > MLP_ROWS and self.down is not None and x.device.type == "cpu":
            out = torch.empty_like(residual)
            for start in range(0, x.shape[0], MLP_ROWS):
                part = slice(start, start + MLP_ROWS)
                out[part] = self.compute(x[part], residual[part])
            return out
        return self.compute(x, residual)

    def compute(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            return residual + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate_up = linear(x, self.gate_up)
        if self.look is not None:
            self.look()
        if self.ops is not None and gate_up.dim() == 2 and gate_up.stride(1) == 1:
            hidden = self.ops.silu_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            hidden = F.silu(gate).mul_(up)
        return residual + self.down_proj(hidden) if self.down is None else linear_add(hidden, self.down, None,
                                                                                      residual)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

        self.look: Callable[[], None] | None = None
        """`LlamaModel.look`, called between the attention and the MLP."""

    def forward(self, x, batch, rotary, k_cache, v_cache):
        x, k, v = self.self_attn(self.input_layernorm(x), batch, rotary, k_cache, v_cache, x)
        if self.look is not None:
            self.look()
        return self.mlp(self.post_attention_layernorm(x), x), k, v


class SequenceSlice:
    """One sequence of a prefill batch: its rows in the flat token batch and the slots it attends to."""

    def __init__(self, start: int, end: int, context_slots: torch.Tensor, first_position: int,
                 sliding_window: int | None = None) -> None:
        self.start, self.end, self.context_slots = start, end, context_slots
        new, context = end - start, context_slots.shape[0]
        self.causal = first_position == 0 and new == context and not _window_applies(sliding_window, context)
        self.fresh = self.causal
        """A whole prompt with nothing cached: it attends to its own new keys and values (no cache read)."""
        self.mask = None
        if not self.causal:
            query_pos = torch.arange(first_position, first_position + new, device=context_slots.device).unsqueeze(1)
            key_pos = torch.arange(context, device=context_slots.device).unsqueeze(0)
            self.mask = key_pos <= query_pos
            if _window_applies(sliding_window, context):
                self.mask &= key_pos > query_pos - sliding_window


def fresh_runs(sequences: Sequence[SequenceSlice]) -> list[list[SequenceSlice]]:
    """The fresh sequences (`SequenceSlice.fresh`) in runs of adjacent rows and equal lengths."""
    runs: list[list[SequenceSlice]] = []
    for seq in sequences:
        if not seq.fresh:
            continue
        last = runs[-1][-1] if runs else None
        if last is not None and last.end == seq.start and last.end - last.start == seq.end - seq.start:
            runs[-1].append(seq)
        else:
            runs.append([seq])
    return runs


def _window_applies(window: int | None, context: int) -> TypeGuard[int]:
    return window is not None and context > window


class AttentionKernels(Protocol):
    """Attention kernels of the device (`engine/model/kernels`, the CPU's), each declining what it does not take."""

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
               lengths: torch.Tensor, block_size: int, window: int | None = None) -> torch.Tensor | None:
        """One query row per sequence over its block table's first `lengths` positions, read in place; None
        when declined."""

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, starts: torch.Tensor,
                lengths: torch.Tensor) -> bool:
        """Causal attention of whole prompts (rows starts[s] .. + lengths[s]) over their own k and v, written into
        those rows of `out`; False when declined (nothing written)."""


class PaddedRows(NamedTuple):
    """Decode rows (one new token each) laid out for one attention call (`runner.padded_decode`)."""

    blocks: torch.Tensor
    """[batch, max_blocks] block tables, padded with block 0."""
    mask: torch.Tensor | None
    """[batch, 1, 1, max_blocks * block_size]: the positions each row attends to (None where the kernels always
    take the rows: CUDA graphs)."""
    lengths: torch.Tensor
    """[batch] context lengths, the new token included."""
    write: torch.Tensor
    """The slots their new tokens' KV goes to (on the host)."""


class AttentionBatch:
    """Flattened new tokens with positions and cache addressing: per-sequence slices (prefill), and/or the
    `PaddedRows` of the rows from `padded_start` on (decode, one token per sequence; a mixed step puts them
    after the slices). With `kernels` the decode rows attend through them over the cache in place and
    whole prompts in one call; else (or where they decline) through SDPA, decode rows over a gathered copy."""

    def __init__(self, positions: torch.Tensor, write_slots: torch.Tensor, sequences: Sequence[SequenceSlice] = (),
                 padded: PaddedRows | None = None, block_size: int = 0, padded_start: int = 0,
                 kernels: AttentionKernels | None = None) -> None:
        self.positions, self.write_slots, self.sequences = positions, write_slots, sequences
        self.padded = padded
        self.block_size, self.padded_start = block_size, padded_start
        self.kernels = kernels
        self._fresh: tuple[torch.Tensor, torch.Tensor] | None = None
        self._fresh_made = False
        self.rotation: tuple[torch.Tensor, torch.Tensor] | None = None
        """cos and sin of `positions` (first halves), made by the first layer's rotary and kept for the rest."""

    def fresh_rows(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """First rows and lengths of the whole prompts (`SequenceSlice.fresh`), None without any; made once
        per batch and shared by every layer."""
        if not self._fresh_made:
            fresh = [seq for seq in self.sequences if seq.fresh]
            self._fresh = (torch.tensor([seq.start for seq in fresh]),
                           torch.tensor([seq.end - seq.start for seq in fresh])) if fresh else None
            self._fresh_made = True
        return self._fresh


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie()
        self.rotary = Rotary(config)
        self._look: Callable[[], None] | None = None

    @property
    def look(self) -> Callable[[], None] | None:
        """Called before each layer, between its attention and its MLP, and between the MLP's two projections
        (the lent cores' thread count, `ModelThread.refresh`): three looks a layer take a core freed mid-layer
        sooner, and give one back later, than one look a layer did (docs/performance.md)."""
        return self._look

    @look.setter
    def look(self, fn: Callable[[], None] | None) -> None:
        self._look = fn
        for layer in self.modules():  # a ModuleList, or a pipeline stage's ModuleDict of its own layers
            if isinstance(layer, DecoderLayer):
                layer.look = layer.mlp.look = fn

    def tie(self) -> None:
        """The output projection is the embedding table when the config ties them."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def fuse(self, pack: bool = False) -> LlamaModel:
        """Fuse q|k|v and gate|up projections of every layer (after weights are loaded); `pack`: the layers'
        projections in oneDNN's layout (fp32 on the CPU; elsewhere nothing changes)."""
        for layer in cast("list[DecoderLayer]", self.layers):
            layer.self_attn.fuse(pack)
            layer.mlp.fuse(pack)
        return self

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, batch: AttentionBatch, k_cache: torch.Tensor,
                v_cache: torch.Tensor, logit_rows: torch.Tensor, on_layer: LayerHook | None = None,
                before_layer: Callable[[int], None] | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Run the new tokens through every layer, writing their KV; return fp32 logits of `logit_rows`.
        `before_layer(i)` runs before layer i, `on_layer(i, k, v)` after it; `out`: a [rows, vocab] fp32 tensor the
        logits are written to (the CUDA graphs' shared output) instead of a new one."""
        x = self.embed_tokens(token_ids)
        for index, layer in enumerate(self.layers):
            if self._look is not None:
                self._look()
            if before_layer is not None:
                before_layer(index)
            x, k, v = layer(x, batch, self.rotary, k_cache[index], v_cache[index])
            if on_layer is not None:
                on_layer(index, k, v)
        logits = self.lm_head(self.norm(x[logit_rows]))
        return logits.float() if out is None else out.copy_(logits)


def use_ops(model: nn.Module, ops: LayerOps | None) -> None:
    """Every norm, rotary with cache write, and SwiGLU activation of `model` (a whole model or a pipeline stage's)
    through `ops` (None: torch's ops); with ops that have a small GEMM (`SmallGemm`, the CPU's), the fused
    projections get its layout beside theirs (`TwoLayouts`) where it runs for some rows (`small_rows`)."""
    gemm = cast(SmallGemm, ops) if hasattr(ops, "small_linear") and SMALL_GEMM_ROWS > 0 else None
    for module in model.modules():
        if isinstance(module, (RMSNorm, Attention, MLP)):
            module.ops = ops
        if gemm is not None and isinstance(module, Attention):
            module.qkv = None if module.qkv is None else (two_layouts(module.qkv[0], gemm), module.qkv[1])
            module.out = None if module.out is None else (two_layouts(module.out[0], gemm), module.out[1])
        if gemm is not None and isinstance(module, MLP):
            module.gate_up = None if module.gate_up is None else two_layouts(module.gate_up, gemm)
            module.down = None if module.down is None else two_layouts(module.down, gemm)


def empty_model(config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> LlamaModel:
    """The model with its weights allocated, uninitialised, on `device` in `dtype`: built on the meta device
    (no host copy, no default init, no fp32 temporary), then given memory where it runs; rotary tables filled."""
    with torch.device("meta"):
        model = LlamaModel(config)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.tie()  # moving off the meta device gave the two modules a parameter each
    model.rotary.compute_tables(torch.device(device), dtype)
    return model


DRAW_CHUNK = 1 << 22
"""Elements drawn from one generator: a weight is drawn in chunks of this many, each from a generator of
its own, so the chunks can be drawn in parallel and the weights depend on nothing but seed and name."""


def chunk_seed(seed: int, name: str, chunk: int) -> int:
    """The seed of one chunk's generator, from the model's seed, the parameter's name and the chunk's index
    (not the order of the parameters, their shapes, or how many threads draw)."""
    return (seed * 1_000_003 + zlib.crc32(f"{name}:{chunk}".encode())) % (1 << 63)


def random_init(model: LlamaModel, seed: int, std: float = 0.02) -> LlamaModel:
    """Seeded random weights ("dummy" model), drawn in place where the weights are and in their dtype (no
    fp32 temporary), chunk by chunk (`DRAW_CHUNK`), on the CPU by torch's threads in parallel. The same seed
    gives the same model in any process on the same kind of device and dtype (CUDA's generator is not the
    CPU's, so a CPU and a GPU model differ)."""
    draws: list[tuple[torch.Tensor, int]] = []
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                flat = param.detach().view(-1)
                draws += [(flat[start:start + DRAW_CHUNK], chunk_seed(seed, name, start // DRAW_CHUNK))
                          for start in range(0, flat.numel(), DRAW_CHUNK)]

    def draw(chunk: tuple[torch.Tensor, int]) -> None:
        values, chunk_seed_ = chunk
        values.normal_(0.0, std, generator=torch.Generator(device=values.device).manual_seed(chunk_seed_))

    on_cpu = bool(draws) and draws[0][0].device.type == "cpu"
    with concurrent.futures.ThreadPoolExecutor(max(1, torch.get_num_threads()) if on_cpu else 1) as pool:
        list(pool.map(draw, draws))
    return model


def load_checkpoint(model: LlamaModel, directory: str) -> LlamaModel:
    """Copy a Hugging Face checkpoint's safetensors into the model by name, each tensor read straight to
    the model's device (safetensors' `safe_open`) and converted to its dtype there, one at a time; missing
    or extra tensors fail."""
    from safetensors import safe_open

    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{directory} has no *.safetensors files")
    params = dict(model.named_parameters())
    device = str(next(iter(params.values())).device)
    loaded = set()
    with torch.no_grad():
        for file in files:
            with safe_open(str(file), framework="pt", device=device) as tensors:
                for stored in tensors.keys():  # noqa: SIM118 - safe_open is not a mapping
                    name = stored.removeprefix("model.")
                    if name not in params:
                        if "rotary_emb" in name:
                            continue
                        raise ValueError(f"{file.name}: unexpected tensor {name}")
                    params[name].copy_(tensors.get_tensor(stored))
                    loaded.add(name)
    missing = set(params) - loaded - ({"lm_head.weight"} if model.config.tie_word_embeddings else set())
    if missing:
        raise ValueError(f"{directory}: tensors missing from the checkpoint: {sorted(missing)[:5]}")
    return model
