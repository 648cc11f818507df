"""Fused elementwise kernels of the GPU's layer in Triton: RMSNorm, rotary embedding with the KV cache write, and
SwiGLU's silu(gate) x up, each one launch where torch runs several.

At batch 1 an 8B decode step is bandwidth-bound on the weights, and each small op in between costs a launch of
a few microseconds whatever its size: in torch's ops a bf16 RMSNorm is seven kernels (cast, square, mean, add,
rsqrt, multiply, cast, scale), the rotary six, the cache write two, SwiGLU two; 32 layers make ~700 launches a
step, which left the graph-replayed step well above its weight-read floor (docs/performance.md, "The GPU engine").

Each kernel keeps the arithmetic of the torch ops it replaces, roundings included (a bf16 model rounds where
torch's bf16 ops round: the normalized row before the weight, each rotary product and their sum), so greedy
tokens stay those of transformers. Rows go one per program; `TRITON_INTERPRET=1` runs them on the CPU (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@triton.jit
def _rounded(x, KIND: tl.constexpr):
    """fp32 `x` rounded to the nearest value of the model's dtype (ties to even), kept in fp32: what a torch op in
    that dtype stores. bf16 by its bits (Triton's CPU interpreter truncates a cast to bf16; the GPU rounds)."""
    if KIND == 1:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))  # a NaN stays one (its bits would carry)
    elif KIND == 2:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def _rms_norm(x_ptr, weight_ptr, out_ptr, row_stride, out_stride, eps, SIZE: tl.constexpr, WIDTH: tl.constexpr,
              KIND: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # rows x stride passes 2^31 on long prompts (8B SwiGLU: 75K rows)
    columns = tl.arange(0, WIDTH)
    inside = columns < SIZE
    x = tl.load(x_ptr + row * row_stride + columns, mask=inside, other=0.0).to(tl.float32)
    scale = 1.0 / tl.sqrt(tl.sum(x * x, 0) / SIZE + eps)
    normalized = _rounded(x * scale, KIND)  # torch: x.to(dtype), then the weight
    weight = tl.load(weight_ptr + columns, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + columns, _rounded(normalized * weight, KIND).to(out_ptr.dtype.element_ty),
             mask=inside)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / sqrt(mean(x^2) + eps)) over the last dim, computed in fp32 and rounded to x's dtype before the
    weight (as `llama.RMSNorm` and transformers do)."""
    rows = x.reshape(-1, x.shape[-1])
    out = torch.empty_like(rows)
    size = rows.shape[1]
    _rms_norm[(rows.shape[0],)](rows, weight, out, rows.stride(0), out.stride(0), eps, SIZE=size,
                                WIDTH=triton.next_power_of_2(size), KIND=KINDS[x.dtype])
    return out.view(x.shape)


@triton.jit
def _silu_mul(gate_up_ptr, out_ptr, row_stride, SIZE: tl.constexpr, TILE: tl.constexpr, KIND: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # rows x stride passes 2^31 on long prompts (8B SwiGLU: 75K rows)
    columns = tl.program_id(1) * TILE + tl.arange(0, TILE)
    inside = columns < SIZE
    gate = tl.load(gate_up_ptr + row * row_stride + columns, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * row_stride + SIZE + columns, mask=inside, other=0.0).to(tl.float32)
    activated = _rounded(gate / (1.0 + tl.exp(-gate)), KIND)  # torch: silu rounds, then the product
    tl.store(out_ptr + row * SIZE + columns, _rounded(activated * up, KIND).to(out_ptr.dtype.element_ty),
             mask=inside)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a [rows, 2 * size] gate|up projection: [rows, size]."""
    rows, size = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, size), dtype=gate_up.dtype, device=gate_up.device)
    tile = 1024
    _silu_mul[(rows, triton.cdiv(size, tile))](gate_up, out, gate_up.stride(0), SIZE=size, TILE=tile,
                                               KIND=KINDS[gate_up.dtype])
    return out


@triton.jit
def _rotate_store(qkv_ptr, out_ptr, cos_ptr, sin_ptr, positions_ptr, slots_ptr, k_cache_ptr, v_cache_ptr,
                  token_stride, table_stride, cache_slot, HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                  HALF: tl.constexpr, WIDTH: tl.constexpr, KIND: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)  # q heads, then k heads, then v heads
    dims = tl.arange(0, WIDTH)
    inside = dims < HALF
    source = qkv_ptr + token * token_stride + head * 2 * HALF
    first = tl.load(source + dims, mask=inside, other=0.0)
    second = tl.load(source + HALF + dims, mask=inside, other=0.0)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    if head >= HEADS + KV_HEADS:  # a value head: into the cache as it is
        target = v_cache_ptr + slot * cache_slot + (head - HEADS - KV_HEADS) * 2 * HALF
        tl.store(target + dims, first, mask=inside)
        tl.store(target + HALF + dims, second, mask=inside)
    else:
        position = tl.load(positions_ptr + token).to(tl.int64)
        cos = tl.load(cos_ptr + position * table_stride + dims, mask=inside, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + position * table_stride + dims, mask=inside, other=0.0).to(tl.float32)
        x1, x2 = first.to(tl.float32), second.to(tl.float32)
        # torch's ops in the cache's dtype: each product rounds, then their sum
        low = _rounded(_rounded(x1 * cos, KIND) - _rounded(x2 * sin, KIND), KIND).to(first.dtype)
        high = _rounded(_rounded(x2 * cos, KIND) + _rounded(x1 * sin, KIND), KIND).to(first.dtype)
        target = out_ptr + (token * (HEADS + KV_HEADS) + head) * 2 * HALF
        tl.store(target + dims, low, mask=inside)
        tl.store(target + HALF + dims, high, mask=inside)
        if head >= HEADS:  # a key head: into the cache too
            cached = k_cache_ptr + slot * cache_slot + (head - HEADS) * 2 * HALF
            tl.store(cached + dims, low, mask=inside)
            tl.store(cached + HALF + dims, high, mask=inside)


def rotate_store(qkv: torch.Tensor, heads: int, kv_heads: int, cos: torch.Tensor, sin: torch.Tensor,
                 positions: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q and k of a [tokens, heads + 2 kv_heads, head_dim] q|k|v projection rotated by their `positions` (the
    half-split rotary; `cos`, `sin`: [max_position, head_dim] tables whose first halves are used), the rotated keys
    and the values written to cache `slots` ([slots, kv_heads, head_dim] caches); returns q, k, v."""
    tokens, head_dim = qkv.shape[0], qkv.shape[2]
    out = torch.empty((tokens, heads + kv_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    half = head_dim // 2
    _rotate_store[(tokens, heads + 2 * kv_heads)](
        qkv, out, cos, sin, positions, slots, k_cache, v_cache, qkv.stride(0), cos.stride(0), k_cache.stride(0),
        HEADS=heads, KV_HEADS=kv_heads, HALF=half, WIDTH=triton.next_power_of_2(half),
        KIND=KINDS[qkv.dtype])
    return out[:, :heads], out[:, heads:], qkv[:, heads + kv_heads:]


def fits(qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """The layouts `rotate_store` takes: contiguous heads of contiguous dims, the caches alike."""
    return (qkv.stride(2) == 1 and qkv.stride(1) == qkv.shape[2] and k_cache.is_contiguous()
            and v_cache.is_contiguous() and qkv.shape[2] % 2 == 0)


class FusedOps:
    """The `ops.LayerOps` of a CUDA model."""

    rms_norm = staticmethod(rms_norm)
    silu_mul = staticmethod(silu_mul)
    rotate_store = staticmethod(rotate_store)
    fits = staticmethod(fits)
